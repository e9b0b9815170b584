"""First step of a restarted daemon on a big plain jsonl object: the line index from the node cache, or counted.

A daemon's raw fill of a plain jsonl object builds the object's line index
(sluice/tokenize/lineindex.py); since the index is a node-cache object
(lineindexfile.py) a restarted daemon, whose raw fetch is a hit, reads it
instead of counting every line up to the furthest record its first step
needs (0.2-0.4 s per GB). Per round and per tree (this one, and `--base TREE`
for the code before, e.g. `git archive` of an earlier commit), interleaved:

1. first run (a process): a fresh node cache, DocSource + the first step
   (`StepMaker.produce_step`, block order): the raw fill, its index, the
   demand path; closed before the token fill ends (nothing but the raw object
   and, with the new code, its index are cached);
2. restarted run (another process, same cache): the tokenizer loaded, then
   timed from the DocSource's creation to the first step made (the raw fetch
   is a hit, the tokens are not cached).

    .venv/bin/python bench/restart_index.py --base /tmp/base --rounds 3 \\
        bench/peers/work/full/sweep-300 bench/peers/work/full/sweep-1000

Prints one line per run and a JSON summary (medians per object and tree).
Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import sys

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow the standard library.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent


def child(tree: str, folder: str, cache_dir: str, phase: str) -> None:
    """One run of one tree's code (in its own process): print a JSON line."""
    sys.path.insert(0, tree)
    from sluice.cache import NodeCache
    from sluice.loaderd.logical import Plan
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec
    from sluice.tokenize import encoder_for_manifest

    root = Path(folder)
    manifest = load_manifest(root / "manifest.json")
    spec = load_runspec(root / "run-block.toml" if (root / "run-block.toml").exists() else root / "run.toml")
    encoder = encoder_for_manifest(manifest)
    encoder.encode_batch(["warm up"])
    plan = Plan(manifest, spec)
    with NodeCache(Path(cache_dir), 8 << 30) as cache:
        os.sync()
        t = time.perf_counter()
        docs = DocSource(manifest, cache, encoder)
        try:
            StepMaker(plan, docs, replica=0, replicas=1).produce_step(plan.initial_state())
            step0 = time.perf_counter() - t
            indexes = getattr(docs, "line_indexes", None)
            out = {"phase": phase, "step0_s": step0, "docs": docs.calls, "indexed_objects": docs.indexed_objects,
                   "index_loaded": getattr(indexes, "loaded", None), "index_stored": getattr(indexes, "stored", None)}
        finally:
            docs.close()
    print(json.dumps(out), flush=True)


def run(tree: str, folder: str, cache_dir: str, phase: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", tree, folder, cache_dir, phase],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{phase} run of {tree} on {folder} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(*argv[1:5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="one-object manifest folders (bench/peers/work/full/sweep-*)")
    ap.add_argument("--base", help="a tree with the code to compare against (e.g. git archive of a commit)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    trees = {"new": str(_ROOT)} | ({"base": args.base} if args.base else {})
    results: dict[str, dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        for folder in args.folders:
            names = list(trees) if r % 2 == 0 else list(trees)[::-1]  # interleaved, alternating first
            for name in names:
                d = tempfile.mkdtemp(prefix="restart-index-")
                try:
                    run(trees[name], folder, d, "first")
                    got = run(trees[name], folder, d, "restart")
                finally:
                    shutil.rmtree(d)
                got["load"] = os.getloadavg()[0]
                results.setdefault(folder, {}).setdefault(name, []).append(got)
                print(f"round {r} {Path(folder).name} {name}: restarted step 0 {got['step0_s']:.3f} s "
                      f"({got['docs']} documents; index loaded {got['index_loaded']}, load {got['load']:.1f})",
                      flush=True)
    summary = {folder: {name: {"median_step0_s": statistics.median(x["step0_s"] for x in runs),
                               "runs": [round(x["step0_s"], 3) for x in runs]}
                        for name, runs in per.items()} for folder, per in results.items()}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
