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

Whole documents go further (`_one_draw_per_lane`): each lane draws the n
steps' documents in one `draw_concat` for ``n * k`` rows, the states after each
step are computed from the drawn documents, and step j's rows are copied out of
the lane-major block into a block of their own (the per-lane draw's fixed cost,
about 8 us a lane, is then paid once per n steps). It stands aside (the steps
are drawn one by one) where anything but the documents moved inside the draw:
an epoch or an active flag, an empty document, piece draws.

Before either, `fused_for` tries `fused.fused_steps`: every lane and step of
the call in one set of array operations where one source is live and the
documents are whole, its draws walked on integers (`fusedmix`) for mixtures
and piece draws, wherever the shards are mapped (the producer takes its
entries straight from its block); where it stands aside it says why
(`fused.REASONS`, counted by the producer).

A step that would raise (end of stream, a `fail` source, an unreadable object)
ends the batch before it: the steps before it are returned, and the next call,
starting at that step, raises exactly as `Plan.step` does. Only the columnar
plane (concat, whole lanes) takes this path; any other plan computes one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sluice.datastate import CUR_ACTIVE, CUR_DOCS, CUR_EPOCH, CUR_LOSS_TOKENS, CUR_OPEN, CUR_ROWS, CUR_TAKEN
from sluice.datastate import CUR_TOKENS
from sluice.errors import InternalError
from sluice.loaderd.logical.columnar import LaneDocs, assemble_concat, draw_concat
from sluice.loaderd.logical.fused import END, STATE, FusedSteps, fused_steps
from sluice.loaderd.logical.state import DataState, LaneState, SourceCursor

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan, StepBatch


def plan_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int],
               n: int, *, fused: bool = True) -> list[tuple[StepBatch, DataState]]:
    """Steps ``state.step + 1 .. state.step + n`` of `lanes`: `Plan.step`'s (batch, state after) for each.

    `fused=False` skips the `fused_for` try (the producer made it already and
    counted why it stood aside).

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
    if plan.spec.max_steps:
        n = min(n, plan.spec.max_steps - (state.step + 1))
    at_once = fused_for(plan, state, docs, lanes, n) if fused else "skipped"
    if not isinstance(at_once, str):
        first, P = lanes[0], len(lanes)
        ordered = lanes == list(range(first, first + P))
        return [(StepBatch(after.step, at_once.rows(j), at_once.block[j] if ordered else None, first), after)
                for j, after in enumerate(at_once.states)]
    if n > 1 and plan.piece_tokens is None:
        got = _one_draw_per_lane(plan, state, docs, lanes, n, k, LaneMachine, StepBatch)
        if got is not None:
            return got
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


def fused_for(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
              kernel: Any = None) -> FusedSteps | str:
    """Steps ``state.step + 1 ..`` (up to `n`, never past `max_steps`) of `lanes` from `fused.fused_steps`: every
    lane and step in one set of array operations (in `kernel`, a loaded `jit.Kernel`, where given); else why
    not (one of `fused.REASONS`): that path stands aside, or `Plan.step` would refuse or compute the step
    itself (``state``: no step, lanes the state lacks, another plan's state; ``end``: at `max_steps`; not
    columnar: `fused.columnar_reason`). One step is computed as several are: the producer takes it for a
    single step too (the same bytes and state, in about half of `Plan.step`'s time)."""
    lanes = list(lanes)
    if n < 1 or not lanes or not all(lane in state.lanes for lane in lanes) or \
            (state.dataset_id, state.runspec_digest) != (plan.dataset_id, plan.runspec_digest):
        return STATE
    if plan.spec.max_steps:
        n = min(n, plan.spec.max_steps - (state.step + 1))
    if n < 1:
        return END
    return fused_steps(plan, state, docs, lanes, n, kernel)


def _one_draw_per_lane(plan: Plan, state: DataState, docs: DocTokens, lanes: list[int], n: int, k: int,
                       LaneMachine: type, StepBatch: type) -> list[tuple[StepBatch, DataState]] | None:
    """The `n` steps with one draw per lane (`draw_concat` for ``n * k`` rows) and one assembly, or None
    where that cannot stand for n steps (the caller then draws step by step).

    Concat packing cuts one stream per lane at every ``seq_len``: the documents
    n steps pull are the shortest prefix of the lane's stream that covers
    ``n * T`` tokens (T = k * seq_len), the same whether drawn step by step or
    at once, and each row is the same slice of that stream. What differs is
    only where the states are taken: after step j the lane has drawn every
    document that starts before ``(j + 1) * T`` and its residual is the one
    straddling that point. Those states are computed from the drawn
    documents when nothing else moved inside the draw (no epoch or active
    change, no empty document, no piece draws); otherwise None.
    """
    machines, drawn, per_step_cursors = [], [], []
    for lane in lanes:
        m = LaneMachine(plan, lane, state.lanes[lane], docs, {})
        before = [list(c) for c in m.cursors]
        draws0, residual = m.draws, m.packers["*"].cur is not None
        try:
            ld = draw_concat(m, n * k)
        except Exception:
            return None  # meets the end of the stream (or an error): step by step finds where
        new = len(ld.refs) - residual
        if m.draws - draws0 != new or ld.cut:
            return None
        for c0, c in zip(before, m.cursors):
            if c0[CUR_EPOCH] != c[CUR_EPOCH] or c0[CUR_ACTIVE] != c[CUR_ACTIVE] or c0[CUR_OPEN] != c[CUR_OPEN] or \
                    c0[CUR_ROWS] != c[CUR_ROWS] or c[CUR_DOCS] - c0[CUR_DOCS] != c[CUR_TAKEN] - c0[CUR_TAKEN]:
                return None
        if sum(c[CUR_DOCS] - c0[CUR_DOCS] for c0, c in zip(before, m.cursors)) != new:
            return None  # an empty document was drawn (counted, no piece)
        machines.append((m, before, draws0, residual))
        drawn.append(ld)
    masks_eos = bool(plan.framing.masks_eos_target)
    T = k * plan.manifest.packing.seq_len
    states: list[dict[int, LaneState]] = [{} for _ in range(n)]
    for lane, (m, before, draws0, residual), ld in zip(lanes, machines, drawn):
        cursors = [list(c) for c in before]
        draws = draws0
        pos = 0  # stream position where entry i starts
        i = 0
        for j in range(n):
            b = (j + 1) * T
            while i < len(ld.refs) and pos < b:  # documents that start before the boundary: drawn by step j
                length = ld.lens[i]
                if i or not residual:
                    c = cursors[ld.refs[i].source]
                    c[CUR_TAKEN] += 1
                    c[CUR_DOCS] += 1
                    c[CUR_TOKENS] += length
                    c[CUR_LOSS_TOKENS] += max(length - 1, 0) - (masks_eos and length >= 2)
                    draws += 1
                pos += ld.ends[i] - ld.offs[i]
                i += 1
            # the residual: the last document drawn, if it ends after the boundary
            if pos > b:
                r = ld.refs[i - 1]
                cur = [r.source, r.epoch, r.index, ld.ends[i - 1] - (pos - b), ld.ends[i - 1]]
            else:
                cur = None
            states[j][lane] = LaneState(draws=draws, rows=m.rows - (n - 1 - j) * k,
                                        sources=tuple(SourceCursor.from_columns(c) for c in cursors),
                                        packers={"*": {"cur": cur}})
        if [c for c in cursors] != m.cursors or draws != m.draws or states[-1][lane].packers["*"]["cur"] != \
                (list(m.packers["*"].cur) if m.packers["*"].cur else None):
            raise InternalError(f"lane {lane}: the states of a multi-step draw do not add up to the draw")
    per_lane, block = assemble_concat(drawn, n * k, plan.manifest.packing.seq_len, plan.framing)
    first, P = lanes[0], len(lanes)
    ordered = lanes == list(range(first, first + P))
    out = []
    for j in range(n):
        rows = {lane: per_lane[i][j * k:(j + 1) * k] for i, lane in enumerate(lanes)}
        # Step j's rows lane after lane as a block of their own (one copy: the big block is lane-major),
        # which its micro-batches view; the rows themselves view the big block (the same values).
        view = block[:, [i * n * k + j * k + r for i in range(P) for r in range(k)]] if ordered else None
        step = state.step + 1 + j
        out.append((StepBatch(step, rows, view, first),
                    DataState(plan.dataset_id, plan.runspec_digest, step, states[j])))
    return out
