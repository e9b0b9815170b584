"""Concat steps of every lane at once: one set of array operations for all lanes and all steps of a call.

`multistep._one_draw_per_lane` draws each lane's documents for n steps in one
`draw_concat`, but each lane still costs Python per document (a `DocRef`, its
sample ID, a slice of the shard's offsets, the bookkeeping) and per lane (a
machine, the state walk), and the rows are then copied into a block per step.
Where one source is live and its candidate documents lie in memory-mapped
token shards, all of that is arithmetic over a few hundred integers, so it is
done here once for every lane and step of the call (the per-call cost of a
numpy operation, ~1 us, is then shared by 8-32 lane-steps instead of paid per
lane):

1. Candidates: each lane's next positions of the live source (`lane_samples`,
   one slice each), located (object, record) in one `searchsorted`, their
   lengths read from the shards' offsets once per object touched.
2. Entries, lane-major: per lane a residual slot (the packer's residual, or an
   empty one) then its candidates; spans (framed tokens each contributes) and
   their cumulative ends over all lanes in one `cumsum`.
3. One `searchsorted` of every lane's step boundaries ``(j + 1) * T`` gives,
   per lane and step, the entry that reaches the boundary: what the lane drew
   by then (the documents that start before it), the realized counts (prefix
   sums), and the residual (the entry straddling it).
4. Tokens: one gather of the used documents' framed ranges, lane after lane,
   then one strided copy into the step-major block ``(n, 3, P*k, L)``; labels
   and positions are computed on the block itself (targets shifted, -100 at
   document ends, positions restarting at every piece).

Worked example (one lane, T = 4, n = 2; residual B@3 of B = 5, then C = 2, D = 4)::

    entries  B[3:5]  C  D        spans 2 2 4, ends 2 4 8
    step 0: boundary 4 -> entry C (end 4 = boundary): drew C, no residual
    step 1: boundary 8 -> entry D: drew D, no residual

The result is what `Plan.step` gives step by step (tests/test_logical_fused.py
and tests/test_logical_multistep.py hold it to `Plan.step` and the producer's
entries to `produce_step`). Where the draws are not whole documents of one
live source (several live sources: mixture picks; piece draws; lanes whose
live sources differ) `fused_steps` hands the call to `fusedmix.mixed_steps`,
which walks each lane's draws on integers and builds the rows the same way.
Where neither can take the call it returns the reason (one of `REASONS`), the
caller uses the per-lane path, and the producer counts the reasons
(`sluice_fast_path_fallbacks_total`)::

    mixture    the walked draws stood aside: a `stop`/`fail` source ending in
               the call, every source exhausted, a `repeat` share that draws no
               token, an object not mapped, a record past its shard, a residual
               or open offset outside its document (`fusedmix.mixed_steps`)
    packed     the walked draws of a best-fit or per-source-packers plan stood
               aside (`fusedpack.packed_steps`: as `mixture`, and a packer that
               ran dry); `reference`: the per-document reference plan
    mapped     an object whose shard is not memory-mapped (not filled yet)
    residual   a residual from another source, or not ending where its document does
    empty_doc  an empty document without separators
    share_end  the end of a lane's share under an exhaustion rule other than
               `repeat` (under `repeat` the candidates go on into the next
               epoch's order, once a call), or a share shorter than a call
    past_end   a record past its shard's end (the per-document read names it)
    short      candidates that did not cover the call, twice (the second try
               with twice as many)
    state      no step or no lane asked for, lanes the state lacks, another
               plan's state
    end        the run's `max_steps` reached (`multistep.fused_for`)

Why over 450 lines: the candidates, the states and the assembly all read one
layout (each lane's residual slot and candidates, their cumulative ends, the
boundary entries `q`); split apart, each part would restate it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.loaderd.logical.columnar import _frame_id, _row_starts, _scratch
from sluice.loaderd.logical.packing import IGNORE, Row
from sluice.loaderd.logical.state import STATE_KIND, STATE_SCHEMA, DataState, LaneState, SourceCursor

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan

_MIN_CANDIDATES = 8

# Why a call was left to the per-lane path (module docstring): short, stable strings, a metric label each.
MIXTURE, MAPPED, RESIDUAL, EMPTY_DOC = "mixture", "mapped", "residual", "empty_doc"
SHARE_END, PAST_END, SHORT, STATE, END = "share_end", "past_end", "short", "state", "end"
PACKED, REFERENCE = "packed", "reference"
REASONS = (MIXTURE, PACKED, REFERENCE, MAPPED, RESIDUAL, EMPTY_DOC, SHARE_END, PAST_END, SHORT, STATE, END)


def _mixed(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> FusedSteps | str:
    """`fusedmix.mixed_steps`, its standing aside (None) told as `MIXTURE`."""
    got = fusedmix.mixed_steps(plan, state, docs, lanes, n, kernel)
    return MIXTURE if got is None else got


_new, _setattr = object.__new__, object.__setattr__


def _lane_state(draws: int, rows: int, sources: tuple[SourceCursor, ...], packers: dict[str, Any]) -> LaneState:
    """`LaneState(draws=.., rows=.., sources=.., packers=..)` with its fields set in one dict instead of four
    guarded frozen setattrs (made for every lane and step; as `SourceCursor.from_columns`)."""
    got = _new(LaneState)
    _setattr(got, "__dict__", {"draws": draws, "rows": rows, "sources": sources, "packers": packers})
    return got


@dataclass
class FusedSteps:
    """Steps ``first .. first + n - 1`` of `lanes`, computed at once.

    `block[j]` is step j's ``(3, P*k, L)`` rows (tokens, labels, positions),
    lanes in the order given; `state_dicts[j]` the data state after step j as
    ``state_dict()`` writes it (what every step's entry carries), and
    `state(j)` / `states` the `DataState`s, made on demand (a producer needs
    only the call's last one: making every step's cost ~6 us a step).
    `keys` are the piece starts of all steps (step-major flat positions of the
    block's token plane, sorted), `owners` the entry each piece belongs to;
    `sids` / `starts` / `offs` give an entry's sample ID, its position in its
    lane's stream and its framed offset there. `compiled`: the compiled
    kernel made it (the producer's path label ``fused-kernel``; else
    ``fused-numpy``).
    """

    first: int
    lanes: list[int]
    k: int
    L: int
    block: np.ndarray
    state_dicts: list[dict[str, Any]]
    keys: np.ndarray
    owners: list[int]
    sids: list[str | None]
    # `rows` only (the producer never reads them: arrays, made lists there)
    entry_start: np.ndarray  # per entry: where it starts in the lane-major flat stream
    entry_off: np.ndarray  # per entry: its framed offset in its document
    bound_global: np.ndarray  # per piece (in key order): its lane-major flat position
    compiled: bool = False  # computed by the compiled kernel (`jit.Kernel.sections`); False: numpy
    # best-fit / per-source packers (`fusedpack`): every step's rows, step-major (keys, owners, .. then unused)
    packed: list[Row] | None = None
    _made: dict[int, DataState] = field(default_factory=dict)
    _cu: np.ndarray | None = None  # every step's whole cu_seqlens, one after another (`micro`)
    _bounds: list[int] = field(default_factory=list)  # where each step's pieces start in `keys`

    def state(self, j: int) -> DataState:
        """The data state after step j (``first + j``): `state_dicts[j]` as a `DataState` (memoized)."""
        got = self._made.get(j)
        if got is None:
            d = self.state_dicts[j]
            lanes = d["lanes"]
            per = {}
            for lane in self.lanes:
                o = lanes[str(lane)]
                per[lane] = _lane_state(o["draws"], o["rows"], tuple(map(SourceCursor.from_columns, o["sources"])),
                                        o["packers"])
            got = self._made[j] = DataState(d["dataset_id"], d["runspec_digest"], d["step"], per)
        return got

    @property
    def states(self) -> list[DataState]:
        """The data state after each step of the call."""
        return [self.state(j) for j in range(len(self.state_dicts))]

    def _step_range(self, j: int) -> tuple[int, int]:
        PT = len(self.lanes) * self.k * self.L
        lo, hi = self.keys.searchsorted([j * PT, (j + 1) * PT])
        return int(lo), int(hi)

    def micro(self, j: int, r0: int, r1: int) -> tuple[np.ndarray, list[str]]:
        """Step j's rows [r0, r1) as a micro-batch: (cu_seqlens int32, sample IDs in order of first appearance)."""
        L, PT = self.L, len(self.lanes) * self.k * self.L
        if self.packed is not None:
            made = self.packed[j * PT // L + r0:j * PT // L + r1]
            cu = np.zeros(sum(len(r.seqlens) for r in made) + 1, dtype=np.int32)
            np.cumsum([n for r in made for n in r.seqlens], out=cu[1:])
            return cu, list(dict.fromkeys(sid for r in made for sid, _, _ in r.segments))
        base = j * PT
        if r0 == 0 and r1 * L == PT:  # the whole step (one micro-batch a step): a view of every step's at once
            if self._cu is None:
                self._cu_all(PT)
            lo, hi = self._bounds[j], self._bounds[j + 1]
            cu = self._cu[lo + j:hi + j + 1]
        else:
            lo, hi = self.keys.searchsorted([base + r0 * L, base + r1 * L]).tolist()
            cu = np.empty(hi - lo + 1, dtype=np.int32)
            np.subtract(self.keys[lo:hi], base + r0 * L, out=cu[:-1], casting="unsafe")
            cu[-1] = (r1 - r0) * L
        sids = self.sids
        return cu, list(dict.fromkeys([sids[o] for o in self.owners[lo:hi]]))

    def _cu_all(self, PT: int) -> None:
        """Every step's cu_seqlens of its whole rows in one int32 array (step j's: its piece starts less
        ``j * PT``, then PT), and where each step's pieces start in `keys` (`_bounds`)."""
        n = len(self.state_dicts)
        keys = self.keys
        bounds = self._bounds = keys.searchsorted(np.arange(0, (n + 1) * PT, PT, dtype=np.int64)).tolist()
        cu = self._cu = np.empty(len(keys) + n, dtype=np.int32)
        for j in range(n):
            lo, hi = bounds[j], bounds[j + 1]
            np.subtract(keys[lo:hi], j * PT, out=cu[lo + j:hi + j], casting="unsafe")
            cu[hi + j] = PT

    def rows(self, j: int) -> dict[int, list[Row]]:
        """Step j's rows per lane, as `Plan.step` makes them (arrays view the block; provenance per piece)."""
        L, k, PT = self.L, self.k, len(self.lanes) * self.k * self.L
        if self.packed is not None:
            R = len(self.lanes) * k
            return {lane: self.packed[j * R + i * k:j * R + (i + 1) * k] for i, lane in enumerate(self.lanes)}
        lo, hi = self._step_range(j)
        keys = (self.keys[lo:hi] - j * PT).tolist()
        owners, glob = self.owners[lo:hi], self.bound_global[lo:hi].tolist()
        entry_start, entry_off = self.entry_start.tolist(), self.entry_off.tolist()
        block = self.block[j]
        out: dict[int, list[Row]] = {}
        p = 0
        for i, lane in enumerate(self.lanes):
            rows = []
            for r in range(k):
                row = i * k + r
                row_end = (row + 1) * L
                q = p
                while q < len(keys) and keys[q] < row_end:
                    q += 1
                widths, segs = [], []
                for b in range(p, q):
                    w = (keys[b + 1] if b + 1 < q else row_end) - keys[b]
                    u = owners[b]
                    fs = glob[b] - entry_start[u] + entry_off[u]
                    widths.append(w)
                    segs.append((self.sids[u], fs, fs + w))
                rows.append(Row(block[0, row], block[1, row], block[2, row], tuple(widths), tuple(segs)))
                p = q
            out[lane] = rows
        return out


def fused_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
                kernel: Any = None) -> FusedSteps | str:
    """Steps ``state.step + 1 .. state.step + n`` of `lanes` at once, or why this path stands aside (one of
    `REASONS`; a plain string, so ``isinstance(got, str)`` tells the two apart).

    `kernel` (a loaded `jit.Kernel`, or None) computes sections 2-4 in compiled
    code where it covers the call; the result is the same, byte for byte.

    The caller has checked the state's identity, the lanes and `max_steps`
    (`multistep.plan_steps`). Counts the documents it hands out with
    `docs.count` (the residual included), as the per-lane path's calls do.
    Never raises for data problems: it returns a reason, and the per-lane
    path then meets them exactly where `Plan.step` does.
    """
    if n < 1 or not lanes:
        return STATE
    if plan.reference:
        return REFERENCE
    if not hasattr(docs, "mapped"):
        return MAPPED
    lanes = list(lanes)
    if not plan.columnar:  # best-fit, per-source packers: the packers driven by the walked draws (fusedpack)
        got = fusedpack.packed_steps(plan, state, docs, lanes, n)
        return PACKED if got is None else got
    states = [state.lanes[lane] for lane in lanes]
    weights = plan.weights
    live = [i for i, (w, c) in enumerate(zip(weights, states[0].sources)) if w and c.active]
    if len(live) != 1 or plan.piece_tokens is not None:  # draws that depend on what was drawn: walked (fusedmix)
        return _mixed(plan, state, docs, lanes, n, kernel)
    s = live[0]
    if len(weights) == 1:  # one source (the usual pre-tokenized run): the checks below, shortened
        for ls in states:
            c = ls.sources[0]
            if not c.active or c.open or (ls.packers and set(ls.packers) != {"*"}):
                return _mixed(plan, state, docs, lanes, n, kernel)
    else:
        for ls in states:
            if any(w and c.active for i, (w, c) in enumerate(zip(weights, ls.sources)) if i != s) or \
                    not ls.sources[s].active or any(c.open for c in ls.sources) or \
                    (ls.packers and set(ls.packers) != {"*"}):
                return _mixed(plan, state, docs, lanes, n, kernel)
    # Candidates per lane: the call's tokens over the mean framed length, with a margin (1.25 fell short in
    # about one call of ten on the bench corpus, and a retry costs most of a call; a spare candidate ~0.1 us).
    got = _compute(plan, state, docs, lanes, states, s, n, 1.6, kernel)
    if got is _SHORT:
        got = _compute(plan, state, docs, lanes, states, s, n, 3.2, kernel)
    return SHORT if got is _SHORT else got


_SHORT = object()  # `_compute`: the candidates did not cover the call, and more of them would


def _compute(plan: Plan, state: DataState, docs: Any, lanes: list[int], lstates: list[LaneState], s: int, n: int,
             margin: float, kernel: Any = None) -> FusedSteps | str | object:
    k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
    T = k * L
    NT = n * T
    P = len(lanes)
    framing = plan.framing
    lead, trail = framing.bos is not None, framing.eos is not None
    frame = int(lead) + int(trail)
    mean = max(plan.mean_framed_len, 1.0)
    # -- 1. candidates ------------------------------------------------------------------------------
    res = []  # per lane: (epoch, index, off, end) of the residual, or None
    counts = []
    idx_parts = []
    chunk_len = plan.LANE_CHUNK
    capped = []  # per lane: its candidates stop at its share's end (more would not help)
    wraps: list[int | None] = []  # per lane: its candidates of the cursor's epoch, where the rest are the next's
    repeat = plan.manifest.sources[s].exhaustion == "repeat"
    for lane, ls in zip(lanes, lstates):
        cur = ls.packers.get("*", {}).get("cur") if ls.packers else None
        rl = 0
        if cur is not None:
            rs, re_, ridx, roff, rend = cur
            if rs != s or not 0 <= roff < rend:
                return RESIDUAL
            res.append((re_, ridx, roff, rend))
            rl = rend - roff
        else:
            res.append(None)
        c = ls.sources[s]
        share = plan.lane_shares(lane)[s]
        room = share - c.taken
        want = max(_MIN_CANDIDATES, int((NT - rl) * margin / mean) + 2) if rl < NT else 0
        if room < want and repeat and 0 < want - room <= share:
            # the share's end inside the call under `repeat`: the candidates go on with the next epoch's order
            # (its first `want - room` positions); `_states` moves the cursor to that epoch at the step that
            # draws past `room`. (Two wraps in one call, a share shorter than a call: the per-lane path.)
            wraps.append(max(room, 0))
            counts.append(want)
            capped.append(False)
            if room > 0:
                idx_parts.append(plan.lane_samples(s, c.epoch, lane, c.taken, share))
            idx_parts.append(plan.lane_samples(s, c.epoch + 1, lane, 0, want - max(room, 0)))
            continue
        if room <= 0:
            return SHARE_END  # the share's end: the exhaustion rule applies (per-lane path)
        m = min(room, want)
        wraps.append(None)
        capped.append(m < want)
        counts.append(m)
        if m:
            lo, hi = c.taken, c.taken + m
            chunk = lo // chunk_len
            if hi <= (chunk + 1) * chunk_len:  # one memoized chunk of the lane's order (most calls)
                base = chunk * chunk_len
                idx_parts.append(plan._lane_chunk(s, c.epoch, lane, chunk)[lo - base:hi - base])
            else:
                idx_parts.append(plan.lane_samples(s, c.epoch, lane, lo, hi))
    M = sum(counts)
    res_idx = [r[1] for r in res if r is not None]
    if any(not 0 <= x < plan.source_records[s] for x in res_idx):
        return RESIDUAL  # a residual outside the source: Plan.step names it
    if res_idx:
        idx_parts.append(np.asarray(res_idx, dtype=np.int64))
    if not idx_parts:
        all_idx = np.zeros(0, dtype=np.int64)
    else:
        all_idx = np.concatenate(idx_parts) if len(idx_parts) > 1 else idx_parts[0]
    idx = all_idx[:M]
    starts_np, ids_np = plan._starts_np[s]
    kk = starts_np.searchsorted(all_idx, side="right") - 1
    objs = ids_np[kk]
    recs = all_idx - starts_np[kk]
    uniq = sorted(set(objs.tolist()))
    mapped = docs.mapped(s, uniq)
    if mapped is None:
        return MAPPED
    got = NotImplemented if kernel is None else kernel.locate(mapped, uniq, objs, recs)
    if got is None:
        return PAST_END  # past a shard's end: the per-document read names it
    if got is not NotImplemented:
        tstart, ntok = got
    elif len(uniq) == 1:
        offsets, _, records = mapped[uniq[0]]
        if len(recs) and int(recs.max()) >= records:
            return PAST_END  # past the shard's end: the per-document read names it
        tstart = offsets[recs].astype(np.int64)
        ntok = offsets[recs + 1].astype(np.int64) - tstart
    else:  # grouped by object (a stable sort): two fancy indexes per object, then back in candidate order
        perm = objs.argsort(kind="stable")
        by_obj, by_rec = objs[perm], recs[perm]
        limit = np.zeros(uniq[-1] + 1, dtype=np.int64)
        limit[uniq] = [mapped[o][2] for o in uniq]
        if (by_rec >= limit[by_obj]).any():
            return PAST_END
        cut = by_obj.searchsorted(uniq + [uniq[-1] + 1]).tolist()
        a_parts, b_parts = [], []
        for o, lo, hi in zip(uniq, cut, cut[1:]):
            r = by_rec[lo:hi]
            a_parts.append(mapped[o][0][r])
            b_parts.append(mapped[o][0][r + 1])
        tstart = np.empty(len(all_idx), dtype=np.int64)
        ntok = np.empty(len(all_idx), dtype=np.int64)
        a = np.concatenate(a_parts).astype(np.int64)
        tstart[perm] = a
        ntok[perm] = np.concatenate(b_parts).astype(np.int64) - a
    flen = ntok + frame  # framed lengths: candidates, then the residuals
    if kernel is not None:
        got = kernel.sections(plan, state, docs, lanes, lstates, s, n, res, counts, capped, wraps, all_idx, objs,
                              recs, tstart, ntok, mapped, uniq)
        if got is not NotImplemented:
            return got
    if frame == 0 and M and not ntok[:M].all():
        return EMPTY_DOC  # an empty document without separators (counted, no piece): the per-lane path
    # -- 2. entries, lane-major: a residual slot, then the lane's candidates ---------------------------
    E = P + M
    slot = np.zeros(P, dtype=np.int64)  # entry index of each lane's residual slot
    if P > 1:
        np.cumsum(np.asarray(counts[:-1], dtype=np.int64) + 1, out=slot[1:])
    is_slot = np.zeros(E, dtype=bool)
    is_slot[slot] = True
    span = np.zeros(E, dtype=np.int64)
    fend = np.zeros(E, dtype=np.int64)  # framed end of each entry in its document
    span[~is_slot] = flen[:M]
    fend[~is_slot] = flen[:M]
    has_res = [r is not None for r in res]
    r_slots = slot[has_res] if any(has_res) else None
    rflen = flen[M:]
    if r_slots is not None:
        roffs = np.asarray([r[2] for r in res if r is not None], dtype=np.int64)
        rends = np.asarray([r[3] for r in res if r is not None], dtype=np.int64)
        if not np.array_equal(rends, rflen):
            return RESIDUAL  # a residual that does not end where its document does (piece draws): per lane
        span[r_slots] = rends - roffs
        fend[r_slots] = rends
    ends = span.cumsum()
    lane_start = ends[slot] - span[slot]
    # -- 3. every lane's step boundaries in one search --------------------------------------------------
    tgt = (lane_start[:, None] + np.arange(T, NT + 1, T, dtype=np.int64)[None, :]).ravel()  # (P, n)
    q = ends.searchsorted(tgt, side="left")
    last = slot + np.asarray(counts, dtype=np.int64)  # each lane's last entry
    short = q.reshape(P, n)[:, -1] > last
    if short.any():  # the candidates do not cover the call: more of them might, unless a share ends first
        return SHARE_END if any(c for c, sh in zip(capped, short.tolist()) if sh) else _SHORT
    # realized counts: documents (entries after the slot), framed tokens, loss tokens; prefix sums
    lens_z = np.where(is_slot, 0, span)
    cum_tok = lens_z.cumsum()
    loss = lens_z - 1
    if framing.masks_eos_target:
        loss -= lens_z >= 2
    loss[is_slot] = 0
    cum_loss = loss.cumsum()
    slot_rep = slot.repeat(n)
    new_docs = (q - slot_rep).tolist()
    new_tok = (cum_tok[q] - cum_tok[slot_rep]).tolist()
    new_loss = (cum_loss[q] - cum_loss[slot_rep]).tolist()
    straddle = ends[q] > tgt
    r_off = (fend[q] - (ends[q] - tgt)).tolist()
    straddle_l = straddle.tolist()
    q_l = q.tolist()
    # the residual pointers: the candidate's index in its source (-1: the lane's own residual)
    idx_l = idx.tolist()
    slot_l = slot.tolist()
    cur_idx = [-1 if q_l[t] == slot_l[t // n] else idx_l[q_l[t] - t // n - 1] for t in range(P * n)]
    per_obj = _states(lanes, lstates, s, n, k, res, new_docs, new_tok, new_loss, straddle_l, r_off,
                      fend[q].tolist(), cur_idx, wraps)
    # -- 4. tokens, labels, positions -----------------------------------------------------------------
    used_last = q.reshape(P, n)[:, -1]
    tok_l = tstart.tolist()
    ntok_l = ntok.tolist()
    objs_l = objs.tolist()
    toks = {o: mapped[o][1] for o in uniq}
    dtype = toks[uniq[0]].dtype
    bos, eos = _frame_id(framing.bos, dtype), _frame_id(framing.eos, dtype)
    parts: list[np.ndarray] = []
    nexts: list[int] = []
    ends_l = ends.tolist()
    tgt_last = tgt.reshape(P, n)[:, -1].tolist()
    used_last_l = used_last.tolist()
    cand_base = 0
    res_seen = 0
    for i in range(P):
        sl, ul = slot_l[i], used_last_l[i]
        # the residual slot
        if res[i] is not None:
            e_i = M + res_seen
            res_seen += 1
            o, a0, nt = objs_l[e_i], tok_l[e_i], ntok_l[e_i]
            _, _, roff, rend = res[i]
            cut = rend - (ends_l[sl] - tgt_last[i]) if ul == sl else rend
            nxt = _framed_piece(parts, toks[o], a0, nt, roff, cut, lead, trail, bos, eos)
            if ul == sl:
                nexts.append(nxt)
                cand_base += counts[i]
                continue
        # whole candidates between the slot and the last used entry, then the last one cut at the call's end
        first_c = cand_base
        last_c = cand_base + (ul - sl - 1)  # candidate index of the last used entry
        if not lead and trail:  # the common framing, ids + eos: two parts a document
            mids = [toks[o][a:a + m] for o, a, m in zip(objs_l[first_c:last_c], tok_l[first_c:last_c],
                                                        ntok_l[first_c:last_c])]
            pairs = [eos] * (2 * len(mids))
            pairs[0::2] = mids
            parts += pairs
        else:
            for e in range(first_c, last_c):
                _framed_piece(parts, toks[objs_l[e]], tok_l[e], ntok_l[e], 0, ntok_l[e] + frame, lead, trail, bos, eos)
        fl = ntok_l[last_c] + frame
        cut = fl - (ends_l[ul] - tgt_last[i])
        nexts.append(_framed_piece(parts, toks[objs_l[last_c]], tok_l[last_c], ntok_l[last_c], 0, cut, lead, trail,
                                   bos, eos))
        cand_base += counts[i]
    block = _block_of(parts, nexts, n, P, k, L,
                      dtype if all(t.dtype == dtype for t in toks.values()) and bos.dtype == eos.dtype == dtype
                      else None)
    # Every used entry (not an empty slot) that ends inside the call: its last token has no target.
    lane_of = np.arange(P, dtype=np.int64).repeat(np.asarray(counts, dtype=np.int64) + 1)
    e_start = ends - span - lane_start[lane_of]  # entry start in its lane's stream
    e_end = e_start + span
    used = (np.arange(E, dtype=np.int64) <= used_last[lane_of]) & (span > 0)
    flat = block.reshape(-1)
    PT3 = 3 * P * T
    doc_end = used & (e_end <= NT)
    p = e_end[doc_end] - 1
    li = lane_of[doc_end]
    flat[(p // T) * PT3 + P * T + li * T + p % T] = IGNORE
    if framing.masks_eos_target:
        fl_all = np.empty(E, dtype=np.int64)
        fl_all[~is_slot] = flen[:M]
        if r_slots is not None:
            fl_all[r_slots] = rflen
        fl_all[is_slot & (span == 0)] = 0
        at = e_end - (fend - fl_all) - 2  # the position of the token before the eos (the doc's framed len - 2)
        m_eos = used & (fl_all >= 2) & (at >= e_start) & (at < NT)
        p = at[m_eos]
        li = lane_of[m_eos]
        flat[(p // T) * PT3 + P * T + li * T + p % T] = IGNORE
    # Piece starts: every row start and every used document start inside a row.
    dstart = used & ~is_slot & (e_start < NT) & (e_start % L != 0)
    d = e_start[dstart]
    li = lane_of[dstart]
    dk = (d // T) * (P * T) + li * T + d % T  # step-major keys of the document starts
    rk = _row_starts(n * P * T, L)
    keys = np.concatenate([rk, dk])
    order = keys.argsort(kind="stable")
    keys = keys[order]
    # positions: a token's offset from its piece's start (every piece start is a key; none lies on another)
    widths = np.empty_like(keys)
    np.subtract(keys[1:], keys[:-1], out=widths[:-1])
    widths[-1] = n * P * T - keys[-1]
    np.subtract(_arange(n * P * T).reshape(n, P * k, L), keys.astype(np.int32).repeat(widths).reshape(n, P * k, L),
                out=block[:, 2])
    # lane-major flat positions of the pieces: row starts (step j, lane i, row r) and document starts
    rj, rem = np.divmod(rk, P * T)
    ri = rem // T
    r_glob = lane_start[ri] + rj * T + rem % T
    glob = np.concatenate([r_glob, lane_start[li] + d])[order]
    owners = ends.searchsorted(glob, side="right")
    cand_of = np.full(E, -1, dtype=np.int64)  # entry -> its position in the located arrays
    cand_of[~is_slot] = np.arange(M, dtype=np.int64)
    if r_slots is not None:
        cand_of[r_slots] = np.arange(M, M + len(rflen), dtype=np.int64)
    entry_off = np.zeros(E, dtype=np.int64)
    if r_slots is not None:
        entry_off[r_slots] = roffs
    drawn = (used_last - slot).tolist()
    return _result(plan, state, docs, s, lanes, n, k, L, block, keys, owners.tolist(), cand_of[owners].tolist(),
                   objs, recs, E, per_obj, lane_start[lane_of] + e_start, entry_off, glob, sum(drawn) + len(res_idx),
                   sum(drawn), int(cum_tok[used_last].sum() - cum_tok[slot].sum()))


def _states(lanes: list[int], lstates: list[LaneState], s: int, n: int, k: int, res: list[Any], new_docs: list[int],
            new_tok: list[int], new_loss: list[int], straddle: list[Any], r_off: list[int], fend_q: list[int],
            cur_idx: list[int], wraps: list[int | None]) -> list[dict[str, Any]]:
    """The lanes' states after each step as `state_dict` writes them (per step: lane key -> its JSON form), from
    the realized counts per lane and step (``t = lane index * n + j``): documents, framed and loss tokens drawn
    since the call's start; where the step ends inside a document, its residual offset, its document's framed
    end and the document's index in its source (-1: the lane's residual of the call's start, `res`).
    `wraps[i]`: lane i's candidates left in its cursor's epoch where the rest are the next epoch's (None: all
    of one epoch). Only JSON forms: `FusedSteps.state` makes a `DataState` of one when it is asked for."""
    per_obj: list[dict[str, Any]] = [{} for _ in range(n)]
    for i, (lane, ls) in enumerate(zip(lanes, lstates)):
        others = ls.sources
        key = str(lane)
        epoch, taken, active, ndocs, ntoks, nloss, nrows, nopen = others[s].to_list()
        wrap = wraps[i]
        single = len(others) == 1
        if not single:
            other_cols = [c.to_list() for c in others]
        draws0, rows0 = ls.draws, ls.rows
        for j in range(n):
            t = i * n + j
            d = new_docs[t]
            if wrap is None or d <= wrap:
                cols = [epoch, taken + d, active, ndocs + d, ntoks + new_tok[t], nloss + new_loss[t], nrows, nopen]
            else:  # past the share's end: the next epoch's (d - wrap) documents
                cols = [epoch + 1, d - wrap, active, ndocs + d, ntoks + new_tok[t], nloss + new_loss[t], nrows,
                        nopen]
            if straddle[t]:
                ci = cur_idx[t]
                if ci < 0:
                    r = res[i]
                    cur = [s, r[0], r[1], r_off[t], fend_q[t]]
                else:  # the step's d-th candidate: of the next epoch past the wrap
                    cur = [s, epoch if wrap is None or d <= wrap else epoch + 1, ci, r_off[t], fend_q[t]]
            else:
                cur = None
            if single:
                per_obj[j][key] = {"draws": draws0 + d, "rows": rows0 + (j + 1) * k, "sources": [cols],
                                   "packers": {"*": {"cur": cur}}}
            else:
                per_obj[j][key] = {"draws": draws0 + d, "rows": rows0 + (j + 1) * k,
                                   "sources": [*other_cols[:s], cols, *other_cols[s + 1:]],
                                   "packers": {"*": {"cur": cur}}}
    return per_obj


def _result(plan: Plan, state: DataState, docs: Any, s: int, lanes: list[int], n: int, k: int, L: int,
            block: np.ndarray, keys: np.ndarray, own_l: list[int], own_loc: list[int], objs: np.ndarray,
            recs: np.ndarray, E: int, per_obj: list[dict[str, Any]],
            entry_start: np.ndarray, entry_off: np.ndarray, glob: np.ndarray, n_used: int, drawn: int,
            drawn_tokens: int) -> FusedSteps:
    """The call's `FusedSteps`; counts the documents handed out (`n_used`) and updates the plan's mean framed
    length with the `drawn` candidates' `drawn_tokens`. `own_loc[b]`: the located index (in `objs` / `recs`)
    of piece b's owner entry `own_l[b]`."""
    sids: list[str | None] = [None] * E
    keys_s = plan.sample_keys[s]
    objs_l, recs_l = objs.tolist(), recs.tolist()
    for u, a in dict(zip(own_l, own_loc)).items():  # (an owner's located index is the same for all its pieces)
        sids[u] = f"{keys_s[objs_l[a]]}:{recs_l[a]}"
    if n_used:
        docs.count(s, n_used)
    if drawn:
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * (float(drawn_tokens) / drawn)
    step0 = state.step + 1
    if lanes != sorted(lanes):  # (state_dict's order: the lanes sorted)
        per_obj = [{str(lane): per[str(lane)] for lane in sorted(lanes)} for per in per_obj]
    dicts = [{"kind": STATE_KIND, "schema": STATE_SCHEMA, "dataset_id": plan.dataset_id,
              "runspec_digest": plan.runspec_digest, "step": step0 + j, "lanes": per_obj[j]} for j in range(n)]
    return FusedSteps(first=step0, lanes=lanes, k=k, L=L, block=block, state_dicts=dicts,
                      keys=keys, owners=own_l, sids=sids, entry_start=entry_start, entry_off=entry_off,
                      bound_global=glob)


def _block_of(parts: list[np.ndarray], nexts: list[int], n: int, P: int, k: int, L: int,
              dtype: np.dtype | None) -> np.ndarray:
    """The step-major block ``(n, 3, P*k, L)`` of the lanes' streams gathered from `parts` (lane-major, each
    lane's n*T tokens): the token plane, and the label plane as the tokens shifted by one (across steps; each
    lane's last target `nexts`), before any mask. Positions are the caller's."""
    T = k * L
    block = np.empty((n, 3, P * k, L), dtype=np.int32)
    # The gather, lane-major, in the documents' own dtype where every part has it (`dtype`: a plain copy per part;
    # a cast per part costs ~30 ns more each, measured), converted to int32 by the copy into the step-major block.
    if dtype is not None:
        g = _scratch_of(P * n * T, dtype)
        np.concatenate(parts, out=g)
    else:
        g = _scratch(P * n * T)
        np.concatenate(parts, out=g, casting="unsafe")
    tok3 = block[:, 0].reshape(n, P, T)
    tok3[...] = g.reshape(P, n, T).transpose(1, 0, 2)
    lab3 = block[:, 1].reshape(n, P, T)
    lab3[:, :, :-1] = tok3[:, :, 1:]
    if n > 1:
        lab3[:-1, :, -1] = tok3[1:, :, 0]
    lab3[-1, :, -1] = nexts
    return block


_ARANGE: dict[int, np.ndarray] = {}
_GATHER = threading.local()


def _scratch_of(n: int, dtype: np.dtype) -> np.ndarray:
    """A buffer of n entries of `dtype`, owned by the calling thread (grown on demand, reused)."""
    got = getattr(_GATHER, "buf", None)
    if got is None or got.nbytes < n * dtype.itemsize:
        got = _GATHER.buf = np.empty(max(n * dtype.itemsize, 1 << 17), dtype=np.uint8)
    return got[:n * dtype.itemsize].view(dtype)


def _arange(n: int) -> np.ndarray:
    """0 .. n-1 as int32 (memoized, bounded; never written)."""
    got = _ARANGE.get(n)
    if got is None:
        if len(_ARANGE) > 16:
            _ARANGE.clear()
        got = _ARANGE[n] = np.arange(n, dtype=np.int32)
    return got


def _framed_piece(parts: list[np.ndarray], tokens: np.ndarray, a0: int, nt: int, off: int, end: int, lead: bool,
                  trail: bool, bos: np.ndarray, eos: np.ndarray) -> int:
    """Append framed range [off, end) of the document ``tokens[a0:a0 + nt]`` (framed: [bos] ids [eos]) to
    `parts`; return the framed token at `end` (0 at the document's end): the target after the range."""
    if lead and off == 0 and end > 0:
        parts.append(bos)
    a, b = max(off - lead, 0), min(end - lead, nt)
    if b > a:
        parts.append(tokens[a0 + a:a0 + b])
    flen = nt + lead + trail
    if trail and end == flen:
        parts.append(eos)
    if end >= flen:
        return 0
    if lead and end == 0:
        return int(bos[0])
    if trail and end == flen - 1:
        return int(eos[0])
    return int(tokens[a0 + end - lead])


# (at the end: fusedmix builds on this module's helpers)
from sluice.loaderd.logical import fusedmix, fusedpack  # noqa: E402
