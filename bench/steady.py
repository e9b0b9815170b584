"""Benchmark: the daemon's CPU per micro-batch in the steady state, per thread (issue 9, pre-tokenized steady rate).

The steady delivered rate from cached tokens is bound by the daemon's CPU per
micro-batch (bench/results/peers-log.md, "Pre-tokenized steady rate"). A wall-clock
rate over a short window swings with the load of a shared machine; thread CPU
does much less, so this bench reports where the daemon's CPU goes:

* one consumer process per job (``python -c``, working directory = the tree
  under test, so the consumer and the embedded daemon it starts import sluice
  from that tree) takes `--warm` micro-batches, then reads every thread's
  utime + stime of the daemon (and of its worker processes) from
  ``/proc/PID/task/TID/stat``, takes `--mbs` micro-batches (with the corpus's
  run.toml 8 x 2048 ids, the bench/peers job's shape: one micro-batch per
  step; `--runspec` for another), reads them again;
* per micro-batch: the IO loop (the daemon's main thread), libzmq's IO threads
  (``ZMQbg/*``, no GIL), and the other Python threads, largest first: the
  producer (``loaderd-replica-N``; Python does not name OS threads, so by
  rank) then pyzmq's garbage-collector thread (it releases zero-copy frames);
  worker processes' threads apart (``child``); the client's own
  CPU; the wall-clock rate of the window (noisy on a shared machine);
* ``--base DIR`` runs the same jobs from another source tree (``git archive REV
  | tar -x -C DIR``), interleaved in the same rounds.

Corpus: a prepared bench/peers corpus (``bench/peers/work/full``; `make bench-peers` builds it), read
as one of two variants (`--variant`): ``pretok``, its pre-tokenized ``derived/manifest.json`` and
``cache-pretok``; ``tokcache``, the raw ``manifest.json`` with every object's tokens in the node cache
``cache-tok`` (issue 9 item 1, what ``sluice tokcache`` in bench/peers fills).
Prints one line per job, then medians over rounds; writes bench/out/steady.json.

``--work-ms MS`` makes the consumer busy for MS per micro-batch (a trainer slower
than the producer, which then waits at its lead bound); ``--sleep-ms MS`` makes it
sleep MS per micro-batch instead (a trainer waiting for its accelerator: the CPUs
idle between batches, and every thread the daemon wakes starts cold; the client's
CPU then includes its sleep's wake-up). ``--max-steps N`` runs
the run spec with ``max_steps = N`` (a run that declares its length: the daemon
loads the compiled kernel at its first step when N leaves 2,048 steps or more,
physical/jitstart.py; take ``--warm`` + ``--mbs`` <= N micro-batches). ``--micro-per-step K``
runs it with K micro-batches a step (``global_batch`` = K x ``micro_batch``, as a
trainer that accumulates gradients; the figures stay per micro-batch).

Run: ``.venv/bin/python bench/steady.py [--rounds 5] [--mbs 4000] [--work-ms 0] [--sleep-ms 0]
[--variant pretok|tokcache] [--max-steps N] [--micro-per-step K] [--credits N[,N...]] [--daemon-args ARGS ...]
[--base DIR]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent

CONSUMER = r"""
import json, os, sys, time
from sluice.client import embedded_client

cfg = json.loads(sys.argv[1])
TICK = os.sysconf("SC_CLK_TCK")


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rindex(")") + 2:].split()
        out[(pid, int(tid), s[s.index("(") + 1:s.rindex(")")])] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def family(pid):
    pids = [pid]
    try:
        pids += [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        pass
    got = {}
    for p in pids:
        got.update(threads(p))
    return got


c = embedded_client(cfg["manifest"], cfg["runspec"], cache_dir=cfg["cache"], as_numpy=True,
                    daemon_args=tuple(cfg["daemon_args"]),
                    **({"credits": cfg["credits"]} if cfg.get("credits") else {}))
try:
    it = iter(c)
    for _ in range(cfg["warm"]):
        next(it)
    pid = c.daemon.proc.pid
    before, c0, t0 = family(pid), time.process_time(), time.perf_counter()
    tokens = 0
    work, rest = cfg.get("work_ms", 0.0) / 1e3, cfg.get("sleep_ms", 0.0) / 1e3
    for _ in range(cfg["mbs"]):
        ids = next(it)["input_ids"]
        int(ids.sum())
        tokens += ids.size
        if work:  # a trainer's step: the consumer busy, the producer waiting at its lead bound
            until = time.perf_counter() + work
            while time.perf_counter() < until:
                pass
        if rest:  # a trainer waiting for its accelerator: the CPUs idle
            time.sleep(rest)
    wall, client = time.perf_counter() - t0, time.process_time() - c0
    after = family(pid)
finally:
    c.close()
n = cfg["mbs"]
io = zmq = 0.0
others = {"daemon": [], "child": []}
for (p, tid, name), v in after.items():
    ms = (v - before.get((p, tid, name), 0.0)) / n * 1e3
    if name.startswith("ZMQbg"):
        zmq += ms
    elif p == pid and tid == pid:
        io = ms
    else:
        others["daemon" if p == pid else "child"].append(ms)
for k in others:
    others[k].sort(reverse=True)
print(json.dumps({"tokens_per_s": tokens / wall, "client_ms": client / n * 1e3, "io_ms": io, "zmq_ms": zmq,
                  "threads_ms": others["daemon"][:2], "child_threads_ms": others["child"][:2],
                  "daemon_ms": sum(after.values()) / n * 1e3 - sum(before.values()) / n * 1e3}))
"""


def job(tree: Path, cfg: dict, timeout_s: float, consumer: str = CONSUMER) -> dict:
    """One `consumer` process (`python -c`) run from `tree`; its last JSON line, or {"error": ...}."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        proc = subprocess.run([sys.executable, "-c", consumer, json.dumps(cfg)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


def warm_kernel(tree: Path, timeout_s: float = 300.0) -> None:
    """Compile `tree`'s fused kernel into numba's cache before it is measured (a job stops its daemon, and the
    compile child with it, long before a cold compile ends: a fresh tree would never run the kernel). A tree
    from before ``python -m sluice.loaderd.physical.jitload`` warmed does nothing here."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        rc = subprocess.run([sys.executable, "-m", "sluice.loaderd.physical.jitload"], cwd=tree, env=env,
                            capture_output=True, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    if rc != 0:
        print(f"bench/steady.py: note: {tree}: the compiled kernel did not load ({rc}); it runs on numpy",
              file=sys.stderr)


def with_changes(runspec: Path, max_steps: int, micro_per_step: int) -> Path:
    """A copy of `runspec` (in a temporary folder) with `max_steps` set (0: as it is; a top-level key, so written
    first) and `micro_per_step` micro-batches a step (``global_batch`` = that many ``micro_batch``; 0: as it is)."""
    import re
    import tempfile
    import tomllib

    if not runspec.is_file():
        raise SystemExit(f"bench/steady.py: error: run spec {runspec} is not a file")
    text = runspec.read_text()
    spec = tomllib.loads(text)
    if max_steps and "max_steps" in spec:
        raise SystemExit(f"bench/steady.py: error: {runspec} sets max_steps already; leave --max-steps out")
    if micro_per_step:
        text, n = re.subn(r"(?m)^global_batch\s*=.*$", f"global_batch = {micro_per_step * spec['micro_batch']}", text)
        if n != 1:
            raise SystemExit(f"bench/steady.py: error: {runspec} has no one top-level global_batch line to change")
    out = Path(tempfile.mkdtemp(prefix="steady-runspec-")) / runspec.name
    out.write_text((f"max_steps = {max_steps}\n" if max_steps else "") + text)
    return out


def micro_per_step(runspec: Path, asked: int) -> int:
    """Micro-batches a step of the one replica: `asked` (``--micro-per-step``), else the run spec's
    ``global_batch / micro_batch`` (1 where it cannot be read: the daemon then says what is wrong)."""
    import tomllib

    if asked:
        return asked
    try:
        spec = tomllib.loads(runspec.read_text())
        return max(1, int(spec["global_batch"]) // int(spec["micro_batch"]))
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError, tomllib.TOMLDecodeError):
        return 1


def line(label: str, r: dict) -> str:
    if "error" in r:
        return f"{label:12s} error: {r['error']}"
    producer = r["threads_ms"]
    return (f"{label:12s} {r['tokens_per_s'] / 1e6:6.1f} M tok/s  daemon {r['daemon_ms']:.3f} ms/mb: "
            f"IO loop {r['io_ms']:.3f}, producer {producer[0] if producer else 0:.3f}, "
            f"other Python {sum(producer[1:]):.3f}, child {sum(r['child_threads_ms']):.3f}, "
            f"libzmq {r['zmq_ms']:.3f}; client {r['client_ms']:.3f}")


def interleaved(trees: list[tuple[str, Any]], rounds: int, run: Callable[[Any], dict],
                show: Callable[[str, dict], str]) -> dict[str, list[dict]]:
    """Each tree's `run(tree)` result per round, the trees taken in turn within every round (so a load
    change hits all alike), each printed as it comes with `show(label, result)`."""
    results: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for rnd in range(rounds):
        for label, tree in trees:
            r = run(tree)
            results[label].append(r)
            print(f"round {rnd + 1}/{rounds} " + show(label, r), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/steady.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=str(_REPO / "bench/peers/work/full"), help="a prepared bench/peers corpus")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--mbs", type=int, default=4000, help="micro-batches measured per job (default 4000)")
    ap.add_argument("--warm", type=int, default=100, help="micro-batches taken before measuring (default 100)")
    ap.add_argument("--variant", choices=("pretok", "tokcache"), default="pretok",
                    help="pretok: the derived manifest and cache-pretok (default); tokcache: the raw manifest.json "
                         "with its tokens in cache-tok")
    ap.add_argument("--runspec", help="run spec (default: the corpus's run.toml)")
    ap.add_argument("--work-ms", type=float, default=0.0,
                    help="CPU the consumer spends per micro-batch (a trainer slower than the producer; default 0)")
    ap.add_argument("--sleep-ms", type=float, default=0.0,
                    help="milliseconds the consumer sleeps per micro-batch (a trainer waiting for its accelerator; "
                         "default 0)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="the run spec with max_steps = N (a run that declares its length; default: as it is)")
    ap.add_argument("--micro-per-step", type=int, default=0, metavar="K",
                    help="the run spec with K micro-batches a step (global_batch = K x micro_batch: gradient "
                         "accumulation; default: as it is)")
    ap.add_argument("--credits", default="", help="the client's credits, or several to compare, comma-separated "
                                                  "(default: the client's own)")
    ap.add_argument("--daemon-args", action="append", default=None, metavar="ARGS",
                    help="the daemon's extra flags (one string, e.g. '--gil-cpu off'); repeat to compare several "
                         "sets, interleaved (default: none, every default)")
    ap.add_argument("--base", metavar="TREE", help="also run from this source tree, interleaved")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    a = ap.parse_args(argv)
    corpus = Path(a.corpus).resolve()  # (a job runs in its tree: --base)
    manifest, cache = (("derived/manifest.json", "cache-pretok") if a.variant == "pretok"
                       else ("manifest.json", "cache-tok"))
    if not (corpus / manifest).exists() or not (corpus / cache).is_dir():
        print(f"bench/steady.py: error: {corpus} holds no prepared {a.variant} corpus ({manifest} and {cache}/); "
              f"run `make bench-peers` (or bench/peers/run.py --peers 'sluice {a.variant}') once", file=sys.stderr)
        return 2
    runspec = Path(a.runspec).resolve() if a.runspec else corpus / "run.toml"
    if a.max_steps and a.max_steps * micro_per_step(runspec, a.micro_per_step) < a.warm + a.mbs:
        print(f"bench/steady.py: error: --max-steps {a.max_steps} ends the stream before --warm + --mbs "
              f"({a.warm + a.mbs}) micro-batches", file=sys.stderr)
        return 2
    if a.max_steps or a.micro_per_step:
        runspec = with_changes(runspec, a.max_steps, a.micro_per_step)
    cfg = {"manifest": str(corpus / manifest), "runspec": str(runspec),
           "cache": str(corpus / cache), "mbs": a.mbs, "warm": a.warm, "work_ms": a.work_ms,
           "sleep_ms": a.sleep_ms}
    trees = [("this", _REPO)] + ([("base", Path(a.base).resolve())] if a.base else [])
    for _, tree in trees:
        warm_kernel(tree)
    credits = [int(c) for c in a.credits.split(",")] if a.credits else [0]
    flag_sets = a.daemon_args or [""]
    jobs = [(label + ("" if len(credits) == 1 else f"/c{n}") + ("" if len(flag_sets) == 1 else f" [{f}]"),
             (tree, n, f.split())) for label, tree in trees for n in credits for f in flag_sets]
    results = interleaved(jobs, a.rounds, lambda tp: job(tp[0], {**cfg, "daemon_args": tp[2], "credits": tp[1]},
                                                         a.timeout), line)
    summary = {}
    for label, runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            continue
        med = {k: statistics.median(r[k] for r in good) for k in ("tokens_per_s", "daemon_ms", "io_ms", "zmq_ms",
                                                                 "client_ms")}
        for k in ("threads_ms", "child_threads_ms"):
            width = max(len(r[k]) for r in good)
            med[k] = [statistics.median(r[k][i] for r in good if len(r[k]) > i) for i in range(width)]
        summary[label] = med
        print("median   " + line(label, med))
    out = _REPO / "bench/out/steady.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "steady", "variant": a.variant, "mbs": a.mbs, "warm": a.warm,
                               "rounds": a.rounds, "base": a.base, "work_ms": a.work_ms, "sleep_ms": a.sleep_ms,
                               "max_steps": a.max_steps, "micro_per_step": a.micro_per_step,
                               "command": " ".join(sys.argv), "runs": results, "medians": summary}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
