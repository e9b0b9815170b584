"""Several consecutive columnar steps in one call: what `Plan.step` gives for each, in order.

With one row per lane and step (the common serving shape: global batch =
lanes), a step's work is mostly per call, not per token: a `LaneMachine` per
lane made from the state and turned back into one, and the assembly's two dozen
numpy calls over arrays of a few dozen entries. `plan_steps` keeps each lane's
machine from one step to the next (the machine after step k is exactly the one
`LaneMachine(state after k)` would make: draws, rows, cursors and the residual
pointer are its whole state) and assembles every step's rows in one call:
`assemble_concat` places each lane's stream at its own offset of one block and
never looks across lanes, so step j's lanes are simply lanes ``j*P .. j*P+P-1``
of that block, and the rows are the bytes `Plan.step` makes
(tests/test_logical_multistep.py holds it to `Plan.step`).

A step that would raise (end of stream, a `fail` source, an unreadable object)
ends the batch before it: the steps before it are returned, and the next call,
starting at that step, raises exactly as `Plan.step` does. Only the columnar
plane (concat, whole lanes) takes this path; any other plan computes one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.loaderd.logical.columnar import LaneDocs, assemble_concat, draw_concat
from sluice.loaderd.logical.state import DataState, LaneState

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan, StepBatch


def plan_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int],
               n: int) -> list[tuple[StepBatch, DataState]]:
    """Steps ``state.step + 1 .. state.step + n`` of `lanes`: `Plan.step`'s (batch, state after) for each.

    Returns at least one step, fewer than `n` where a later step would raise;
    raises what `Plan.step(state, docs, lanes)` raises when the first step does.
    The rows of all returned steps view one block (memory: the steps stay
    alive until the last of them is dropped).
    """
    from sluice.loaderd.logical.plan import LaneMachine, StepBatch

    lanes = list(lanes)
    if n <= 1 or not plan.columnar or not lanes or not all(lane in state.lanes for lane in lanes) or \
            (state.dataset_id, state.runspec_digest) != (plan.dataset_id, plan.runspec_digest):
        return [plan.step(state, docs, lanes)]  # one step, and Plan.step's own refusals
    k = plan.spec.per_lane
    machines = [LaneMachine(plan, lane, state.lanes[lane], docs, {}) for lane in lanes]
    drawn: list[LaneDocs] = []
    states: list[DataState] = []
    for j in range(n):
        step = state.step + 1 + j
        if plan.spec.max_steps and step >= plan.spec.max_steps:
            break
        try:
            got = [draw_concat(m, k) for m in machines]
        except Exception:  # EndOfStream, ExhaustedError, an unreadable object, a bug: not this batch's to report
            break  # the machines are spent; the next call meets this step again (through Plan.step if first)
        drawn += got
        new_lanes: dict[int, LaneState] = {lane: m.state() for lane, m in zip(lanes, machines)}
        states.append(DataState(plan.dataset_id, plan.runspec_digest, step, new_lanes))
    if not states:
        return [plan.step(state, docs, lanes)]  # raises as a single step does (or computes it, if it was transient)
    per_lane, block = assemble_concat(drawn, k, plan.manifest.packing.seq_len, plan.framing)
    first, P = lanes[0], len(lanes)
    ordered = lanes == list(range(first, first + P))
    out = []
    for j, after in enumerate(states):
        rows = dict(zip(lanes, per_lane[j * P:(j + 1) * P]))
        view = block[:, j * P * k:(j + 1) * P * k] if ordered else None
        out.append((StepBatch(after.step, rows, view, first), after))
    return out
