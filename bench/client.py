"""Benchmark: the client's CPU per micro-batch in the trainer's process (issues 9 and 23, steady rate from tokens).

From cached or pre-tokenized tokens the daemon and the consumer share the
cores, so the client's own CPU per micro-batch (GET encoding, receiving,
header decoding and validation, the order checks, the arrays as tensors) is
taken from the trainer's rate. Each job is one consumer process (``python
-c``, working directory and PYTHONPATH = the tree under test) with an embedded
daemon on a prepared bench/peers corpus (``bench/peers/work/full``:
``derived/manifest.json``, ``cache-pretok``, ``run.toml``: 8 x 2048 ids, one
micro-batch per step), read as numpy, or with ``--torch`` as torch tensors
(the client's default, what the bench/peers jobs take). It takes `--warm`
micro-batches, then `--mbs` more, touching each (a sum over input_ids), and
reports per micro-batch:

* the consumer thread's CPU (`time.thread_time`): all of it (the client's
  Python and the consumer's sum), the part inside ``next()`` (the client's
  own, timed around each call: two clock reads more), and the sum alone
  (timed after, on one batch); with ``--step-ms MS`` (a trainer's step: the
  consumer sleeps MS between micro-batches, as a trainer waiting for its
  GPU, so replies wait queued and caches go cold);
* the consumer process's other threads (``/proc/self/task``): libzmq's IO
  thread (``ZMQbg/*``: receiving the bytes, sending the GETs), anything else;
* the client's whole CPU (inside ``next()`` + those threads)
  and the wall-clock rate (noisy on a shared machine; the client's CPU per
  micro-batch also rises when it waits for a slow daemon: compare within one
  run only).

``--base DIR`` (repeatable) runs the same jobs from another tree (``git archive main | tar
-x -C DIR``), interleaved round by round. Prints one line per job and the
medians; writes bench/out/client.json.

Run: ``.venv/bin/python bench/client.py [--rounds 5] [--mbs 3000] [--torch] [--step-ms 0] [--base DIR]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent

CONSUMER = r"""
import json, os, sys, time
from sluice.client import embedded_client

cfg = json.loads(sys.argv[1])
ME = os.getpid()


def cpu_by_thread():
    # {(tid, name): CPU seconds} of this process's threads; schedstat's first field is the thread's time on a
    # CPU in ns (stat's utime and stime count 10 ms ticks: 3000 micro-batches of libzmq are ~15 ticks)
    got = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                got[(int(tid), name)] = int(f.read().split()[0]) / 1e9
        except OSError:
            continue
    return got


c = embedded_client(cfg["manifest"], cfg["runspec"], cache_dir=cfg["cache"], as_numpy=not cfg["torch"])
try:
    it = iter(c)
    for _ in range(cfg["warm"]):
        last = next(it)
    before = cpu_by_thread()
    tt, step_s, inside = time.thread_time, cfg["step_ms"] / 1e3, 0.0
    t0, w0 = tt(), time.perf_counter()
    for _ in range(cfg["mbs"]):
        if step_s:
            time.sleep(step_s)  # waiting, as a trainer for its GPU: the daemon gets ahead on these 2 cores
        t1 = tt()
        batch = next(it)
        inside += tt() - t1
        int(batch["input_ids"].sum())
    cpu = tt() - t0
    wall = time.perf_counter() - w0
    after = cpu_by_thread()
finally:
    c.close()
ids = last["input_ids"]  # the consumer's own part of cpu: the same sum, alone
t0 = time.thread_time()
for _ in range(cfg["mbs"]):
    int(ids.sum())
touch = time.thread_time() - t0
n = cfg["mbs"]
zmq = other = 0.0
for (tid, name), v in after.items():
    if tid != ME:
        ms = (v - before.get((tid, name), 0.0)) / n * 1e3
        if name.startswith("ZMQbg"):
            zmq += ms
        else:
            other += ms
print(json.dumps({"client_ms": cpu / n * 1e3, "next_ms": inside / n * 1e3, "touch_ms": touch / n * 1e3,
                  "zmq_ms": zmq, "other_ms": other,
                  "tokens_per_s": n * 8 * 2048 / wall}))
"""


def job(tree: Path, cfg: dict, timeout_s: float) -> dict:
    """One consumer process run from `tree` (bench/steady.py's runner); its JSON line, or {"error": ...}."""
    return _steady().job(tree, cfg, timeout_s, consumer=CONSUMER)


def _steady():
    spec = importlib.util.spec_from_file_location("bench_steady", _REPO / "bench/steady.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KEYS = ("client_ms", "next_ms", "touch_ms", "zmq_ms", "other_ms", "tokens_per_s")


def _whole(r: dict) -> float:
    """The client's CPU per micro-batch in ms: the consumer thread's inside next() and the process's other threads."""
    return r["next_ms"] + r["zmq_ms"] + r["other_ms"]


def line(label: str, r: dict) -> str:
    if "error" in r:
        return f"{label:5s} error: {r['error']}"
    return (f"{label:5s} consumer thread {r['client_ms']:.4f} ms CPU per micro-batch, in next() {r['next_ms']:.4f} "
            f"(the sum alone {r['touch_ms']:.4f}); libzmq {r['zmq_ms']:.4f}, other threads {r['other_ms']:.4f}; "
            f"client whole {_whole(r):.4f}  {r['tokens_per_s'] / 1e6:5.1f} M tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/client.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=str(_REPO / "bench/peers/work/full"), help="a prepared bench/peers corpus")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--mbs", type=int, default=3000, help="micro-batches measured per job (default 3000)")
    ap.add_argument("--warm", type=int, default=100, help="micro-batches taken before measuring (default 100)")
    ap.add_argument("--base", metavar="TREE", action="append", default=[],
                    help="also run from this source tree, interleaved (repeatable: base, base2, ...)")
    ap.add_argument("--torch", action="store_true",
                    help="take torch tensors (the client's default, what bench/peers' jobs take), not numpy")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="a trainer's step: the consumer sleeps MS between micro-batches, so replies wait queued "
                         "(the consumer thread's CPU is then timed inside next() only); default 0: as fast as "
                         "it can, the client waiting for the daemon")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    a = ap.parse_args(argv)
    corpus = Path(a.corpus)
    if not (corpus / "derived/manifest.json").exists():
        print(f"bench/client.py: error: {corpus} holds no prepared corpus (derived/manifest.json); "
              "run `make bench-peers` (or bench/peers/run.py --peers 'sluice pretok') once", file=sys.stderr)
        return 2
    cfg = {"manifest": str(corpus / "derived/manifest.json"), "runspec": str(corpus / "run.toml"),
           "cache": str(corpus / "cache-pretok"), "mbs": a.mbs, "warm": a.warm, "torch": a.torch,
           "step_ms": a.step_ms}
    trees = [("this", _REPO)] + [("base" + (str(i + 1) if i else ""), Path(b).resolve()) for i, b in enumerate(a.base)]
    results = _steady().interleaved(trees, a.rounds, lambda tree: job(tree, cfg, a.timeout), line)
    medians = {}
    for label, runs in results.items():
        good = [r for r in runs if "error" not in r]
        if good:
            medians[label] = {k: statistics.median(r[k] for r in good) for k in KEYS}
            print("median      " + line(label, medians[label]))
    for label in medians:
        if label != "this" and "this" in medians:
            this, other = medians["this"], medians[label]
            print(f"this / {label}: consumer thread CPU {this['client_ms'] / other['client_ms']:.3f}, in next() "
                  f"{this['next_ms'] / other['next_ms']:.3f}, client's whole CPU {_whole(this) / _whole(other):.3f}")
    out = _REPO / "bench/out/client.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "client", "mbs": a.mbs, "warm": a.warm, "rounds": a.rounds, "torch": a.torch,
                               "step_ms": a.step_ms, "base": [Path(b).name for b in a.base],  # (no machine paths)
                               "runs": results, "medians": medians}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
