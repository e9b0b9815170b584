"""The fast path for concat packing: every lane and step of a call, draws walked, rows in arrays.

Concat cuts one stream a lane into rows, so what a call needs is each
lane's draws until its stream covers the call. `mixed_steps` walks them,
lane after lane, exactly as `plan.LaneMachine` does for concat packing (pick
among the live sources by quota or categorical weights, open document or next
position, exhaustion, the piece's cut, the realized counts), but over
integers only: the candidates' lengths come from the mapped shards' offsets,
located per source in one `searchsorted` a batch, and no `DocRef`, framing
or `docs` call is made per draw. The lane draws while its stream (residual,
then pieces) is short of the next step boundary ``(j + 1) * T``, which is
exactly when the concat packer pulls; at each boundary the lane's state is
written down (cursors, draws, rows, the residual straddling it).

The rows of every lane and step are then built from the pieces: one gather
of the pieces' framed ranges, a strided copy into the step-major block ``(n, 3, P*k, L)``, labels
shifted (a piece cut before its document's end targets the document's next
token, not the next piece's), -100 at a document's last token and, with
``exclude_separator``, on the eos target; positions restart at every piece
start and every row start.

With a loaded `jit.Kernel` both halves run compiled (`jitkernels.walk` for
every lane's draws, `jitkernels.assemble` with `gather` and `finish` for the
rows); the Python walk and the numpy assembly are the fallback, and give the
same bytes and states.

It stands aside (None; the per-lane path runs and meets the case exactly
where `Plan.step` does) for what would end or fail the stream or ask for a
document it cannot see: a source exhausted under `stop` or `fail`, every
source exhausted, a `repeat` loop that draws no token, an object not mapped,
a record past its shard's end, a residual or open offset that does not fit its
document, a packer state that is not concat's.
(tests/test_logical_fused.py, test_mixture_pieces.py and
test_logical_conformance.py hold it to `Plan.step` byte for byte, states
included.)

Why over 450 lines: the walk (Python and the kernel's driver), the queues it
reads and the assembly (numpy and the kernel's driver) share one layout, the
walked pieces and each step's state; split apart, each part would restate it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.datastate import CUR_ACTIVE, CUR_DOCS, CUR_EPOCH, CUR_LOSS_TOKENS, CUR_OPEN, CUR_TAKEN, CUR_TOKENS
from sluice.loaderd.logical.fused import FusedSteps, _arange, _block_of, _frame_id, _framed_piece, _row_starts
from sluice.loaderd.logical.mixture import categorical_pick, quota_pick
from sluice.loaderd.logical.packing import IGNORE
from sluice.loaderd.logical.state import STATE_KIND, STATE_SCHEMA, DataState

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan

_MIN_BATCH = 8


class _Aside(Exception):
    """The call cannot be computed here: the per-lane path takes it (internal; never leaves this module)."""


class _Shards:
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
            raise _Aside  # outside the source: Plan.step names it
        starts, ids = self.plan._starts_np[s]
        kk = starts.searchsorted(idx, side="right") - 1
        objs = ids[kk]
        recs = idx - starts[kk]
        maps = self.maps[s]
        uniq = set(objs.tolist())
        missing = [o for o in uniq if o not in maps]
        if missing:
            got = self.docs.mapped(s, missing)
            if got is None:
                raise _Aside  # not mapped yet: the per-document read starts it
            maps.update(got)
        tstart = np.empty(len(idx), dtype=np.int64)
        ntok = np.empty(len(idx), dtype=np.int64)
        for o in uniq:
            offsets, _, records = maps[o]
            m = objs == o if len(uniq) > 1 else slice(None)
            r = recs[m]
            if len(r) and int(r.max()) >= records:
                raise _Aside  # past the shard's end: the per-document read names it
            a = offsets[r].astype(np.int64)
            tstart[m] = a
            ntok[m] = offsets[r + 1].astype(np.int64) - a
        return objs, recs, tstart, ntok


class _Lane:
    """One lane's draws through the call (`plan.LaneMachine`'s concat draws on integers): its cursors, draw
    counter, stream length and pieces; per source a queue of located next positions."""

    def __init__(self, plan: Plan, shards: _Shards, lane: int, ls: Any, want: int,
                 queues: dict[int, tuple[int, int, tuple[list[int], ...], list[int]]],
                 residual: tuple[int, ...] | None) -> None:
        self.plan, self.shards, self.lane = plan, shards, lane
        self.cursors = [c.to_list() for c in ls.sources]
        self.draws = ls.draws
        self.shares = plan.lane_shares(lane)
        self.want = want
        self.queues = queues  # s -> (epoch, first position, located (objects, records, starts, counts), indices)
        self.weights = plan.weights
        self.col = plan.unit_column
        self.by_tokens = plan.manifest.mixture.policy == "quota" and not plan.counted
        # s -> its open document drawn in this call (epoch, index, object, record, first token, token count)
        self.opened: dict[int, tuple[int, int, int, int, int, int]] = {}
        self.wraps: dict[int, int] = {}
        self.rng = plan.rng(lane) if plan.manifest.mixture.policy == "categorical" else None
        self.frame = plan.framing.framed_len(0)  # separators a document adds
        # pieces: source, epoch, index, object, record, first token, token count, framed off, end, framed length
        self.pieces: list[tuple[int, ...]] = [] if residual is None else [residual]
        self.total = 0 if residual is None else residual[8] - residual[7]

    def _next(self, s: int, c: list[int]) -> tuple[int, int, int, int, int, int]:
        """Source s's document at the cursor's position (epoch, index, object, record, first token, count); the
        cursor moves past it."""
        epoch, taken = c[CUR_EPOCH], c[CUR_TAKEN]
        q = self.queues.get(s)
        if q is None or q[0] != epoch or not q[1] <= taken < q[1] + len(q[3]):
            hi = min(self.shares[s], taken + max(_MIN_BATCH, self.want if q is None else 2 * len(q[3])))
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
                raise _Aside  # an open document before any was taken: Plan.step meets it
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
            col = self.col
            tw = total = 0
            for w, c in zip(self.weights, cursors):
                if w and c[CUR_ACTIVE]:
                    tw += w
                    total += c[col]
            best, best_score = -1, 0
            for s, (w, c) in enumerate(zip(self.weights, cursors)):
                if w and c[CUR_ACTIVE]:
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
        piece's cut, realized counts): the piece (`pieces`' form; possibly empty), or None where the source just
        became inactive."""
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
                        raise _Aside  # a repeat that draws no token: ExhaustedError, from Plan.step
                    self.wraps[s] = total
                    c[CUR_EPOCH] += 1
                    c[CUR_TAKEN] = 0
                elif rule in ("renormalize", "repeat"):
                    c[CUR_ACTIVE] = 0
                    return None
                else:
                    raise _Aside  # stop / fail: Plan.step raises
            doc = self._next(s, c)
        epoch, idx, obj, rec, a, nt = doc
        length = nt + self.frame
        if off and off >= length:
            raise _Aside  # an open offset past its document: Plan.step names it
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
                raise _Aside  # every source exhausted: EndOfStream, from Plan.step
            got = self.take(s)
            if got is not None:
                self.draws += 1
                return got

    def draw(self) -> None:
        """One draw (`pull`) into the lane's stream of pieces."""
        p = self.pull()
        if p[8] > p[7]:  # an empty document (no separators) contributes no piece
            self.pieces.append(p)
            self.total += p[8] - p[7]

    def state_obj(self, rows: int, boundary: int) -> dict[str, Any]:
        """The lane's JSON state at stream position `boundary` (a step's end), as `LaneState.to_obj` writes it."""
        if self.total > boundary:
            p = self.pieces[-1]
            cur = [p[0], p[1], p[2], p[8] - (self.total - boundary), p[8]]
        else:
            cur = None
        return {"draws": self.draws, "rows": rows, "sources": [list(c) for c in self.cursors],
                "packers": {"*": {"cur": cur}}}


def mixed_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
                kernel: Any = None) -> FusedSteps | None:
    """`fast.fast_steps` for a concat plan (one or several live sources, quota or categorical, units documents,
    tokens and loss tokens, piece draws): steps ``state.step + 1 .. state.step + n`` of `lanes`, or None where it
    stands aside (module docstring). The caller has checked the state's identity, the lanes and `max_steps`. `kernel`
    (a loaded `jit.Kernel`, or None) walks the draws in compiled code where it can; the result is the same."""
    try:
        return _mixed(plan, state, docs, list(lanes), n, kernel)
    except _Aside:
        return None


def _python_walk(w: _Lane, n: int, T: int, rows0: int, k: int) -> list[dict[str, Any]]:
    """Lane `w`'s draws for the call, one `_Lane.draw` at a time; its JSON state after each step."""
    out = []
    for j in range(n):
        b = (j + 1) * T
        while w.total < b:  # the concat packer pulls while the row is short
            w.draw()
        out.append(w.state_obj(rows0 + (j + 1) * k, b))
    return out


class _Walked:
    """A lane's walk as the kernel left it: its pieces and stream length (what `_assemble` reads of a `_Lane`)."""

    def __init__(self, pieces: list[tuple[int, ...]], total: int) -> None:
        self.pieces, self.total = pieces, total


def _compiled_walks(plan: Plan, shards: _Shards, lanes: list[int], lstates: list[Any], located: Located,
                    residuals: list[Any], want: int, n: int, T: int, walk: Any) -> tuple[list[Any], list[Any]] | None:
    """`_python_walk` of every lane in the kernel's `walk` (jitkernels), one call for all lanes (and one more per
    queue it asks to refill): (walked lanes, their cursors and residuals per step as `meta`/`snaps` lists); None
    where its integers could overflow int64 or a categorical weight total exceeds 2**32 (the Python walk runs)."""
    P, S = len(lanes), len(plan.weights)
    policy = plan.manifest.mixture.policy
    mode = 2 if policy == "categorical" else 1 if plan.counted else 0
    col = plan.unit_column
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(P, S, 8)
    W = sum(plan.weights)
    reach = int(cur[:, :, [col, CUR_TOKENS]].sum(axis=1).max()) + 4 * n * T + 64
    if (mode == 2 and W > 1 << 32) or 8 * S * (W + 1) * (max(plan.weights) + 1) * reach >= 1 << 62:
        return None
    st = np.zeros((P, 5), dtype=np.int64)
    st[:, 0] = [ls.draws for ls in lstates]
    cap = max(4 * want, 64)
    pieces = np.zeros((P, cap, 10), dtype=np.int64)
    for i, r in enumerate(residuals):
        if r is not None:
            pieces[i, 0] = r
            st[i, 1], st[i, 3] = r[8] - r[7], 1
    qfirst, qlen, qepoch = (np.zeros((P, S), dtype=np.int64) for _ in range(3))
    width = max([m for _, _, _, where in located for _, _, _, m in where] + [_MIN_BATCH])
    qdata = np.zeros((P, S, width, 5), dtype=np.int64)
    for s, idx, (objs, recs, a, nt), where in located:
        li, epochs, los, ms = (np.asarray(x, dtype=np.int64) for x in zip(*where))
        qfirst[li, s], qlen[li, s], qepoch[li, s] = los, ms, epochs
        starts = np.cumsum(ms) - ms
        pos = np.arange(len(idx), dtype=np.int64) - starts.repeat(ms)  # each row's place in its lane's queue
        qdata[li.repeat(ms), s, pos] = np.stack([idx, objs, recs, a, nt], axis=1)
    shares = np.asarray([plan.lane_shares(lane) for lane in lanes], dtype=np.int64).reshape(P, S)
    keys = np.asarray([plan.rng(lane).key if mode == 2 else 0 for lane in lanes], dtype=np.uint64)
    rules = np.asarray([{"repeat": 0, "renormalize": 1}.get(src.exhaustion, 2) for src in plan.manifest.sources],
                       dtype=np.int64)
    wraps = np.full((P, S), -1, dtype=np.int64)
    opened = np.zeros((P, S, 7), dtype=np.int64)
    snaps = np.zeros((P, n, S, 8), dtype=np.int64)
    meta = np.zeros((P, n, 7), dtype=np.int64)
    weights = np.asarray(plan.weights, dtype=np.int64)
    done, aside, _, full = walk.status
    B, frame, masks = plan.piece_tokens or 0, plan.framing.framed_len(0), bool(plan.framing.masks_eos_target)
    while True:
        got, i = walk(n, T, B, frame, masks, mode, keys, col, weights, shares, rules, cur, st, wraps, qfirst, qlen,
                      qepoch, qdata, opened, pieces, snaps, meta)
        if got == done:
            break
        if got == aside:
            raise _Aside
        if got == full:
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            continue
        s = int(st[i, 4])  # refill lane i's queue of source s from its cursor (its open document first)
        c = cur[i, s]
        pos = int(c[CUR_TAKEN]) - 1 if c[CUR_OPEN] and not opened[i, s, 0] else int(c[CUR_TAKEN])
        hi = min(int(shares[i, s]), pos + max(_MIN_BATCH, 2 * int(qlen[i, s])))
        if not 0 <= pos < hi:
            raise _Aside  # (the kernel asks only for positions inside the share)
        idx = plan.lane_samples(s, int(c[CUR_EPOCH]), lanes[i], pos, hi)
        if hi - pos > qdata.shape[2]:
            grow = np.zeros((P, S, hi - pos - qdata.shape[2], 5), dtype=np.int64)
            qdata = np.concatenate([qdata, grow], axis=2)
        qdata[i, s, :hi - pos] = np.stack([idx, *shards.arrays(s, idx, False)], axis=1)
        qfirst[i, s], qlen[i, s], qepoch[i, s] = pos, hi - pos, c[CUR_EPOCH]
    return pieces, st[:, 3].copy(), st[:, 1].copy(), [snaps.tolist(), meta.tolist()]


def _kernel_assemble(plan: Plan, shards: _Shards, kernel: Any, pieces: np.ndarray, counts: np.ndarray,
                     totals: np.ndarray, n: int, k: int, L: int) -> tuple | object:
    """`_assemble` in the kernel from the walked pieces' arrays, or NotImplemented (the numpy assembly runs)."""
    used = np.concatenate([pieces[i, :c] for i, c in enumerate(counts.tolist())])
    objects = used[:, 0] * (1 << 32) + used[:, 3]  # (source, object): the token array a piece reads
    uniq, inverse = np.unique(objects, return_inverse=True)
    okeys = np.zeros(pieces.shape[:2], dtype=np.int64)
    okeys[np.arange(pieces.shape[1]) < counts[:, None]] = inverse.reshape(-1)
    maps = shards.maps
    toks = [maps[o >> 32][o & 0xFFFFFFFF][1] for o in uniq.tolist()]
    got = kernel.assemble(plan.framing, n, k, L, pieces, counts, totals, okeys, toks)
    if got is NotImplemented:
        return got
    block, keys, owners, glob, starts, offs = got
    own_l = owners.tolist()
    sids: list[str | None] = [None] * len(used)
    keys_of = plan.sample_keys
    mine = sorted(set(own_l))
    for u, (s, o, r) in zip(mine, used[mine][:, [0, 3, 4]].tolist()):
        sids[u] = f"{keys_of[s][o]}:{r}"
    return block, keys, own_l, sids, starts, offs, glob


def _mixed(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any = None) -> FusedSteps:
    k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
    T = k * L
    NT = n * T
    P = len(lanes)
    shards = _Shards(plan, docs)
    want = int(NT * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    lstates = [state.lanes[lane] for lane in lanes]
    residuals = _residuals(plan, shards, lstates)
    located = _first_located(plan, shards, lanes, lstates, want)
    per_obj: list[dict[str, Any]] = [{} for _ in range(n)]
    walk = None if kernel is None else kernel.walk
    got = None if walk is None else _compiled_walks(plan, shards, lanes, lstates, located, residuals, want, n, T,
                                                     walk)
    assembled: Any = NotImplemented
    if got is not None:
        pieces, counts, totals, (snaps, meta) = got
        for i, (lane, ls) in enumerate(zip(lanes, lstates)):
            for j, (snap, m) in enumerate(zip(snaps[i], meta[i])):
                per_obj[j][str(lane)] = {"draws": m[0], "rows": ls.rows + (j + 1) * k, "sources": snap,
                                         "packers": {"*": {"cur": m[2:] if m[1] else None}}}
        used = np.concatenate([pieces[i, :c] for i, c in enumerate(counts.tolist())])
        assembled = _kernel_assemble(plan, shards, kernel, pieces, counts, totals, n, k, L)
        if assembled is NotImplemented:
            walked: list[Any] = [_Walked(list(map(tuple, pieces[i, :c].tolist())), t)
                                 for i, (c, t) in enumerate(zip(counts.tolist(), totals.tolist()))]
    else:
        walked = []
        for lane, ls, q, r in zip(lanes, lstates, _lane_queues(located, P), residuals):
            w = _Lane(plan, shards, lane, ls, want, q, r)
            for j, obj in enumerate(_python_walk(w, n, T, ls.rows, k)):
                per_obj[j][str(lane)] = obj
            walked.append(w)
        used = np.asarray([p for w in walked for p in w.pieces], dtype=np.int64).reshape(-1, 10)
    # pieces handed out per source (docs.count), residuals included; the documents opened update the mean length
    for s, m in enumerate(np.bincount(used[:, 0], minlength=len(plan.weights)).tolist()):
        if m:
            docs.count(s, m)
    fresh = used[used[:, 7] == 0, 9]
    if len(fresh):
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * float(fresh.mean())
    compiled = assembled is not NotImplemented  # (the walk too: the kernel's assembly takes its arrays only)
    if assembled is NotImplemented:
        assembled = _assemble(plan, shards, walked, n, k, L)
    block, keys, owners, sids, entry_start, entry_off, glob = assembled
    return FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block,
                      state_dicts=_state_dicts(plan, state, lanes, per_obj), keys=keys, owners=owners, sids=sids,
                      entry_start=entry_start, entry_off=entry_off, bound_global=glob, compiled=compiled)


def _state_dicts(plan: Plan, state: DataState, lanes: list[int], per_obj: list[dict[str, Any]]) -> list[dict]:
    """The state after each step of the call as `state_dict()` writes it, from each step's lane objects."""
    if lanes != sorted(lanes):  # (state_dict's order: the lanes sorted)
        per_obj = [{str(lane): per[str(lane)] for lane in sorted(lanes)} for per in per_obj]
    return [{"kind": STATE_KIND, "schema": STATE_SCHEMA, "dataset_id": plan.dataset_id,
             "runspec_digest": plan.runspec_digest, "step": state.step + 1 + j, "lanes": per} for j, per in
            enumerate(per_obj)]


def _residuals(plan: Plan, shards: _Shards, lstates: list[Any]) -> list[tuple[int, ...] | None]:
    """Per lane, its concat residual as a piece (`_Lane.pieces`' form), or None; located in one `locate` per
    source."""
    cur = []
    for ls in lstates:
        if ls.packers and set(ls.packers) != {"*"}:
            raise _Aside  # not concat's state: Plan.step refuses it
        c = ls.packers.get("*", {}).get("cur") if ls.packers else None
        if c is not None and not 0 <= c[0] < len(plan.weights):
            raise _Aside
        cur.append(c)
    out: list[tuple[int, ...] | None] = [None] * len(lstates)
    frame = plan.framing.framed_len(0)
    for s in sorted({c[0] for c in cur if c is not None}):
        mine = [i for i, c in enumerate(cur) if c is not None and c[0] == s]
        objs, recs, a, nt = shards.locate(s, np.asarray([cur[i][2] for i in mine], dtype=np.int64))
        for i, o, r, a0, n0 in zip(mine, objs, recs, a, nt):
            _, re_, ridx, roff, rend = cur[i]
            if not 0 <= roff < rend <= n0 + frame:
                raise _Aside  # a residual outside its document: Plan.step meets it
            out[i] = (s, re_, ridx, o, r, a0, n0, roff, rend, n0 + frame)
    return out


# Per live source: its sample indices, objects, records, first tokens and counts (int64 arrays) for every lane's
# queue, one after another, and where each lane's lies: (lane index, epoch, first position, count).
Located = list[tuple[int, np.ndarray, tuple[np.ndarray, ...], list[tuple[int, int, int, int]]]]


def _first_located(plan: Plan, shards: _Shards, lanes: list[int], lstates: list[Any], want: int) -> Located:
    """Per live source, every lane's expected positions of the call (from its open document or its cursor, about
    `want` draws of the call times the source's share of the lane's live weight, with a margin) located in one
    `locate`. A lane that draws more refills its queue itself (`_Lane._next`, or on the kernel's request)."""
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
            hi = min(plan.lane_shares(lane)[s], c.taken + _MIN_BATCH // 2 + (want * w * 3) // (2 * live_w[i]))
            if hi > lo:
                parts.append(plan.lane_samples(s, c.epoch, lane, lo, hi))
                where.append((i, c.epoch, lo, hi - lo))
        if parts:
            idx = np.concatenate(parts) if len(parts) > 1 else parts[0]
            out.append((s, idx, shards.arrays(s, idx, False), where))
    return out


def _lane_queues(located: Located, P: int) -> list[dict[int, tuple[int, int, tuple[list[int], ...], list[int]]]]:
    """`_first_located` as each lane's queues for the Python walk (`_Lane.queues`)."""
    out: list[dict[int, Any]] = [{} for _ in range(P)]
    for s, idx, arrays, where in located:
        idx_l = idx.tolist()
        objs, recs, a, nt = (x.tolist() for x in arrays)
        at = 0
        for i, epoch, lo, m in where:
            out[i][s] = (epoch, lo, (objs[at:at + m], recs[at:at + m], a[at:at + m], nt[at:at + m]), idx_l[at:at + m])
            at += m
    return out


def _assemble(plan: Plan, shards: _Shards, walked: list[_Lane], n: int, k: int,
              L: int) -> tuple[np.ndarray, np.ndarray, list[int], list[str | None], np.ndarray, np.ndarray, np.ndarray]:
    """The block ``(n, 3, P*k, L)`` of the lanes' pieces, and `FusedSteps`' provenance: piece starts (keys),
    their owner entries, the entries' sample IDs, lane-major starts and framed offsets, the pieces' lane-major
    positions."""
    T = k * L
    NT = n * T
    P = len(walked)
    framing = plan.framing
    lead, trail = framing.bos is not None, framing.eos is not None
    pieces = [p for w in walked for p in w.pieces]
    counts = [len(w.pieces) for w in walked]
    maps = shards.maps
    toks = [[maps[p[0]][p[3]][1] for p in w.pieces] for w in walked]
    dtype = toks[0][0].dtype
    one_dtype = all(t.dtype == dtype for lt in toks for t in lt)
    bos, eos = _frame_id(framing.bos, dtype), _frame_id(framing.eos, dtype)
    if not one_dtype or bos.dtype != dtype or eos.dtype != dtype:
        bos, eos = _frame_id(framing.bos, np.dtype(np.int32)), _frame_id(framing.eos, np.dtype(np.int32))
    parts: list[np.ndarray] = []
    nexts: list[int] = []
    add = parts.append
    for w, lt in zip(walked, toks):
        last = len(w.pieces) - 1
        if not lead:  # ids [+ eos]: `_framed_piece` inline for every piece but the lane's last
            for p, t in zip(w.pieces[:last], lt):
                a0, off, end = p[5], p[7], p[8]
                if trail and end == p[9]:
                    if end - 1 > off:
                        add(t[a0 + off:a0 + end - 1])
                    add(eos)
                else:
                    add(t[a0 + off:a0 + end])
        else:
            for p, t in zip(w.pieces[:last], lt):
                _framed_piece(parts, t, p[5], p[6], p[7], p[8], lead, trail, bos, eos)
        p = w.pieces[last]
        nexts.append(_framed_piece(parts, lt[last], p[5], p[6], p[7], p[8] - (w.total - NT), lead, trail, bos, eos))
    block = _block_of(parts, nexts, n, P, k, L, dtype if one_dtype and bos.dtype == dtype else None)
    # per entry (a piece, lane-major): its lane, span, start in its lane's stream, framed offset, end and length
    arr = np.asarray([(p[7], p[8], p[9]) for p in pieces], dtype=np.int64).reshape(-1, 3)
    off, fend, flen = arr[:, 0], arr[:, 1], arr[:, 2]
    span = fend - off
    ends = span.cumsum()
    cnt = np.asarray(counts, dtype=np.int64)
    first = np.zeros(P, dtype=np.int64)
    np.cumsum(cnt[:-1], out=first[1:])
    lane_start = ends[first] - span[first]
    lane_of = np.arange(P, dtype=np.int64).repeat(cnt)
    e_start = ends - span - lane_start[lane_of]
    e_end = e_start + span
    flat = block.reshape(-1)
    PT, PT3 = P * T, 3 * P * T

    def cell(p: np.ndarray, li: np.ndarray) -> np.ndarray:
        """Flat label-plane index of lane stream position p of lane li."""
        return (p // T) * PT3 + PT + li * T + p % T

    inside = e_end < NT
    cut_at = np.flatnonzero(inside & (fend < flen))
    if len(cut_at):  # a piece cut before its document's end: its last target is the document's next token
        idx = cut_at.tolist()
        vals = []
        for e in idx:
            p = pieces[e]
            t = maps[p[0]][p[3]][1]
            end = p[8]
            vals.append(int(framing.eos) if trail and end == p[9] - 1 else int(t[p[5] + end - lead]))
        flat[cell(e_end[cut_at] - 1, lane_of[cut_at])] = vals
    doc_end = (e_end <= NT) & (fend == flen)
    flat[cell(e_end[doc_end] - 1, lane_of[doc_end])] = IGNORE
    if framing.masks_eos_target:
        at = e_start - off + flen - 2  # the token before the eos, in the lane's stream
        m = (flen >= 2) & (at >= e_start) & (at < e_end) & (at < NT)
        flat[cell(at[m], lane_of[m])] = IGNORE
    # piece starts: every row start and every entry start inside a row
    ds = (e_start < NT) & (e_start % L != 0)
    d, li = e_start[ds], lane_of[ds]
    dk = (d // T) * PT + li * T + d % T
    rk = _row_starts(n * PT, L)
    keys = np.concatenate([rk, dk])
    order = keys.argsort(kind="stable")
    keys = keys[order]
    widths = np.empty_like(keys)
    np.subtract(keys[1:], keys[:-1], out=widths[:-1])
    widths[-1] = n * PT - keys[-1]
    np.subtract(_arange(n * PT).reshape(n, P * k, L), keys.astype(np.int32).repeat(widths).reshape(n, P * k, L),
                out=block[:, 2])
    rj, rem = np.divmod(rk, PT)
    ri = rem // T
    glob = np.concatenate([lane_start[ri] + rj * T + rem % T, lane_start[li] + d])[order]
    owners = ends.searchsorted(glob, side="right")
    own_l = owners.tolist()
    sids: list[str | None] = [None] * len(pieces)
    keys_of = plan.sample_keys
    for u in set(own_l):
        p = pieces[u]
        sids[u] = f"{keys_of[p[0]][p[3]]}:{p[4]}"
    return block, keys, own_l, sids, ends - span, off, glob
