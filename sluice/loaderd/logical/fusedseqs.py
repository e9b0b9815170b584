"""The fast path for one concat packer per source (mixture unit `sequences`) in the compiled kernel.

With unit `sequences` a row is one draw: the lane picks a source (quota by
rows, or categorical), and that source's own concat packer fills the row from
its residual, then from the source's next documents
(`LaneMachine.next_pieces`). `seqs_steps` runs `jitdraws.walk_seqs`: the pick
of the other walks (`_walk_pick`), the source's draws as theirs (`_take`),
every row's pieces written inside their row (a document longer than the
row's room leaves the rest as its source's residual), and after each step's
last row the cursors, the draw counter and every source's residual. The rows
are then best-fit's with each row a full bin (`jitrows.assemble_bins`, no
padding), the states' JSON `jitrows.seqs_texts`.

It stands aside (None; `Plan.step` meets the case) where the walk does
(`shards.Aside`; every source exhausted too, where `Plan.step` ends the
stream) or where a lane's packer state is not one it continues (another
plan's packers, a residual outside its source or its document), and returns
NotImplemented where the kernel does not cover the call. Best-fit with one
packer per source is `fusedbins`'. tests/test_logical_seqs.py holds it to
`Plan.step` byte for byte, states included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.loaderd.logical import fusedbins, fusedmix, located
from sluice.loaderd.logical.fused import FusedSteps, StateTexts
from sluice.loaderd.logical.jit import packer_keys, state_parts
from sluice.loaderd.logical.shards import Aside, Shards

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState


def seqs_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
               kernel: Any) -> FusedSteps | None | Any:
    """`fast.fast_steps` for a plan with one concat packer per source, in `kernel` (a loaded `jit.Kernel`): steps
    ``state.step + 1 .. state.step + n`` of `lanes`; None where it stands aside, NotImplemented where the kernel
    does not cover the call (module docstring). The caller has checked the state's identity, the lanes and
    `max_steps`."""
    try:
        return _seqs(plan, state, docs, list(lanes), n, kernel)
    except Aside:
        return None


class Residuals:
    """Each lane's packers in the kernel's form: `resid` (P, S, 11), per source [held?, its residual as a walked
    piece (10)], with the cursors `cur`, draw counters and rows. A call's end keeps one (`after`: the state it
    returned), so that the next call of the same stream starts from it (as `located.Ended` for concat)."""

    __slots__ = ("after", "cur", "draws", "rows", "resid")

    def __init__(self, after: object, cur: np.ndarray, draws: np.ndarray, rows: list[int], resid: np.ndarray) -> None:
        self.after, self.cur, self.draws, self.rows, self.resid = after, cur, draws, rows, resid

    def located(self) -> np.ndarray:
        """The residuals held, as pieces (their documents located: the next call's)."""
        return self.resid[..., 1:][self.resid[..., 0] != 0]


def _from_state(plan: Plan, shards: Shards, state: DataState, lanes: list[int], kept: located.Kept | None
                ) -> Residuals:
    """`Residuals` from the state's lanes, each residual's document located; `Aside` where a lane holds packers
    of another plan or a residual outside its source or its document."""
    S, P = len(plan.weights), len(lanes)
    frame = plan.framing.framed_len(0)
    lstates = [state.lanes[lane] for lane in lanes]
    names = set(plan.packer_keys)
    held = []
    for i, ls in enumerate(lstates):
        if set(ls.packers) - names:
            raise Aside  # another plan's packers: Plan.step refuses them
        for key, packer in ls.packers.items():
            c = packer.get("cur") if isinstance(packer, dict) else None
            if c is not None:
                if not (isinstance(c, list) and len(c) == 5 and all(type(v) is int for v in c) and c[0] == int(key)):
                    raise Aside  # (not a residual of this source: Plan.step's packers name it)
                held.append((i, c))
    docs = located.residual_docs(kept)
    want = {tuple(c[:3]) for _, c in held}
    where = {d: docs[d] for d in want if d in docs}
    for s in sorted({d[0] for d in want if d not in where}):
        mine = sorted(d for d in want if d[0] == s and d not in where)
        for d, *at in zip(mine, *shards.locate(s, np.asarray([d[2] for d in mine], dtype=np.int64))):
            where[d] = tuple(at)
    resid = np.zeros((P, S, 11), dtype=np.int64)
    for i, (s, e, idx, off, end) in held:
        o, rec, a0, n0 = where[(s, e, idx)]
        if not 0 <= off < end <= n0 + frame:
            raise Aside  # a residual outside its document
        resid[i, s] = (1, s, e, idx, o, rec, a0, n0, off, end, n0 + frame)
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(P, S, 8)
    return Residuals(None, cur, np.asarray([ls.draws for ls in lstates], dtype=np.int64), [ls.rows for ls in lstates],
                     resid)


def _seqs(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    m = plan.manifest.packing
    k, L = plan.spec.per_lane, m.seq_len
    P, R = len(lanes), n * k
    got = fusedbins.begin(plan, state, docs, lanes, R * L, Residuals, _from_state)
    if got is None:
        return NotImplemented
    setup, shards, calls, q, start, want = got
    S = setup["S"]
    cur, resid = start.cur.copy(), start.resid.copy()  # (the walk moves them: `start` may be kept by a failed call)
    cap = max(4 * want, 64) + R  # (a row's pieces: its documents, and a residual's rest)
    pieces, pbin = np.zeros((P, cap, 10), dtype=np.int64), np.zeros((P, cap), dtype=np.int64)
    st = np.zeros((P, 8), dtype=np.int64)
    st[:, 0] = start.draws
    shares = setup["shares"]
    wraps = np.full((P, S), -1, dtype=np.int64)
    opened = np.zeros((P, S, 7), dtype=np.int64)
    snaps = np.zeros((P, n, S, 8), dtype=np.int64)
    meta = np.zeros((P, n, 1), dtype=np.int64)
    rsnaps = np.zeros((P, n, S, 11), dtype=np.int64)
    done, aside, _, full = kernel.walk_seqs.status
    keys, weights, rules, B, frame, masks, mode, col = (setup[x] for x in (
        "keys", "weights", "rules", "B", "frame", "masks", "mode", "col"))
    while True:
        got, i = kernel.walk_seqs(n, k, L, B, frame, masks, mode, keys, col, weights, shares, rules, cur, st, wraps,
                                  *q, opened, resid, pieces, pbin, snaps, meta, rsnaps)
        if got == done:
            break
        if got == aside:
            raise Aside
        if got == full:
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            pbin = np.concatenate([pbin, np.zeros_like(pbin)], axis=1)
            continue
        q = (*q[:3], fusedmix.refill(plan, shards, lanes, i, int(st[i, 4]), cur, opened, shares, q))
    counts = st[:, 3].copy()
    rowbin = np.tile(np.arange(R, dtype=np.int64), (P, 1))  # (writable: the kernels take no read-only view)
    got = kernel.assemble_bins(plan.framing, m.pad_id, n, k, L, pieces, counts, pbin, rowbin, S,
                               located.tokens_of(shards))
    if got is NotImplemented:
        return NotImplemented
    block, used, rptr, tokens = got
    parts = setup.get("seqs_parts")
    if parts is None:
        parts = setup["seqs_parts"] = (state_parts(plan.dataset_id, plan.runspec_digest, lanes, "seqs"),
                                       packer_keys(plan.packer_keys, b'"cur":'))
    texts = kernel.seqs_texts(snaps, meta, rsnaps, np.asarray(start.rows, dtype=np.int64), k, state.step + 1, *parts)
    if texts is NotImplemented:
        return NotImplemented
    fusedmix.handed_out(plan, docs, used, S)
    z = np.zeros(0, dtype=np.int64)
    row_tokens = tokens.reshape(P, n, k, S).transpose(1, 0, 2, 3).reshape(n * P * k, S)
    fused = FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block, state_dicts=StateTexts(texts),
                       keys=z, owners=[], sids=[], entry_start=z, entry_off=z, bound_global=z,
                       packed=fusedbins.rows(plan, block, used, rptr, P, n, k, L), row_tokens=row_tokens)
    end = Residuals(fused.state(n - 1), cur, st[:, 0].copy(), [r + R for r in start.rows], resid)
    calls.keep(lanes, q, end.located(), end)
    return fused
