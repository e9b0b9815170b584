"""Benchmark: an on-the-fly job's start, cold node cache: `embedded_client()`, first micro-batch, the rest.

Each job is a fresh trainer process (``python -c``) that imports torch (as a
trainer does; timed apart: the same for every loader), starts an embedded
daemon on a new, empty node cache and takes every micro-batch of the bench's
quick corpus (``bench/peers/work/quick``: 20 MB of jsonl.zst, the fastokens
manifest, 351 micro-batches of 8 x 2048 tokens). Rows (medians and minimums):
``embedded_client`` (the call until it returns: the daemon's interpreter, its
imports, manifest, cache and Server, the bind), ``first_batch`` (from there
to the first micro-batch: the first objects' fetch, decode, tokenize, the
first step), ``rest`` (the other 350 micro-batches) and ``start_to_last``
(everything after torch's import).

Before/after: ``--baseline DIR`` runs the same jobs against another source
tree of sluice (``git archive REV sluice | tar -x -C DIR``), interleaved in
the same rounds; those processes run in DIR, so ``python -c`` (the trainer and
the daemon it spawns) imports sluice from DIR. The corpus folder is found
through ``DIR/bench/peers/work`` (a link to this checkout's is made if missing).

Bytecode: this development machine sets ``PYTHONDONTWRITEBYTECODE``, so every
process compiles sluice again, which an installed package never does;
``--bytecode`` runs with a private ``PYTHONPYCACHEPREFIX`` instead (round 0
warms it and is not counted).

Run: ``.venv/bin/python bench/onfly_start.py [--rounds 6] [--baseline DIR] [--bytecode]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
CORPUS = "bench/peers/work/quick"
MICRO_BATCHES = 351  # 8 x 2048 tokens each: the quick corpus's 20 MB, as bench/peers's quick run takes

TRAINER = r"""
import json, sys, tempfile, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from sluice.client import embedded_client
W, MICRO_BATCHES = sys.argv[1], int(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    t2 = time.perf_counter()
    c = embedded_client(f"{W}/manifest-fastokens.json", f"{W}/run.toml", cache_dir=tmp + "/cache")
    t3 = time.perf_counter()
    it = iter(c)
    mb = next(it)
    t4 = time.perf_counter()
    n, toks = 1, mb["input_ids"].numel()
    for mb in it:  # the run repeats its sources: it ends where the corpus's first pass does (351)
        n += 1
        toks += mb["input_ids"].numel()
        if n >= MICRO_BATCHES:
            break
    t5 = time.perf_counter()
    c.close()
print(json.dumps({"torch_import": t1 - t0, "embedded_client": t3 - t2, "first_batch": t4 - t3, "rest": t5 - t4,
                  "start_to_last": t5 - t1, "micro_batches": n, "tokens": toks}))
"""

ROWS = ("embedded_client", "first_batch", "rest", "start_to_last", "torch_import")


def _job(tree: Path, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", TRAINER, CORPUS, str(MICRO_BATCHES)], capture_output=True, text=True, env=env,
                         cwd=str(tree), timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"bench: the job in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--bytecode", action="store_true",
                    help="let Python cache bytecode (a private PYTHONPYCACHEPREFIX), as an installed package does")
    ap.add_argument("--baseline", type=Path, help="a source tree holding another sluice/ package")
    ap.add_argument("--out", default=str(_REPO / "bench" / "out" / "onfly_start.json"))
    args = ap.parse_args(argv)
    if not (_REPO / CORPUS / "manifest-fastokens.json").is_file():
        raise SystemExit(f"bench: {CORPUS}/manifest-fastokens.json missing: prepare it with bench/peers first")
    trees = [("", _REPO)]
    if args.baseline:
        base = args.baseline.resolve()
        if not (base / "sluice" / "__init__.py").is_file():
            raise SystemExit(f"bench: --baseline {args.baseline}: no sluice/__init__.py there")
        link = base / "bench" / "peers" / "work"
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(_REPO / "bench" / "peers" / "work")
        trees.append(("baseline: ", base))
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory(prefix="sluice-bench-onfly-start-")
    if args.bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp.name) / "pyc")
    runs: dict[str, list[float]] = {}
    with tmp:
        for rnd in range(args.rounds + 1):  # round 0 warms the page cache (and the bytecode cache): not counted
            for tag, tree in (trees if rnd % 2 else trees[::-1]):
                got = _job(tree, env)
                if rnd:
                    for k in ROWS:
                        runs.setdefault(f"{tag}{k}", []).append(got[k])
    res = {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": len(v), "each_s": [round(x, 3) for x in v]}
           for k, v in runs.items()}
    meta = {"bench": "onfly_start", "rounds": args.rounds, "baseline": str(args.baseline or ""), "corpus": CORPUS,
            "bytecode": "written" if args.bytecode or not os.environ.get("PYTHONDONTWRITEBYTECODE") else "not written",
            "load": os.getloadavg()}
    for k, v in res.items():
        print(f"{k:<30} median {v['median_s']:.3f} s   min {v['min_s']:.3f} s")
    print(f"bytecode {meta['bytecode']}; load average {meta['load'][0]:.1f}")
    line = json.dumps({**meta, **res})
    print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
