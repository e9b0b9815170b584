"""The fast path in Python: every lane and step of a call, the draws walked, the reference's packers and rows.

Each lane's draws are walked on integers (`walk.Lane`: `pull` / `take`, as
`lanemachine.LaneMachine` draws, without a `DocRef`, framing or `docs` call a draw),
and the packers of `packing.py` themselves (pointers only: concat,
best-fit, one per source under unit `sequences`) decide the rows from those
pieces, driven exactly as `LaneMachine.next_pieces` drives them;
`packing.materialize` (the reference's own) then builds every row of the call
at once from the mapped shards, and the block is those rows step-major. So
the only code of its own is the walk: everything that decides a row or a
byte is `Plan.step`'s. It takes every plan but a concat call the compiled
kernel covers (`fusedmix`, faster).

It stands aside (None; `Plan.step` then meets the case) where the walk does
(`walk.Aside`: a `stop`/`fail` source ending, every source exhausted, an
object not mapped, a state outside its documents) and where a lane's packer
runs dry (the stream's end: `Plan.step` raises EndOfStream there).
tests/test_logical_fused.py holds it to `Plan.step` byte for byte, states
included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.batcharrays import PLANES
from sluice.datastate import CUR_ACTIVE, CUR_ROWS
from sluice.errors import StateError
from sluice.loaderd.logical import located
from sluice.loaderd.logical.fused import FusedSteps
from sluice.loaderd.logical.walk import Aside, Lane, Shards, first_located, lane_queues, state_dicts
from sluice.loaderd.logical.packing import Piece, make_packer, materialize
from sluice.loaderd.logical.state import lane_obj

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState


def packed_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int) -> FusedSteps | None:
    """Steps ``state.step + 1 .. state.step + n`` of `lanes` of any plan, or None where this path stands aside
    (module docstring). The caller has checked the state's identity, the lanes and `max_steps`."""
    try:
        return _packed(plan, state, docs, list(lanes), n)
    except (Aside, StateError):  # (StateError: a packer state that does not load; Plan.step names it)
        return None


class _Walk:
    """One lane's draws and packers through the call; `where` maps a document (source, epoch, index) to its
    located (object, record, first token, token count)."""

    def __init__(self, plan: Plan, lane: Lane, packed: dict[str, Any], where: dict[tuple[int, int, int], tuple]) -> None:
        m = plan.manifest.packing
        self.plan, self.lane, self.where = plan, lane, where
        self.packers = {}
        for key in plan.packer_keys:
            p = make_packer(m.algorithm, m.seq_len, m.window)
            if key in packed:
                p.load(packed[key], f"lane {lane.lane} packer {key}")
            self.packers[key] = p

    def _piece(self, p: tuple[int, ...] | None) -> Piece | None:
        """A walked piece in the packers' form (source, epoch, index, start, end), its document located."""
        if p is None:
            return None
        self.where[(p[0], p[1], p[2])] = p[3:7]
        return p[0], p[1], p[2], p[7], p[8]

    def row(self) -> list[Piece]:
        """The lane's next row, as `LaneMachine.next_pieces`; `Aside` where the lane's stream ends."""
        w = self.lane
        if self.plan.per_source_packers:
            while True:
                s = w._pick()
                if s < 0:
                    raise Aside  # every source exhausted: EndOfStream, from Plan.step
                w.draws += 1
                pieces = self.packers[str(s)].next_row(lambda s=s: self._piece(w.take(s)))
                if pieces is not None:
                    w.cursors[s][CUR_ROWS] += 1
                    return pieces
                w.cursors[s][CUR_ACTIVE] = 0
        pieces = self.packers["*"].next_row(lambda: self._piece(w.pull()))
        if pieces is None:
            raise Aside  # the packer ran dry: EndOfStream, from Plan.step
        return pieces


def _packed(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int) -> FusedSteps:
    k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
    shards = Shards(plan, docs)
    want = int(n * k * L * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    lstates = [state.lanes[lane] for lane in lanes]
    where: dict[tuple[int, int, int], tuple] = {}
    # what the last call of these lanes located (located.py): its lanes' queues, checked by `Lane` before use
    kept = located.Carry.of(plan).take(lanes)
    _locate_residuals(plan, shards, lstates, where, located.residual_docs(kept))
    if kept is not None and kept.lanes is not None:
        queues = kept.lanes
    else:
        queues = lane_queues(first_located(plan, shards, lanes, lstates, want), len(lanes))
    per_obj: list[dict[str, Any]] = [{} for _ in range(n)]
    rows: list[list[list[Piece]]] = [[] for _ in range(n)]  # step -> the lanes' rows, lane after lane
    for lane, ls, q in zip(lanes, lstates, queues):
        walk = _Walk(plan, Lane(plan, shards, lane, ls, want, q), ls.packers, where)
        for j in range(n):
            rows[j] += [walk.row() for _ in range(k)]
            w = walk.lane
            per_obj[j][str(lane)] = lane_obj(w.draws, ls.rows + (j + 1) * k, [list(c) for c in w.cursors],
                                             {key: p.state() for key, p in walk.packers.items()})
    located.ensure_mapped(shards, list({(key[0], at[0]) for key, at in where.items()}))  # (kept queues' objects)
    framing, maps, keys = plan.framing, shards.maps, plan.sample_keys
    framed: dict[tuple[int, int, int], tuple[np.ndarray, str]] = {}
    for (s, e, idx), (obj, rec, a, nt) in where.items():
        framed[(s, e, idx)] = (framing.frame(maps[s][obj][1][a:a + nt]), f"{keys[s][obj]}:{rec}")
    for s, m in enumerate(np.bincount([key[0] for key in framed], minlength=len(plan.weights)).tolist()):
        if m:
            docs.count(s, m)
    if framed:  # the documents' mean framed length: how many positions the next call locates ahead
        mean = sum(len(t) for t, _ in framed.values()) / len(framed)
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * mean
    made = materialize([r for step in rows for r in step], L, plan.manifest.packing.pad_id,
                       lambda s, e, idx: framed[(s, e, idx)], framing.masks_eos_target)
    block = np.empty((n, len(PLANES), len(lanes) * k, L), dtype=np.int32)
    for a, name in enumerate(PLANES):
        block[:, a] = np.stack([getattr(r, name) for r in made]).reshape(n, len(lanes) * k, L)
    located.Carry.of(plan).keep_walked(lanes, queues, where)
    z = np.zeros(0, dtype=np.int64)
    return FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block,
                      state_dicts=state_dicts(plan, state, lanes, per_obj), keys=z, owners=[], sids=[],
                      entry_start=z, entry_off=z, bound_global=z, packed=made,
                      row_tokens=_row_tokens(rows, len(plan.weights)))


def _row_tokens(rows: list[list[list[Piece]]], sources: int) -> np.ndarray | None:
    """Every row's tokens per source (step-major rows, int64 ``[rows, sources]``) from its pieces (padding is
    none's), so that a mixture's counts need no sample ID parsed; None for one source (its count is the
    rows' fill)."""
    if sources < 2:
        return None
    at, lengths = [], []
    i = 0
    for step in rows:
        for row in step:
            for p in row:
                at.append(i * sources + p[0])
                lengths.append(p[4] - p[3])
            i += 1
    return np.bincount(at, weights=lengths, minlength=i * sources).astype(np.int64).reshape(i, sources)


def _locate_residuals(plan: Plan, shards: Shards, lstates: list[Any], where: dict, kept: dict) -> None:
    """Every document the lanes' packer states point into (open bins, pending rows, a residual), located into
    `where` (from `kept`, the last call's located documents, where it has them); `Aside` where a piece lies
    outside its source or its document (`Plan.step` meets it)."""
    m = plan.manifest.packing
    frame = plan.framing.framed_len(0)
    pieces: list[tuple[int, ...]] = []
    for ls in lstates:
        if set(ls.packers) - set(plan.packer_keys):
            raise Aside  # another plan's packers: Plan.step refuses them
        for key, packed in ls.packers.items():
            p = make_packer(m.algorithm, m.seq_len, m.window)
            p.load(packed, "lane")
            pieces += p.residual_pieces()
    for s in sorted({p[0] for p in pieces}):
        if not 0 <= s < len(plan.weights):
            raise Aside
        mine = [p for p in pieces if p[0] == s]
        got = {tuple(p[:3]): kept[tuple(p[:3])] for p in mine if tuple(p[:3]) in kept}
        new = [p for p in mine if tuple(p[:3]) not in got]
        if new:
            for p, *at in zip(new, *shards.locate(s, np.asarray([p[2] for p in new], dtype=np.int64))):
                got[tuple(p[:3])] = tuple(at)
        for p in mine:
            o, r, a0, n0 = got[tuple(p[:3])]
            if not 0 <= p[3] < p[4] <= n0 + frame:
                raise Aside  # a piece outside its document
            where[(s, p[1], p[2])] = (o, r, a0, n0)
