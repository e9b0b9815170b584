"""How many documents the out-of-order path makes that the in-order fill tokenizes again (docs/tokenize.md,
"Each document tokenized once").

In this process: a fresh node cache, a DocSource and one replica's
`StepMaker` over the first `--steps` steps of a manifest (its run spec's
order), then `wait_filled` (every object's fill completes, as a long run's
would). Prints the DocSource's counters: documents demanded out of order,
reused by the fill, demanded after the fill had passed them (`late`),
spilled to disk past the 16 MiB `side` bound (read back by the fill),
dropped past the spill's bounds (`dropped`), and the objects' records.
Tokenized twice = demanded - reused.

    .venv/bin/python bench/demand_twice.py bench/peers/work/full --steps 0
    .venv/bin/python bench/demand_twice.py bench/peers/work/full/sweep-300 --steps 300

Not a test: figures depend on the machine and its load (the fill and the
demand path race).
"""

from __future__ import annotations

import sys

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow the standard library.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    from sluice.cache import NodeCache
    from sluice.errors import ExhaustedError
    from sluice.loaderd.logical import Plan
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec
    from sluice.tokenize import encoder_for_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a folder with manifest.json and run.toml (run-block.toml if present)")
    ap.add_argument("--steps", type=int, default=0, help="steps to make (0: until every object was read once)")
    args = ap.parse_args(argv)
    root = Path(args.folder)
    manifest = load_manifest(root / "manifest.json")
    spec = load_runspec(root / "run-block.toml" if (root / "run-block.toml").exists() else root / "run.toml")
    plan = Plan(manifest, spec)
    encoder = encoder_for_manifest(manifest)
    records = sum(o.records for s in manifest.sources for o in s.objects)
    with tempfile.TemporaryDirectory() as d, NodeCache(Path(d) / "c", 16 << 30) as cache:
        docs = DocSource(manifest, cache, encoder)
        maker = StepMaker(plan, docs, replica=0, replicas=1)
        state, steps, t = plan.initial_state(), 0, time.perf_counter()
        try:
            while (args.steps == 0 and docs.calls < records) or steps < args.steps:
                entry, state = maker.produce_step(state)
                if state is None:
                    break
                steps += 1
            served_s = time.perf_counter() - t
            filled = docs.wait_filled(1800)
        except ExhaustedError:
            filled = docs.wait_filled(1800)
            served_s = time.perf_counter() - t
        finally:
            docs.close()
        out = {"folder": str(root), "steps": steps, "documents_served": docs.calls, "records": records,
               "demanded": docs.demanded_docs, "reused": docs.fill_reused_docs,
               "twice": docs.demanded_docs - docs.fill_reused_docs, "late": docs.demand_late_docs,
               "spilled": docs.spilled_docs, "dropped": docs.side_dropped_docs, "served_s": round(served_s, 2), "filled": filled,
               "load": os.getloadavg()[0]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
