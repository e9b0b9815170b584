"""Benchmark: one daemon serving several replicas, each drained by its own consumer process, by daemon flags.

A node's daemon serves every rank on the node (one replica each). This bench
starts one `loaderd` for R replicas of a prepared bench/peers corpus (the
pre-tokenized variant: ``derived/manifest.json`` and ``cache-pretok``; `make
bench-peers` builds it) and R consumer processes, each a `Client` of one
replica taking 8 x 2048 micro-batches as fast as they come for `--seconds`
after `--warm` micro-batches; the run spec is the corpus's (8 lanes) with
``global_batch = 8 * R``, so each replica's step is one micro-batch.
Every `--daemon-args` set (repeatable; default: the defaults) runs once a
round, the sets in turn within a round (interleaved), `--rounds` rounds.

Prints each job's total M tokens/s (all replicas) and each replica's, then
medians; writes bench/out/replicas.json. It answers how daemon flags (e.g.
``--gil-cpu auto`` against ``off``) behave when one daemon serves several
busy replicas; on a 2-CPU machine the consumers share the cores with the daemon.

Run: ``.venv/bin/python bench/replicas.py --replicas 2 --daemon-args='--gil-cpu auto'
--daemon-args='--gil-cpu off'``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

CONSUMER = r"""
import json, sys, time
from sluice.client import Client

cfg = json.loads(sys.argv[1])
c = Client(cfg["endpoint"], cfg["replica"], cfg["replicas"], run_id=cfg["run_id"], dataset_id=cfg["dataset_id"],
           token=cfg["token"], as_numpy=True)
try:
    it = iter(c)
    for _ in range(cfg["warm"]):
        next(it)
    t0, tokens = time.perf_counter(), 0
    while time.perf_counter() - t0 < cfg["seconds"]:
        ids = next(it)["input_ids"]
        int(ids.sum())
        tokens += ids.size
    print(json.dumps({"tokens_per_s": tokens / (time.perf_counter() - t0), "gil_cpu": c.stats().get("gil_cpu")}))
finally:
    c.close()
"""


def job(corpus: Path, runspec: Path, replicas: int, flags: list[str], warm: int, seconds: float) -> dict:
    """One daemon for `replicas` replicas with `flags`, drained by one consumer process a replica."""
    from sluice.client.embedded import EmbeddedDaemon

    daemon = EmbeddedDaemon(corpus / "derived" / "manifest.json", runspec, cache_dir=corpus / "cache-pretok",
                            replicas=replicas, serve=tuple(range(replicas)), extra_args=tuple(flags))
    try:
        procs = []
        for r in range(replicas):
            cfg = {"endpoint": daemon.endpoint, "replica": r, "replicas": replicas, "run_id": daemon.run_id,
                   "dataset_id": daemon.dataset_id, "token": daemon.token, "warm": warm, "seconds": seconds}
            procs.append(subprocess.Popen([sys.executable, "-c", CONSUMER, json.dumps(cfg)], cwd=_REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        got = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 120)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                return {"error": (err.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
            got.append(json.loads(lines[-1]))
    finally:
        daemon.close()
    rates = [g["tokens_per_s"] for g in got]
    return {"total": sum(rates), "per_replica": rates, "gil_cpu": got[0]["gil_cpu"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/replicas.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=str(_REPO / "bench/peers/work/full-mixture"),
                    help="a prepared bench/peers corpus (default: the mixture one)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas the daemon serves, one consumer each")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds each consumer drains (default 8)")
    ap.add_argument("--warm", type=int, default=500, help="micro-batches each consumer takes first (default 500)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--daemon-args", action="append", default=None, metavar="ARGS",
                    help="daemon flags of one job kind (repeatable; default: the defaults)")
    a = ap.parse_args(argv)
    corpus = Path(a.corpus)
    if not (corpus / "derived" / "manifest.json").exists() or not (corpus / "cache-pretok").is_dir():
        print(f"bench/replicas.py: error: {corpus} holds no prepared pretok corpus; run `make bench-peers` once",
              file=sys.stderr)
        return 2
    if a.replicas < 1:
        print("bench/replicas.py: error: --replicas must be at least 1", file=sys.stderr)
        return 2
    text = (corpus / "run.toml").read_text()
    runspec = Path(tempfile.mkdtemp(prefix="replicas-runspec-")) / "run.toml"
    # one micro-batch a replica's step; a length that outlasts the job (so the compiled kernel loads at once)
    body = "".join(ln + "\n" for ln in text.splitlines() if not ln.startswith(("global_batch", "max_steps")))
    runspec.write_text(f"max_steps = 1000000\nglobal_batch = {8 * a.replicas}\n{body}")
    flag_sets = a.daemon_args or [""]
    results: dict[str, list[dict]] = {f: [] for f in flag_sets}
    for rnd in range(a.rounds):
        for flags in flag_sets:
            r = job(corpus, runspec, a.replicas, shlex.split(flags), a.warm, a.seconds)
            results[flags].append(r)
            shown = r["error"] if "error" in r else (
                f"{r['total'] / 1e6:6.1f} M tok/s ({', '.join(f'{x / 1e6:.1f}' for x in r['per_replica'])})")
            print(f"round {rnd + 1}/{a.rounds} [{flags or 'defaults'}] {shown}", flush=True)
    print()
    for flags, rs in results.items():
        ok = [r["total"] for r in rs if "error" not in r]
        print(f"median [{flags or 'defaults'}] {statistics.median(ok) / 1e6:6.1f} M tok/s total, {a.replicas} "
              f"replicas ({len(ok)}/{len(rs)} jobs)" if ok else f"[{flags or 'defaults'}] every job failed")
    out = _REPO / "bench" / "out" / "replicas.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "replicas", "replicas": a.replicas, "seconds": a.seconds,
                               "rounds": a.rounds, "when": time.strftime("%Y-%m-%d %H:%M"),
                               "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
