"""The fast path's located positions, kept from one call to the next of the same plan and lanes.

A kernel call (`fusedmix`, `fusedbins`) needs, per lane and live source, the next sample
positions located: (index, object, record, first token, token count). Those
are pure functions of (source, epoch, lane, position) and of the manifest
and the shards' offsets (verified bytes), so what one call located and did
not draw is still right for the next call: `Carry` keeps the call's queues
as the kernel's walk left them, and the documents its lanes' last pieces
read (the next call's residuals), and `queues` hands them back, locating
only the (lane, source) queues that do not cover the call, about `AHEAD`
calls' worth at a time. Profiled with bench/fused_mix.py, locating every
queue every call (5 sources x 8 lanes of `lane_samples`, one `locate` a
source) was ~1/3 of a five-source mixture's CPU a step. No byte depends on
it: the kernel checks each queue's epoch and range before it reads it and
asks for a refill otherwise.

A kernel call also keeps where it ended (`Ended`), so that the next call of
the same stream skips reading the state and checking the queues.

What is not kept is the shards' mapping: each call maps the objects it
reads again (`ensure_mapped`), so the reads are verified per call as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.datastate import CUR_ACTIVE, CUR_EPOCH, CUR_OPEN, CUR_TAKEN
from sluice.loaderd.logical.shards import MIN_BATCH, Aside, Shards

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import Plan

AHEAD = 8  # a queue located afresh covers about this many calls' expected draws
_KEPT = 16  # lane sets kept per plan (a replica's producer uses one; tests and benches a few)

# (qfirst, qlen, qepoch, qdata) as `jitdraws.walk` takes them
Queues = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class Kept:
    """One kernel call's queues (`q`), and per (source, epoch, index) the located (object, record, first token,
    token count) of documents it read (its lanes' last pieces or held bins: the next call's residuals).

    It also keeps where the call ended (`ended`: `Ended` for concat, `fusedbins.Held` for best-fit): the next
    call that continues from the very state object it returned (``state is kept.ended.after``) starts from
    these arrays instead of reading the state's lanes."""

    def __init__(self, q: Queues, ended: Any = None, last: np.ndarray | None = None) -> None:
        self.q, self.ended, self._last = q, ended, last
        self._docs: dict[tuple[int, int, int], tuple[int, int, int, int]] | None = None

    @property
    def docs(self) -> dict[tuple[int, int, int], tuple[int, int, int, int]]:
        """The located documents (a kernel call's: its lanes' last pieces, made on first use)."""
        if self._docs is None:
            self._docs = {}
            for s, e, idx, o, r, a, nt in ([] if self._last is None else self._last[:, :7].tolist()):
                self._docs[(s, e, idx)] = (o, r, a, nt)
        return self._docs


class Ended:
    """Where a kernel call left its lanes, in the walk's form: the state after its last step (`after`, the
    `DataState` it returned), its cursors `cur` (lanes, sources, 8), draw counters, rows, and each lane's
    residual as a piece (`residual` (lanes, 10), rows where `has` is False unused).

    A call continuing from `after` also skips `queues`' check of the kept queues (~30 us for one source, ~60
    for five, a call, measured): the kernel checks each queue before it reads it and asks for a refill
    (`jitdraws.WALK_NEED`, twice the queue it outran, up to `shards.REFILL_MAX`) where one runs short."""

    __slots__ = ("after", "cur", "draws", "rows", "residual", "has")

    def __init__(self, after: object, cur: np.ndarray, draws: np.ndarray, rows: list[int], residual: np.ndarray,
                 has: np.ndarray) -> None:
        self.after, self.cur, self.draws, self.rows = after, cur, draws, rows
        self.residual, self.has = residual, has


class Carry:
    """A plan's kept calls, by lane set. `take` hands one over (removed: two producers of the same lanes never
    share its arrays, which the next call's refills write); `keep` stores the call's."""

    def __init__(self) -> None:
        self._by_lanes: dict[tuple[int, ...], Kept] = {}
        self._setups: dict[tuple[int, ...], dict] = {}

    @staticmethod
    def of(plan: Plan) -> Carry:
        """The plan's carry (made on first use)."""
        got = plan.__dict__.get("_fast_carry")
        if got is None:
            got = plan.__dict__["_fast_carry"] = Carry()
        return got

    def take(self, lanes: list[int]) -> Kept | None:
        return self._by_lanes.pop(tuple(lanes), None)

    def keep(self, lanes: list[int], q: Queues, last: np.ndarray, ended: Any = None) -> None:
        """Keep a kernel call's queues (as its walk left them), the pieces its lanes hold (`last` (pieces, 10):
        their documents, located, for the next call's residuals) and, for the next call of the same stream,
        where it ended."""
        if len(self._by_lanes) >= _KEPT:
            self._by_lanes.clear()
        self._by_lanes[tuple(lanes)] = Kept(q, ended, last)

    def setup(self, lanes: list[int]) -> dict:
        """A dict kept for the lane set for as long as the plan lives (what a call derives from the plan and
        the lanes alone: `fusedmix` fills it on first use)."""
        got = self._setups.get(tuple(lanes))
        if got is None:
            if len(self._setups) >= _KEPT:
                self._setups.clear()
            got = self._setups[tuple(lanes)] = {}
        return got


def queues(plan: Plan, shards: Shards, lanes: list[int], cur: np.ndarray, shares: np.ndarray, want: int,
           kept: Kept | None) -> Queues:
    """Per lane and live source, the queue of the positions the call is expected to draw (from its open document
    or its cursor, about `want` draws times the source's share of the lane's live weight, with a margin), as
    `jitdraws.walk` takes them: `kept`'s where it covers them, else located (`AHEAD` times as far, one `locate`
    per source). `cur` (lanes, sources, 8) and `shares` (lanes, sources) as the walk takes them; the caller has
    checked that ``want * weight * 3`` fits int64."""
    P, S = cur.shape[:2]
    w = np.asarray(plan.weights, dtype=np.int64)
    live = (cur[:, :, CUR_ACTIVE] != 0) & (w > 0)
    live_w = (w * live).sum(axis=1, keepdims=True)
    taken, epoch = cur[:, :, CUR_TAKEN], cur[:, :, CUR_EPOCH]
    lo = taken - ((cur[:, :, CUR_OPEN] != 0) & (taken > 0))
    hi = np.minimum(shares, taken + MIN_BATCH // 2 + (want * w * 3) // np.maximum(2 * live_w, 1))
    need = live & (live_w > 0) & (hi > lo)
    if kept is None:
        qfirst, qlen, qepoch = (np.zeros((P, S), dtype=np.int64) for _ in range(3))
        qdata = np.zeros((P, S, MIN_BATCH, 5), dtype=np.int64)
        fresh = need
    else:
        qfirst, qlen, qepoch, qdata = kept.q
        fresh = need & ~((qepoch == epoch) & (qfirst <= lo) & (hi <= qfirst + qlen))
    if not fresh.any():
        return qfirst, qlen, qepoch, qdata
    ahead = np.minimum(shares, lo + AHEAD * (hi - lo))
    got: list[tuple[int, int, np.ndarray]] = []
    for s in np.flatnonzero(fresh.any(axis=0)).tolist():
        mine = np.flatnonzero(fresh[:, s]).tolist()
        parts = [plan.lane_samples(s, int(epoch[i, s]), lanes[i], int(lo[i, s]), int(ahead[i, s])) for i in mine]
        idx = np.concatenate(parts) if len(parts) > 1 else parts[0]
        rows = np.stack([idx, *shards.arrays(s, idx, False)], axis=1)
        at = 0
        for i, part in zip(mine, parts):
            got.append((i, s, rows[at:at + len(part)]))
            at += len(part)
    width = max(len(r) for _, _, r in got)
    if width > qdata.shape[2]:
        qdata = np.concatenate([qdata, np.zeros((P, S, width - qdata.shape[2], 5), dtype=np.int64)], axis=2)
    for i, s, r in got:
        qdata[i, s, :len(r)] = r
        qfirst[i, s], qlen[i, s], qepoch[i, s] = lo[i, s], len(r), epoch[i, s]
    return qfirst, qlen, qepoch, qdata


def ensure_mapped(shards: Shards, objects: list[tuple[int, int]]) -> None:
    """Map the (source, object)s a call reads that it has not mapped yet (the kept queues' and documents'),
    one `docs.mapped` per source; `Aside` where one is not (its tokens are being made from text, or it failed:
    the per-document read meets it)."""
    missing: dict[int, list[int]] = {}
    for s, o in objects:
        if o not in shards.maps[s]:
            missing.setdefault(s, []).append(o)
    for s, objs in missing.items():
        got = shards.docs.mapped(s, objs)
        if got is None:
            raise Aside
        shards.maps[s].update(got)


def tokens_of(shards: Shards) -> Callable[[list[int]], list[np.ndarray]]:
    """What the row kernels ask for (`jit.Kernel.assemble`'s `tokens_of`): the token arrays of objects given as
    ``(source << 32) + object``, each mapped first where the call has not (`ensure_mapped`: the kept queues' and
    residuals' objects, their reads verified per call)."""
    def arrays(objects: list[int]) -> list[np.ndarray]:
        pairs = [(o >> 32, o & 0xFFFFFFFF) for o in objects]
        ensure_mapped(shards, pairs)
        maps = shards.maps
        return [maps[s][o][1] for s, o in pairs]

    return arrays


def residual_docs(kept: Kept | None) -> dict[tuple[int, int, int], tuple[int, int, int, int]]:
    """`kept`'s located documents (none where nothing was kept)."""
    return {} if kept is None else kept.docs

