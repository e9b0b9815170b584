"""The one fast path: any number of consecutive steps of any plan, equal to `Plan.step` byte for byte.

Two implementations of the plan exist, no more: `Plan.step` (the
specification, one step, document by document) and `fast_steps`, which
computes steps ``state.step + 1 .. state.step + n`` of some lanes at once
from mapped token shards in the compiled kernel (`jit.Kernel`: numba's, or
the module compiled ahead of time; both the source of `jitdraws` and
`jitrows`):

* `fusedmix`, concat: every lane's draws walked (`jitdraws.walk`), the rows
  cut from each lane's stream (`jitrows.assemble`);
* `fusedbins`, best-fit: the same draws, pulled only while no row is pending
  and placed in bins (`jitdraws.walk_bins`), rows with padding
  (`jitrows.assemble_bins`); with one packer per source (unit `sequences`)
  each row picks its source, whose packer pulls that source's documents;
* `fusedseqs`, one concat packer per source (unit `sequences`): a row a draw,
  filled by its source's packer (`jitdraws.walk_seqs`), rows as best-fit's.

Where it cannot take a call it returns why (one of `REASONS`, a plain
string), and the caller (the producer) makes that step with `Plan.step`,
counting the reason (`sluice_fast_path_fallbacks_total`)::

    kernel          no compiled kernel is loaded (numba not installed, `--jit off`,
                    or not loaded yet)
    kernel_refused  the kernel is loaded but does not cover the call (an integer that
                    could overflow int64, a categorical weight total over 2**32, a
                    token dtype or frame id not compiled)
    mixture         the walk of a concat plan stood aside: a `stop`/`fail` source
                    ending in the call, every source exhausted, a `repeat` share that
                    draws no token, an object whose tokens are being made from text,
                    a record past its shard, a residual or open offset outside its
                    document
    packed          the same for a best-fit plan or one with a packer per source
                    (or a packer state it does not continue: an ended stream, more
                    open bins than the window, a piece or residual outside its
                    document; a source's best-fit packer ending in the call)
    mapped          the documents callback has no mapped shards (`docs.mapped`)
    reference       a `Plan(reference=True)`: the tests' oracle, never fused
    state           no step or no lane asked for, lanes the state lacks, another
                    plan's state
    end             the run's `max_steps` reached

Without numba (`sluice[jit]` not installed) every step is `Plan.step`'s: the
kernel's source can run uncompiled (`jitload.uncompiled`, what the fast
tier's tests hold to `Plan.step`), but about 170 times slower than compiled
and 20 times slower than `Plan.step` itself, so it is never a daemon's path.
tests/test_logical_fused.py, test_logical_bins.py and test_logical_jit.py
(and test_logical_seqs.py) hold it to `Plan.step` over random specs (1-16
sources, weights, units, piece draws, concat, best-fit and per-source
packers, exhaustion rules, lanes, restores), rows, block bytes and states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sluice.loaderd.logical import fusedbins, fusedmix, fusedseqs
from sluice.loaderd.logical.fused import FusedSteps, holds_lanes

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState

# Why a call was left to `Plan.step` (module docstring): short, stable strings, a metric label each.
KERNEL, KERNEL_REFUSED = "kernel", "kernel_refused"
MIXTURE, PACKED, MAPPED, REFERENCE, STATE, END = "mixture", "packed", "mapped", "reference", "state", "end"
REASONS = (KERNEL, KERNEL_REFUSED, MIXTURE, PACKED, MAPPED, REFERENCE, STATE, END)


def fast_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
               kernel: Any = None) -> FusedSteps | str:
    """Steps ``state.step + 1 ..`` (up to `n`, never past the run's `max_steps`) of `lanes` in `kernel` (a
    loaded `jit.Kernel`), or why not (one of `REASONS`; ``isinstance(got, str)`` tells the two apart).

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
    if kernel is None:
        return KERNEL
    concat = plan.manifest.packing.algorithm == "concat"
    walk = fusedbins.bins_steps if not concat else fusedseqs.seqs_steps if plan.per_source_packers else \
        fusedmix.mixed_steps
    got = walk(plan, state, docs, lanes, n, kernel)
    if got is NotImplemented:
        return KERNEL_REFUSED
    return (MIXTURE if concat and not plan.per_source_packers else PACKED) if got is None else got
