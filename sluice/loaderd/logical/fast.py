"""The one fast path: any number of consecutive steps of any plan, equal to `Plan.step` byte for byte.

Two implementations of the plan exist, no more: `Plan.step` (the
specification, one step, document by document) and `fast_steps`, which
computes steps ``state.step + 1 .. state.step + n`` of some lanes at once
from mapped token shards, the draws walked on integers:

* `fusedpack`, every plan: the draws walked in Python (`walk.Lane`), the
  packers of `packing.py` deciding the rows and `packing.materialize` making
  them, as `Plan.step` does;
* `fusedmix`, concat with the compiled kernel loaded (numba): the same walk
  and rows in `jitdraws` / `jitrows` (where the kernel does not cover a call,
  `fusedpack` takes it).

Where it cannot take a call it returns why (one of `REASONS`, a plain
string), and the caller (the producer) makes that step with `Plan.step`,
counting the reason (`sluice_fast_path_fallbacks_total`)::

    mixture    the walk of a concat plan stood aside: a `stop`/`fail` source
               ending in the call, every source exhausted, a `repeat` share that
               draws no token, an object whose tokens are being made from text,
               a record past its shard, a residual or open offset outside its
               document
    packed     the same for a best-fit or per-source-packers plan
    mapped     the documents callback has no mapped shards (`docs.mapped`)
    reference  a `Plan(reference=True)`: the tests' oracle, never fused
    state      no step or no lane asked for, lanes the state lacks, another
               plan's state
    end        the run's `max_steps` reached

tests/test_logical_fused.py holds it to `Plan.step` over random specs
(1-16 sources, weights, units, piece draws, concat and best-fit, exhaustion
rules, lanes, restores), rows, block bytes and states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sluice.loaderd.logical import fusedbins, fusedmix, fusedpack
from sluice.loaderd.logical.fused import FusedSteps, holds_lanes

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState

# Why a call was left to `Plan.step` (module docstring): short, stable strings, a metric label each.
MIXTURE, PACKED, MAPPED, REFERENCE, STATE, END = "mixture", "packed", "mapped", "reference", "state", "end"
REASONS = (MIXTURE, PACKED, MAPPED, REFERENCE, STATE, END)


def fast_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
               kernel: Any = None) -> FusedSteps | str:
    """Steps ``state.step + 1 ..`` (up to `n`, never past the run's `max_steps`) of `lanes`, or why not (one of
    `REASONS`; ``isinstance(got, str)`` tells the two apart). `kernel` (a loaded `jit.Kernel`, or None) runs
    a concat call's walk and rows compiled; the result is the same, byte for byte.

    Never raises for data problems: it returns a reason, and `Plan.step` then meets them exactly where it
    would. Counts the documents it hands out with `docs.count`, as `Plan.step`'s `docs` calls do.
    """
    lanes = list(lanes)
    if n < 1 or not lanes or not holds_lanes(state, lanes) or \
            (state.dataset_id, state.runspec_digest) != (plan.dataset_id, plan.runspec_digest):
        return STATE
    if plan.spec.max_steps:
        n = min(n, plan.spec.max_steps - (state.step + 1))
        if n < 1:
            return END
    if plan.reference:
        return REFERENCE
    if not hasattr(docs, "mapped"):  # (a plain callback: `Plan.step`'s documents one by one)
        return MAPPED
    one_stream = plan.manifest.packing.algorithm == "concat" and not plan.per_source_packers
    if one_stream:
        got = fusedmix.mixed_steps(plan, state, docs, lanes, n, kernel)
    elif not plan.per_source_packers:
        got = fusedbins.bins_steps(plan, state, docs, lanes, n, kernel)
    else:
        got = NotImplemented
    if got is NotImplemented:  # (no kernel, or one that does not cover the call)
        got = fusedpack.packed_steps(plan, state, docs, lanes, n)
    return (MIXTURE if one_stream else PACKED) if got is None else got
