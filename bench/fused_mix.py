"""Benchmark: the producer's CPU per step on the fast path and on `Plan.step` alone (issue 23).

In one process, over synthetic memory-mapped token shards (documents of 1 to
``--max-len`` tokens, uniform: 565 on average at the default, as the
bench/peers corpus's 60-line stdlib documents: 50 MB in 862 micro-batches of
8 x 2048 tokens, ~2,000 characters a document), the bench/peers run spec
(seq_len 2048, 8 lanes, global batch 8, order block, separator eos) and four
manifests:

* ``single-pieces``: one source, unit tokens, ``piece_tokens = 2048`` (what
  `sluice manifest freeze` writes for the bench/peers corpus);
* ``mix5-pieces``: five sources by tokens (0.4/0.2/0.2/0.1/0.1), the same
  piece bound (issue 23's realistic workload);
* ``mix16-pieces``: sixteen sources of equal weight by tokens, the same
  piece bound (a mixture of many sources: the per-source and per-object
  costs of a call);
* ``single-whole``: one source, whole documents (``piece_tokens = 0``);
* ``mix5-bestfit``: the five sources with best-fit packing (window 4);
* ``mix5-sequences``: the five sources by sequences (unit ``sequences``: a
  row is one draw, one concat packer per source, whole documents);
* ``mix5-sequences-bestfit``: the same with one best-fit packer per source.

For each, a `StepMaker` makes ``--steps`` steps with `produce_run` (the
thread producer's call, `STEPS_AT_ONCE` steps a call, or ``--at-once``: 1 is a
producer whose consumer is slower, waking for one step at a time), the CPU time of this
thread measured, these ways:

* ``plan``: without a compiled kernel (a daemon without numba, or before its
  kernel loads): every step `Plan.step`'s, one a call;
* ``numba`` (``--jit on``): the compiled kernel through numba's dispatchers
  (concat's draws walked and rows assembled in `jitdraws.walk` /
  `jitrows.assemble`; best-fit's draws and bins in `jitdraws.walk_bins`, its
  rows in `jitrows.assemble_bins`);
* ``ahead`` (``--jit ahead``): the same kernels' module compiled ahead of
  time (`jitaot`, what a daemon loads: every call's arguments checked);
  ``--jit both`` measures it beside ``numba``.

Interleaved in ``--rounds`` rounds, medians. Prints a table and one JSON line.

Run: ``.venv/bin/python bench/fused_mix.py [--steps 1500] [--rounds 5] [--jit off|on|ahead|both]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))

import numpy as np  # noqa: E402

from logical_helpers import MappedDocs, make_manifest, make_spec  # noqa: E402
from sluice.loaderd.logical import Plan  # noqa: E402
from sluice.loaderd.physical.producer import STEPS_AT_ONCE, StepMaker  # noqa: E402

WEIGHTS5 = ("0.4", "0.2", "0.2", "0.1", "0.1")


class Docs(MappedDocs):
    """Mapped synthetic shards, every object's tokens already mapped (as a warmed pre-tokenized corpus):
    documents of 1 to `max_len` tokens, uniform (seeded per object), uint32 ids."""

    def _shard(self, s: int, o: int) -> tuple[np.ndarray, np.ndarray, int]:
        got = self.shards.get((s, o))
        if got is None:
            records = self.plan.manifest.sources[s].objects[o].records
            rng = np.random.default_rng([s, o])
            offsets = np.zeros(records + 1, dtype="<u8")
            offsets[1:] = np.cumsum(rng.integers(1, self.fake_max + 1, size=records))
            tokens = rng.integers(3, 50000, size=int(offsets[-1]), dtype=np.uint32)
            got = self.shards[(s, o)] = (offsets, tokens, records)
        return got

    def prefetch(self, refs, only_if_settled: bool = False) -> bool:
        return True

    def all_done(self) -> bool:
        return True


def manifests() -> dict[str, tuple]:
    return {
        "single-pieces": ([("code", [4000] * 4, "1", "repeat")], 2048),
        "mix5-pieces": ([(f"s{i}", [2000] * 2, w, "repeat") for i, w in enumerate(WEIGHTS5)], 2048),
        "mix16-pieces": ([(f"s{i}", [1000] * 2, "1", "repeat") for i in range(16)], 2048),
        "single-whole": ([("code", [4000] * 4, "1", "repeat")], None),
        "mix5-bestfit": ([(f"s{i}", [2000] * 2, w, "repeat") for i, w in enumerate(WEIGHTS5)], 2048, "bestfit"),
        "mix5-sequences": ([(f"s{i}", [2000] * 2, w, "repeat") for i, w in enumerate(WEIGHTS5)], None, "concat",
                           "sequences"),
        "mix5-sequences-bestfit": ([(f"s{i}", [2000] * 2, w, "repeat") for i, w in enumerate(WEIGHTS5)], None,
                                   "bestfit", "sequences"),
    }


AT_ONCE = [STEPS_AT_ONCE]  # steps asked a call (`--at-once`)
MICRO = [1]  # micro-batches of [8, 2048] a step (`--micro-per-step`)


def run(maker: StepMaker, plan: Plan, steps: int) -> float:
    """CPU seconds of this thread for `steps` steps from the start, `STEPS_AT_ONCE` asked for a call (a call
    where the fast path stands aside makes one step; no source ends in this stream)."""
    state = plan.initial_state()
    t = time.thread_time()
    made = 0
    while made < steps:
        entries, state = maker.produce_run(state, AT_ONCE[0])
        made += len(entries)
    return time.thread_time() - t


def measure(name: str, sources: list, pieces: int | None, algorithm: str, unit: str, steps: int, rounds: int,
            max_len: int, kernels: dict[str, Any] | None = None) -> dict:
    """Per-step CPU of each kind (``plan``, one per loaded kernel: `kernels` by kind), interleaved (the order
    rotates every round), medians."""
    kernels = kernels or {}
    manifest = make_manifest(sources, seq_len=2048, unit=unit, piece_tokens=pieces, algorithm=algorithm)
    plan = Plan(manifest, make_spec(lanes=8, global_batch=8 * MICRO[0], micro_batch=8, order="block", seed=7))
    docs = Docs(plan, max_len)
    maker = StepMaker(plan, docs, replica=0, replicas=1)
    kinds = ["plan", *kernels]
    got: dict[str, list[float]] = {kind: [] for kind in kinds}
    run(maker, plan, 64)  # the shards built, the orders' first chunks made
    for r in range(rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            maker.jit = SimpleNamespace(kernel=kernels[kind]) if kind in kernels else None  # (a loader's face)
            got[kind].append(run(maker, plan, steps))
    med = {k: statistics.median(v) / steps * 1e6 for k, v in got.items()}
    return {"spec": name, "steps": steps, "rounds": rounds, "at_once": AT_ONCE[0], "micro_per_step": MICRO[0],
            "us_per_step": med,
            "speedup": {k: med["plan"] / v for k, v in med.items() if k != "plan"}, "raw": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="steps per timed run (default 1500)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--max-len", type=int, default=1130, help="longest document in tokens (default 1130)")
    ap.add_argument("--at-once", type=int, default=STEPS_AT_ONCE,
                    help=f"steps asked a call (default {STEPS_AT_ONCE}, the producer's; 1: a slower consumer)")
    ap.add_argument("--micro-per-step", type=int, default=1, metavar="K",
                    help="[8, 2048] micro-batches a step (default 1; K > 1: a step of K, gradient accumulation's "
                         "shape; the figures stay per step)")
    ap.add_argument("--only", default="", help="comma-separated spec names (default: all)")
    ap.add_argument("--jit", choices=["off", "on", "ahead", "both"], default="off",
                    help="on: load the compiled kernel first (numba; compiled into a fresh temporary cache); ahead: "
                         "the kernels' module compiled ahead of time there (jitaot, ~10 s to build); both")
    args = ap.parse_args(argv)
    AT_ONCE[0] = max(1, args.at_once)
    MICRO[0] = max(1, args.micro_per_step)
    kernels: dict[str, Any] = {}
    if args.jit != "off":
        import tempfile

        from sluice.loaderd.physical import jitaot, jitload

        where = tempfile.mkdtemp(prefix="fused-mix-numba-")
        numba_kernel = jitload.load(where)
        if args.jit in ("on", "both"):
            kernels["numba"] = numba_kernel
        if args.jit in ("ahead", "both"):
            jitaot.build(where)
            kernels["ahead"] = jitload.load_ahead(where)
    names = [n for n in manifests() if not args.only or n in args.only.split(",")]
    rows = [measure(n, *(manifests()[n] + ("concat", "tokens")[len(manifests()[n]) - 2:]), args.steps, args.rounds,
                    args.max_len, kernels)
            for n in names]
    print(f"{'spec':14} {'plan us/step':>13}" + "".join(f" {k + ' us/step':>15} {'x':>5}" for k in kernels))
    for r in rows:
        us, x = r["us_per_step"], r["speedup"]
        print(f"{r['spec']:14} {us['plan']:13.1f}" + "".join(f" {us[k]:15.1f} {x[k]:5.2f}" for k in kernels))
    print(json.dumps([{k: v for k, v in r.items() if k != "raw"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
