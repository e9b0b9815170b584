"""Benchmark piece draws (issue 13 item 2): what `mixture.piece_tokens` costs and what it buys.

Three sources by tokens with weights 0.6/0.3/0.1; one holds long documents
(``--long`` tokens, default 100 x seq_len), the others 50-700 tokens. For
whole documents and for piece bounds B = seq_len and seq_len / 8 it packs
``--steps`` concat steps (seq_len 2048, 8 lanes, global batch 64) with
`Plan.step` and reports, per configuration: packing throughput
in CPU time of this thread (best of ``--reps``), segments per row (the cost:
every piece is a segment), and the worst lane's distance from its target
share, in tokens and as a multiple of B (the bound says ahead < 1, behind <
k - 1 = 2 pieces).

Run: ``.venv/bin/python bench/pieces.py [--steps N] [--reps R]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))

import numpy as np  # noqa: E402

from logical_helpers import make_manifest, make_spec  # noqa: E402
from sluice.loaderd.logical import Plan  # noqa: E402

SEQ_LEN = 2048
WEIGHTS = ("0.6", "0.3", "0.1")


def docs_of(long: int):
    rng = np.random.default_rng(0)
    pool = (rng.integers(3, 1000, size=1 << 20)).astype(np.uint32)  # token ids; documents are views of it
    short = rng.integers(50, 700, size=4096)

    def docs(ref) -> np.ndarray:
        n = long if ref.source == 1 else int(short[(ref.index * 7 + ref.source) % len(short)])
        start = (ref.index * 9973) % (len(pool) - n)
        return pool[start : start + n]

    return docs


def run(pieces: int | None, steps: int, long: int) -> tuple[float, float, float, float]:
    """(CPU seconds, segments per row, worst |c_s - p_s T| in tokens, per-lane tokens) for `steps` steps."""
    sources = [("web", [4000], WEIGHTS[0], "repeat"), ("books", [64], WEIGHTS[1], "repeat"),
               ("code", [4000], WEIGHTS[2], "repeat")]
    manifest = make_manifest(sources, seq_len=SEQ_LEN, unit="tokens", piece_tokens=pieces)
    plan = Plan(manifest, make_spec(lanes=8, global_batch=64, micro_batch=8))
    docs = docs_of(long)
    state = plan.initial_state()
    segs = rows = 0
    t0 = time.thread_time()
    for _ in range(steps):
        batch, state = plan.step(state, docs)
        for rs in batch.rows.values():
            rows += len(rs)
            segs += sum(len(r.seqlens) for r in rs)
    cpu = time.thread_time() - t0
    worst = Fraction(0)
    w = [Fraction(x) for x in WEIGHTS]
    for lane in state.lanes.values():
        c = [s.tokens for s in lane.sources]
        T = sum(c)
        worst = max(worst, *(abs(ci - wi * T) for ci, wi in zip(c, w)))
    return cpu, segs / rows, float(worst), sum(s.tokens for s in state.lanes[0].sources)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long", type=int, default=100 * SEQ_LEN, help="tokens of each long document")
    args = ap.parse_args(argv)
    out = {}
    configs = {"whole documents": None, "B = seq_len": SEQ_LEN, "B = seq_len/8": SEQ_LEN // 8}
    best: dict[str, float] = {}
    for _ in range(args.reps):  # interleaved, so load changes hit every configuration alike
        for name, b in configs.items():
            cpu, seg, worst, lane_tokens = run(b, args.steps, args.long)
            best[name] = min(best.get(name, cpu), cpu)
            out[name] = {"piece_tokens": b, "segments_per_row": round(seg, 2), "worst_lane_deviation_tokens": worst,
                         "worst_in_pieces": None if b is None else round(worst / b, 3),
                         "lane_tokens": lane_tokens}
    tokens = args.steps * 64 * SEQ_LEN
    print(f"{'configuration':<18} {'M tokens/s':>10} {'segments/row':>13} {'worst lane dev (tokens)':>24} {'in B':>6}")
    for name, r in out.items():
        r["m_tokens_per_s"] = round(tokens / best[name] / 1e6, 1)
        inb = "-" if r["worst_in_pieces"] is None else f"{r['worst_in_pieces']:.2f}"
        print(f"{name:<18} {r['m_tokens_per_s']:>10} {r['segments_per_row']:>13} "
              f"{r['worst_lane_deviation_tokens']:>24.0f} {inb:>6}")
    print(json.dumps({"steps": args.steps, "long": args.long, "results": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
