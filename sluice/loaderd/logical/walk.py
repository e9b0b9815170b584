"""The fast path's walk of a lane's draws, on integers: what `Plan.step`'s `LaneMachine` draws, without documents.

`Lane` draws as `lanemachine.LaneMachine` does (`take`: source s's next draw, its
open document or next position, its exhaustion rule, the piece's cut, the
realized counts; `pull`: pick, take, as the shared packer pulls), over
integers only: the candidates' lengths come from the mapped shards' offsets
(`Shards`), located per source in one `searchsorted` a batch (`first_located`,
`lane_queues`), and no `DocRef`, framing or `docs` call is made per draw. A
draw that would end or fail the stream, or read a document the shards do not
hold, raises `Aside`: the fast path stands aside and `Plan.step` meets it.
Used by `fusedpack` (the packers driven by it) and, for its queues and
checks, by `fusedmix` (the same walk in the compiled kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.datastate import CUR_ACTIVE, CUR_DOCS, CUR_EPOCH, CUR_LOSS_TOKENS, CUR_OPEN, CUR_TAKEN, CUR_TOKENS
from sluice.loaderd.logical.mixture import categorical_pick, quota_pick
from sluice.loaderd.logical.state import DataState, state_obj

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import Plan

MIN_BATCH = 8
REFILL_MAX = 1024  # positions a refill of a lane's queue locates at most (fusedmix's too)


class Aside(Exception):
    """The call cannot be computed here: the per-lane path takes it (internal; never leaves this module)."""


class Shards:
    """The call's view of the mapped shards: per source, object -> (offsets, tokens, records), and where a
    sample index lies (object, record, first token, token count)."""

    def __init__(self, plan: Plan, docs: Any) -> None:
        self.plan, self.docs = plan, docs
        self.maps: list[dict[int, Any]] = [{} for _ in plan.weights]

    def locate(self, s: int, idx: np.ndarray, check: bool = True) -> tuple[list[int], list[int], list[int], list[int]]:
        """(objects, records, first tokens, token counts) of source s's sample indices `idx` (int64; `check`:
        that they lie in the source, where they do not come from its order)."""
        return tuple(a.tolist() for a in self.arrays(s, idx, check))  # type: ignore[return-value]

    def arrays(self, s: int, idx: np.ndarray, check: bool = True) -> tuple[np.ndarray, ...]:
        """`locate` as int64 arrays."""
        if check and len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.plan.source_records[s]):
            raise Aside  # outside the source: Plan.step names it
        starts, ids = self.plan._starts_np[s]
        kk = starts.searchsorted(idx, side="right") - 1
        objs = ids[kk]
        recs = idx - starts[kk]
        maps = self.maps[s]
        k0, k1 = (int(kk.min()), int(kk.max())) if len(kk) > 64 else (0, 1 << 62)
        if k1 - k0 < 4096:  # (the objects present, from a count over the few they span: no list of every index)
            uniq = set(ids[np.flatnonzero(np.bincount(kk - k0)) + k0].tolist())
        else:
            uniq = set(objs.tolist())
        missing = [o for o in uniq if o not in maps]
        if missing:
            got = self.docs.mapped(s, missing)
            if got is None:
                raise Aside  # being made from text (or failed): the per-document read meets it
            maps.update(got)
        tstart = np.empty(len(idx), dtype=np.int64)
        ntok = np.empty(len(idx), dtype=np.int64)
        for o in uniq:
            offsets, _, records = maps[o]
            m = objs == o if len(uniq) > 1 else slice(None)
            r = recs[m]
            if len(r) and int(r.max()) >= records:
                raise Aside  # past the shard's end: the per-document read names it
            a = offsets[r].astype(np.int64)
            tstart[m] = a
            ntok[m] = offsets[r + 1].astype(np.int64) - a
        return objs, recs, tstart, ntok


class Lane:
    """One lane's draws through the call (`lanemachine.LaneMachine`'s draws on integers): its cursors and draw counter;
    per source a queue of located next positions. A draw is a piece (source, epoch, index, object, record, first
    token, token count, framed offset, end, framed length)."""

    def __init__(self, plan: Plan, shards: Shards, lane: int, ls: Any, want: int,
                 queues: dict[int, tuple[int, int, tuple[list[int], ...], list[int]]]) -> None:
        self.plan, self.shards, self.lane = plan, shards, lane
        self.cursors = [c.to_list() for c in ls.sources]
        self.draws = ls.draws
        self.shares = plan.lane_shares(lane)
        self.want = want
        self.queues = queues  # s -> (epoch, first position, located (objects, records, starts, counts), indices)
        self.weights = plan.weights
        self.col = plan.unit_column
        self.by_tokens = plan.manifest.mixture.policy == "quota" and not plan.counted
        # (source, weight, its cursor) of the sources with a weight, in order: the cursors are changed in place
        self.weighted = [(s, w, c) for s, (w, c) in enumerate(zip(self.weights, self.cursors)) if w]
        # s -> its open document drawn in this call (epoch, index, object, record, first token, token count)
        self.opened: dict[int, tuple[int, int, int, int, int, int]] = {}
        self.wraps: dict[int, int] = {}
        self.rng = plan.rng(lane) if plan.manifest.mixture.policy == "categorical" else None
        self.frame = plan.framing.framed_len(0)  # separators a document adds

    def _next(self, s: int, c: list[int]) -> tuple[int, int, int, int, int, int]:
        """Source s's document at the cursor's position (epoch, index, object, record, first token, count); the
        cursor moves past it."""
        epoch, taken = c[CUR_EPOCH], c[CUR_TAKEN]
        q = self.queues.get(s)
        if q is None or q[0] != epoch or not q[1] <= taken < q[1] + len(q[3]):
            # (twice the queue it outran, bounded: a queue kept for the next call would double each time)
            hi = min(self.shares[s], taken + max(MIN_BATCH, self.want if q is None else min(2 * len(q[3]), REFILL_MAX)))
            idx = self.plan.lane_samples(s, epoch, self.lane, taken, hi)
            q = self.queues[s] = (epoch, taken, self.shards.locate(s, idx, False), idx.tolist())
        i = taken - q[1]
        objs, recs, a, nt = q[2]
        c[CUR_TAKEN] = taken + 1
        c[CUR_DOCS] += 1
        return epoch, q[3][i], objs[i], recs[i], a[i], nt[i]

    def _open(self, s: int, c: list[int]) -> tuple[int, int, int, int, int, int]:
        """Source s's open document (the lane's ``taken - 1``-th of the cursor's epoch)."""
        got = self.opened.get(s)
        if got is None:
            epoch, taken = c[CUR_EPOCH], c[CUR_TAKEN]
            if not 0 < taken <= self.shares[s]:
                raise Aside  # an open document before any was taken: Plan.step meets it
            q = self.queues.get(s)
            if q is not None and q[0] == epoch and q[1] <= taken - 1 < q[1] + len(q[3]):
                i = taken - 1 - q[1]
                objs, recs, a, nt = q[2]
                return epoch, q[3][i], objs[i], recs[i], a[i], nt[i]
            idx = self.plan.lane_sample(s, epoch, self.lane, taken - 1)
            objs, recs, a, nt = self.shards.locate(s, np.asarray([idx], dtype=np.int64), False)
            got = (epoch, idx, objs[0], recs[0], a[0], nt[0])
        return got

    def _pick(self) -> int:
        cursors = self.cursors
        if self.by_tokens:  # `quota_pick` for token units, inline (a draw's largest cost otherwise)
            col, weighted = self.col, self.weighted
            tw = total = 0
            for _, w, c in weighted:
                if c[CUR_ACTIVE]:
                    tw += w
                    total += c[col]
            best, best_score = -1, 0
            for s, w, c in weighted:
                if c[CUR_ACTIVE]:
                    score = w * total - tw * c[col]
                    if best < 0 or score > best_score:
                        best, best_score = s, score
            return best
        active = [bool(c[CUR_ACTIVE]) for c in cursors]
        if self.rng is not None:
            return categorical_pick(self.weights, active, self.rng.u64(self.draws))
        return quota_pick(self.weights, [c[self.col] for c in cursors], active, True)

    def take(self, s: int) -> tuple[int, ...] | None:
        """Source s's next draw, as `LaneMachine._take` (open document or next position, exhaustion rules, the
        piece's cut, realized counts): the piece (possibly empty), or None where the source just became
        inactive."""
        plan = self.plan
        c = self.cursors[s]
        off = c[CUR_OPEN]
        if off:
            doc = self._open(s, c)
        else:
            if c[CUR_TAKEN] >= self.shares[s]:
                rule = plan.manifest.sources[s].exhaustion
                if rule == "repeat" and self.shares[s] > 0:
                    total = sum(x[CUR_TOKENS] for x in self.cursors)
                    if self.wraps.get(s) == total:
                        raise Aside  # a repeat that draws no token: ExhaustedError, from Plan.step
                    self.wraps[s] = total
                    c[CUR_EPOCH] += 1
                    c[CUR_TAKEN] = 0
                elif rule in ("renormalize", "repeat"):
                    c[CUR_ACTIVE] = 0
                    return None
                else:
                    raise Aside  # stop / fail: Plan.step raises
            doc = self._next(s, c)
        epoch, idx, obj, rec, a, nt = doc
        length = nt + self.frame
        if off and off >= length:
            raise Aside  # an open offset past its document: Plan.step names it
        b = plan.piece_tokens
        end = length if b is None or length - off <= b else off + b
        if end == length:
            c[CUR_OPEN] = 0
            self.opened.pop(s, None)
        else:
            c[CUR_OPEN] = end
            self.opened[s] = doc
        c[CUR_TOKENS] += end - off
        c[CUR_LOSS_TOKENS] += plan.framing.loss_tokens_in(off, end, length)
        return s, epoch, idx, obj, rec, a, nt, off, end, length

    def pull(self) -> tuple[int, ...]:
        """The lane's next draw, as `LaneMachine._pull_mixed`: pick, take (an inactive source is picked past)."""
        while True:
            s = self._pick()
            if s < 0:
                raise Aside  # every source exhausted: EndOfStream, from Plan.step
            got = self.take(s)
            if got is not None:
                self.draws += 1
                return got


# Per live source: its sample indices, objects, records, first tokens and counts (int64 arrays) for every lane's
# queue, one after another, and where each lane's lies: (lane index, epoch, first position, count).
Located = list[tuple[int, np.ndarray, tuple[np.ndarray, ...], list[tuple[int, int, int, int]]]]


def first_located(plan: Plan, shards: Shards, lanes: list[int], lstates: list[Any], want: int) -> Located:
    """Per live source, every lane's expected positions of the call (from its open document or its cursor, about
    `want` draws of the call times the source's share of the lane's live weight, with a margin) located in one
    `locate`. A lane that draws more refills its queue itself (`Lane._next`, or on the kernel's request)."""
    out: Located = []
    weights = plan.weights
    live_w = [sum(w for w, c in zip(weights, ls.sources) if w and c.active) for ls in lstates]
    for s, w in enumerate(weights):
        if not w:
            continue
        parts, where = [], []
        for i, (lane, ls) in enumerate(zip(lanes, lstates)):
            c = ls.sources[s]
            if not c.active or not live_w[i]:
                continue
            lo = c.taken - 1 if c.open and c.taken > 0 else c.taken
            hi = min(plan.lane_shares(lane)[s], c.taken + MIN_BATCH // 2 + (want * w * 3) // (2 * live_w[i]))
            if hi > lo:
                parts.append(plan.lane_samples(s, c.epoch, lane, lo, hi))
                where.append((i, c.epoch, lo, hi - lo))
        if parts:
            idx = np.concatenate(parts) if len(parts) > 1 else parts[0]
            out.append((s, idx, shards.arrays(s, idx, False), where))
    return out


def lane_queues(located: Located, P: int) -> list[dict[int, tuple[int, int, tuple[list[int], ...], list[int]]]]:
    """`first_located` as each lane's queues for the Python walk (`Lane.queues`)."""
    out: list[dict[int, Any]] = [{} for _ in range(P)]
    for s, idx, arrays, where in located:
        idx_l = idx.tolist()
        objs, recs, a, nt = (x.tolist() for x in arrays)
        at = 0
        for i, epoch, lo, m in where:
            out[i][s] = (epoch, lo, (objs[at:at + m], recs[at:at + m], a[at:at + m], nt[at:at + m]), idx_l[at:at + m])
            at += m
    return out


def state_dicts(plan: Plan, state: DataState, lanes: list[int], per_obj: list[dict[str, Any]]) -> list[dict]:
    """The state after each step of the call as `state_dict()` writes it, from each step's lane objects."""
    if lanes != sorted(lanes):  # (state_dict's order: the lanes sorted)
        per_obj = [{str(lane): per[str(lane)] for lane in sorted(lanes)} for per in per_obj]
    return [state_obj(plan.dataset_id, plan.runspec_digest, state.step + 1 + j, per) for j, per in enumerate(per_obj)]
