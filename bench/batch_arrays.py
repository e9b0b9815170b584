"""Benchmark: the per-step costs that the batch array declaration (sluice/batcharrays.py) sits in, two trees.

Times, in one process per tree and round (``PYTHONPATH`` = the tree), the
best of 7 repeats of ``fused_entry``: `StepMaker._fused_entry`, a fast-path
step cut into its micro-batch dicts (samples, source counts, the state's
JSON), for concat (micro-batches of 2 and 8 rows) and best-fit, seq_len 2048, 8
lanes, synthetic mapped shards (tests/logical_helpers.py). The trees run
interleaved for ``--rounds`` rounds; the table holds each figure's minimum
over the rounds (the least disturbed run on a shared machine).

Run: ``.venv/bin/python bench/batch_arrays.py --before ../sluice-before [--rounds 3] [--out FILE]``
(the tree of this file is "after").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import timeit
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def child() -> dict[str, float]:
    """This process's figures, in microseconds (its `sluice` is the first one on PYTHONPATH)."""
    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "tests"))
    from logical_helpers import MappedDocs, make_manifest, make_spec

    from sluice.loaderd.logical import Plan
    from sluice.loaderd.logical.fast import fast_steps
    from sluice.loaderd.physical.producer import StepMaker

    def best(f, n: int) -> float:
        return round(min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6, 2)

    out = {}
    for algo, mb in (("concat", 2), ("concat", 8), ("bestfit", 2)):
        manifest = make_manifest([("a", [500, 400], "1", "repeat"), ("b", [300], "2", "repeat")], seq_len=2048,
                                 algorithm=algo)
        plan = Plan(manifest, make_spec(lanes=8, global_batch=8, micro_batch=mb))
        maker = StepMaker(plan, MappedDocs(plan, 4000), replica=0, replicas=1)
        fused = fast_steps(plan, plan.initial_state(), maker.docs, maker.lanes, 4, None)
        case = f"{algo} micro_batch={mb}"
        out[f"fused_entry {case}"] = best(lambda: maker._fused_entry(fused, 1, 0.0), 200)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="the other tree (a checkout of the code before)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child()))
        return 0
    trees = {"after": str(_REPO)} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            got = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, "PYTHONPATH": tree},
                                 capture_output=True, text=True, check=True, timeout=300)
            runs[name].append(json.loads(got.stdout))
    table = {k: {name: min(r[k] for r in rs) for name, rs in runs.items()} for k in runs["after"][0]}
    for k, v in table.items():
        print(f"{k:<32} " + "  ".join(f"{name} {us:8.2f} us" for name, us in v.items()))
    result = {"command": " ".join(sys.argv), "load": os.getloadavg(), "min_us": table, "runs": runs}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
