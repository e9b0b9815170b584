"""Columnar concat packing: a lane's whole step from arrays, equal to the reference byte for byte.

The reference (`plan.LaneMachine` + `packing.ConcatPacker` + `materialize`)
decides rows piece by piece and frames every document into a fresh array. For
concat this work is arithmetic over one flat stream, so a lane computes its
``k`` rows of a step at once:

1. Draw documents (mixture pick, order position, `docs` call) until the lane's
   residual plus the drawn framed lengths cover ``T = k * seq_len`` tokens:
   exactly the documents the reference pulls (it pulls while a row is short).
2. One gather: ``np.concatenate`` of the framed documents' token ranges (the
   residual from its offset, the last document cut at T; bos/eos inserted as
   constants, never a per document copy) straight into the rows: the stream F
   is ``F[:T]`` reshaped. One gather and one set of array operations serve
   every lane of the step (lane i at ``[i*T, (i+1)*T)`` of one block).
3. Labels are F shifted by one, with -100 at every document's last token (and
   on the eos target with ``exclude_separator``). Pieces start at every
   document start and every row start; position ids are ``j - piece start``.
4. The residual is the document straddling T, as one pointer.

Worked example (seq_len 4, k 2, residual B@3 of B=5, then C=2, D=4; framed)::

    F:      B3 B4 | C0 C1 | D0 D1 D2 D3       doc starts 0 2 4, row starts 0 4
    rows:   B3 B4 C0 C1 / D0 D1 D2 D3         pieces (B,3,5) (C,0,2) / (D,0,4)
    labels: B4 -  C1 -  / D1 D2 D3 -          residual: none (D ends at T)

Best-fit (a bounded window of open bins) and per-source packers (unit
"sequences") keep the reference path; `Plan` chooses per configuration.
The property test `tests/test_logical_columnar.py` holds this module to the
reference: identical rows and states for every algorithm, unit, policy and
resume point.

Why over 450 lines: the draws and the assembly share `LaneDocs` and its
invariants (offsets, cuts, the residual), which neither half keeps alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sluice.datastate import CUR_ACTIVE, CUR_DOCS, CUR_EPOCH, CUR_LOSS_TOKENS, CUR_TAKEN, CUR_TOKENS
from sluice.errors import EndOfStream, InternalError
from sluice.loaderd.logical.mixture import categorical_picks, counted_quota_picks
from sluice.loaderd.logical.packing import IGNORE, Framing, Row
from sluice.loaderd.logical.ref import DocRef

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import LaneMachine


@dataclass
class LaneDocs:
    """The document pieces one lane's step reads, in stream order (step 1's result).

    Entry i is framed range ``[offs[i], ends[i])`` of a document of ``lens[i]``
    framed tokens. Without piece draws only the first entry (the residual) may
    start inside its document and every entry ends where its document does;
    `cut` is set when that does not hold (piece draws).
    """

    refs: list[DocRef] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)  # unframed token ids
    offs: list[int] = field(default_factory=list)  # framed offset where the piece enters the stream
    ends: list[int] = field(default_factory=list)  # framed offset where the piece ends
    lens: list[int] = field(default_factory=list)  # framed length of the document
    total: int = 0  # framed tokens from the first offset to the end of the last piece
    cut: bool = False  # some entry but the first starts, or some entry ends, inside its document


def draw_concat(lane: LaneMachine, k: int) -> LaneDocs:
    """Step 1 for one lane: its residual and the documents drawn to fill `k` rows.

    Advances `lane` (cursors, draws, rows, residual pointer) exactly as the
    reference does for k concat rows. Raises EndOfStream when every source is
    exhausted before the k-th row is full (the reference drops a partial
    final row, so the stream ends here).
    """
    plan = lane.plan
    T = k * plan.manifest.packing.seq_len
    framing = plan.framing
    frame = int(framing.bos is not None) + int(framing.eos is not None)
    packer = lane.packers["*"]
    got = LaneDocs()
    if packer.cur is not None:
        s, e, idx, off, end = packer.cur
        r = plan.ref(s, e, idx)
        ids = lane.docs(r)
        _append(got, r, ids, off, end, len(ids) + frame)
    while got.total < T:  # draw exactly what the reference would pull
        _draw_batch(lane, T, got, frame)
    lane.rows += k
    end_last = got.ends[-1] - (got.total - T)  # framed offset where this step ends in the last piece
    last = got.refs[-1]
    packer.cur = None if end_last == got.ends[-1] else [last.source, last.epoch, last.index, end_last, got.ends[-1]]
    return got


def _append(got: LaneDocs, r: DocRef, ids: np.ndarray, off: int, end: int, length: int) -> None:
    """Add framed range [off, end) of document `r` (`length` framed tokens) to the stream."""
    if end != length or (off and got.refs):  # not a whole document (or the residual's tail, first)
        got.cut = True
    got.refs.append(r)
    got.ids.append(ids)
    got.offs.append(off)
    got.ends.append(end)
    got.lens.append(length)
    got.total += end - off


_BATCH_MIN = 8
_MEMO_MAX = 1 << 12  # runs of QUOTA_RUN picks in `plan.quota_memo` (~2 MiB); cleared at the limit


def _draw_batch(lane: LaneMachine, T: int, got: LaneDocs, frame: int) -> None:
    """Draw documents into `got` until its total reaches T or a batch ends.

    Picks for a batch come from arrays (categorical: the counter RNG vectorized;
    documents quota: memoized chairman picks). Each batch stops before any
    source would run out of its share, so exhaustion rules are applied by the
    reference's one-at-a-time draw (`_draw_one`) exactly where they occur.
    Token units have picks that depend on the lengths just drawn (one at a
    time, unless a single source is left to pick), and piece draws depend on
    the open documents: one at a time.
    """
    plan = lane.plan
    if plan.piece_tokens is not None:
        return _draw_one(lane, got, frame)
    cursors = lane.cursors
    est = max(_BATCH_MIN, int((T - got.total) * 1.25 / max(plan.mean_framed_len, 1.0)) + 2)
    live = [s for s, (w, c) in enumerate(zip(plan.weights, cursors)) if w and c[CUR_ACTIVE]]
    if len(live) == 1:  # every policy and unit picks the one live source: no picks to compute
        return _draw_single(lane, T, got, frame, live[0], est)
    active = [bool(c[CUR_ACTIVE]) for c in cursors]
    if plan.manifest.mixture.policy == "categorical":
        picks_a = categorical_picks(plan.weights, active, lane.rng.key, lane.draws, est)
        picks = None if picks_a is None else picks_a.tolist()
    elif plan.counted:
        memo = plan.quota_memo
        if len(memo) > _MEMO_MAX:
            memo.clear()
        picks = counted_quota_picks(plan.weights, [c[CUR_DOCS] for c in cursors], active, est, memo)
    else:  # token units: a pick depends on the lengths just drawn (one live source is handled above)
        picks = None
    if picks is None or picks[0] < 0:
        return _draw_one(lane, got, frame)
    # the longest prefix in which no source takes past its share
    room = [share - c[CUR_TAKEN] for share, c in zip(lane.shares, cursors)]
    n = 0
    for s in picks:
        if room[s] <= 0:
            break
        room[s] -= 1
        n += 1
    if n == 0:
        return _draw_one(lane, got, frame)
    picks = picks[:n]
    # Per source, its next sample indices resolved to (index, object, record) rows; a DocRef is made only
    # for a document actually drawn (the estimate `est` overshoots by about a third).
    queues = {}
    for s in set(picks):
        c = cursors[s]
        want = picks.count(s)
        epoch, taken = c[CUR_EPOCH], c[CUR_TAKEN]
        queues[s] = (epoch, zip(*plan.locate(s, plan.lane_samples(s, epoch, lane.lane, taken, taken + want))))
    docs = lane.docs
    total = got.total
    batch: list[DocRef] = []
    ids_got: list[np.ndarray] = []
    lens_got: list[int] = []
    keys = plan.sample_keys
    for s in picks:
        epoch, rows = queues[s]
        i, o, rec = next(rows)
        r = DocRef(s, epoch, i, o, rec, f"{keys[s][o]}:{rec}")
        batch.append(r)
        ids = docs(r)
        length = len(ids) + frame
        ids_got.append(ids)
        lens_got.append(length)
        total += length
        if total >= T:
            break
    used = len(lens_got)
    # commit exactly the `used` draws (as LaneMachine._advance + _cut for draws known not to exhaust):
    # a few documents per lane and step, where a plain loop costs less than numpy's per-call overhead
    masks_eos = bool(plan.framing.masks_eos_target)
    for s, length in zip(picks, lens_got):
        c = cursors[s]
        c[CUR_TAKEN] += 1
        c[CUR_DOCS] += 1
        c[CUR_TOKENS] += length
        c[CUR_LOSS_TOKENS] += max(length - 1, 0) - (masks_eos and length >= 2)
    lane.draws += used
    if frame or all(lens_got):
        got.refs.extend(batch[:used])
        got.ids.extend(ids_got)
        got.lens.extend(lens_got)
        got.ends.extend(lens_got)
        got.offs.extend([0] * used)
    else:  # empty documents (no separators) contribute no piece
        for r, ids, length in zip(batch, ids_got, lens_got):
            if length:
                got.refs.append(r)
                got.ids.append(ids)
                got.lens.append(length)
                got.ends.append(length)
                got.offs.append(0)
    plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * ((total - got.total) / used)
    got.total = total


def _draw_single(lane: LaneMachine, T: int, got: LaneDocs, frame: int, s: int, est: int) -> None:
    """`_draw_batch` while source `s` is the only live one (weight > 0, active): every pick of every
    policy and unit is `s`, so the batch is the lane's next `est` positions of `s` (at most its share's
    rest; at the share's end the reference's one-at-a-time draw applies the exhaustion rule)."""
    plan = lane.plan
    c = lane.cursors[s]
    epoch, taken = c[CUR_EPOCH], c[CUR_TAKEN]
    n = min(est, lane.shares[s] - taken)
    if n <= 0:
        return _draw_one(lane, got, frame)
    keys = plan.sample_keys[s]
    docs = lane.docs
    refs, ids_got, lens_got = got.refs, got.ids, got.lens
    total = start = got.total
    used = 0
    new = tuple.__new__  # DocRef(...) without the NamedTuple's Python-level __new__ (~100 ns a document)
    located = plan.locate(s, plan.lane_samples(s, epoch, lane.lane, taken, taken + n))
    # Mapped token shards: one lookup for the candidates' objects, then each used document is a slice of
    # its shard (the candidates `est` overshoots by are never looked at).
    mapped = docs.mapped(s, located[1]) if hasattr(docs, "mapped") else None
    viewed = 0
    for used, (i, o, rec) in enumerate(zip(*located), 1):
        r = new(DocRef, (s, epoch, i, o, rec, f"{keys[o]}:{rec}"))
        if mapped is not None and rec < mapped[o][2]:
            offsets, tokens, _ = mapped[o]
            a, b = offsets[rec:rec + 2].tolist()
            ids = tokens[a:b]
            viewed += 1
        else:
            ids = docs(r)  # not mapped (starts the object, waits), or past the shard's end (raises, naming it)
        length = len(ids) + frame
        if length:  # an empty document (no separators) contributes no piece
            refs.append(r)
            ids_got.append(ids)
            lens_got.append(length)
        total += length
        if total >= T:
            break
    if viewed:
        docs.count(s, viewed)
    appended = len(lens_got) - len(got.ends)
    fresh = lens_got[-appended:] if appended else []
    got.ends.extend(fresh)
    got.offs.extend([0] * appended)
    # loss tokens: max(length - 1, 0) per document, one less for a masked eos target when length >= 2
    # (empty documents add nothing; every other one is in `fresh`)
    loss = total - start - appended
    if plan.framing.masks_eos_target:
        loss -= appended - fresh.count(1)
    c[CUR_TAKEN] += used
    c[CUR_DOCS] += used
    c[CUR_TOKENS] += total - start
    c[CUR_LOSS_TOKENS] += loss
    lane.draws += used
    plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * ((total - start) / used)
    got.total = total


def _draw_one(lane: LaneMachine, got: LaneDocs, frame: int) -> None:
    """One draw exactly as the reference's `_pull_mixed` (exhaustion rules and piece draws included)."""
    plan = lane.plan
    while True:
        s = lane._pick()
        if s < 0:
            raise EndOfStream(f"lane {lane.lane}: every source is exhausted")
        nxt = lane._next_doc(s)
        if nxt is not None:
            break  # else the source became inactive: pick again (the draw is not counted)
    lane.draws += 1
    e, idx, off = nxt
    r = plan.ref(s, e, idx)
    ids = lane.docs(r)
    length = len(ids) + frame
    end = lane._cut(s, idx, off, length)
    if end > off:  # an empty document (no separators) contributes no piece
        _append(got, r, ids, off, end, length)


def _cut_targets(lanes: list[LaneDocs], lab: np.ndarray, end: np.ndarray, limit: np.ndarray, lead: bool,
                 trail: bool, framing: Framing) -> None:
    """A piece cut before its document's end targets the document's next token (as a row boundary does),
    not the next piece's first token: set those labels from the documents (few per step)."""
    ends, limits = end.tolist(), limit.tolist()
    i = 0
    for ld in lanes:
        if ld.cut:
            for j, (e_doc, length) in enumerate(zip(ld.ends, ld.lens)):
                e_flat = ends[i + j]
                if e_doc < length and e_flat <= limits[i + j]:
                    lab[e_flat - 1] = framing.eos if trail and e_doc == length - 1 else ld.ids[j][e_doc - lead]
        i += len(ld.ids)


_ROW_STARTS_CACHE: dict[tuple[int, int], np.ndarray] = {}


def row_starts(T: int, L: int) -> np.ndarray:
    """0, L, 2L, ... < T (memoized, bounded; never written)."""
    got = _ROW_STARTS_CACHE.get((T, L))
    if got is None:
        if len(_ROW_STARTS_CACHE) > 64:
            _ROW_STARTS_CACHE.clear()
        got = _ROW_STARTS_CACHE[(T, L)] = np.arange(0, T, L, dtype=np.int64)
    return got


def assemble_concat(lanes: list[LaneDocs], k: int, L: int, framing: Framing) -> tuple[list[list[Row]], np.ndarray]:
    """Steps 2-3 for every lane of a step at once: one gather, then arithmetic over the step; rows per
    lane, and the block they view.

    Every row of the step is a view into one block ``(3, lanes * k, L)``
    (tokens, labels, positions), the lanes' rows back to back: one allocation,
    the only fresh memory of the step. Each lane's framed documents
    are cut at T = k * L (the residual straddles it) and gathered straight into
    the token rows; the arithmetic then runs once over the whole block (lane
    i's stream occupies ``[i*T, (i+1)*T)``), so its numpy calls do not
    multiply with the lanes; the position steps live in a per-thread scratch
    buffer that is reused (a fresh 64 KiB array costs ~16 page faults, more
    than the arithmetic on it: measured, docs/logical.md).
    """
    T = k * L
    n_lanes = len(lanes)
    R = n_lanes * k
    block = np.empty((3, R, L), dtype=np.int32)
    tok, lab, pos = block[0].reshape(-1), block[1].reshape(-1), block[2].reshape(-1)
    lead = framing.bos is not None
    trail = framing.eos is not None
    dtype = lanes[0].ids[0].dtype
    bos, eos = frame_id(framing.bos, dtype), frame_id(framing.eos, dtype)
    parts: list[np.ndarray] = []
    lens: list[int] = []
    offs: list[int] = []
    ends: list[int] = []
    counts: list[int] = []
    sids: list[str] = []
    nexts: list[int] = []  # per lane: the stream's token after its T-th (the last row's last target)
    shifts: list[int] = []  # per lane: block position minus stream position of its documents
    streamed = 0
    for ld in lanes:
        lane_first = len(parts)
        if not lead and trail and not ld.cut:  # the common framing, ids + eos: only the first document has an offset
            pairs = [eos] * (2 * len(ld.ids))
            pairs[0::2] = ld.ids
            if ld.offs[0]:
                pairs[0] = ld.ids[0][ld.offs[0]:]
            parts += pairs
        else:
            for ids, off, end, length in zip(ld.ids, ld.offs, ld.ends, ld.lens):
                if lead and off == 0:
                    parts.append(bos)
                a, b = max(off - lead, 0), min(end - lead, len(ids))  # the piece's range of the unframed ids
                parts.append(ids[a:b] if a or b < len(ids) else ids)
                if trail and end == length:
                    parts.append(eos)
        # cut the lane's stream at T: the last document straddles it (the residual)
        drop, nxt = ld.total - T, 0
        while drop > 0:
            last = parts[-1]
            if len(last) > drop:
                nxt = int(last[len(last) - drop])
                parts[-1] = last[: len(last) - drop]
                break
            nxt = int(last[0])
            drop -= len(last)
            parts.pop()
            if len(parts) == lane_first:
                raise InternalError(f"columnar concat: lane stream of {ld.total} tokens is shorter than {T}")
        nexts.append(nxt)
        shifts.append(len(counts) * T - streamed)  # lane i's stream starts at i * T in the block
        streamed += ld.total
        lens += ld.lens
        offs += ld.offs
        ends += ld.ends
        counts.append(len(ld.lens))
        sids += [r.sample_id for r in ld.refs]
    # The one gather, straight into the token rows. uint32 documents go in bit for bit (ids < 2**31:
    # MAX_TOKEN_ID), a plain copy per part; other dtypes are converted on the way.
    np.concatenate(parts, out=tok.view(np.uint32) if dtype == np.uint32 else tok, casting="unsafe")
    lab[:-1] = tok[1:]  # targets: the next token; at each lane's end the token after its T-th
    lab[T - 1::T] = nexts
    ln = np.array(lens, dtype=np.int64)
    of = np.array(offs, dtype=np.int64)
    en = np.array(ends, dtype=np.int64)
    span = en - of
    # (ndarray methods, not the np.* functions: those add a Python wrapper call each, on arrays of ~50)
    end = span.cumsum()  # piece ends in one stream of all lanes' pieces...
    end += np.array(shifts, dtype=np.int64).repeat(counts)  # ...then in the block
    start = end - span
    limit = row_starts((n_lanes + 1) * T, T)[1:].repeat(counts)  # the end of each piece's lane
    if any(ld.cut for ld in lanes):
        _cut_targets(lanes, lab, end, limit, lead, trail, framing)
        doc_end = end[(en == ln) & (end <= limit)]
    else:
        doc_end = end[end <= limit]
    lab[doc_end - 1] = IGNORE  # a document's last token has no target
    if framing.masks_eos_target:
        at = start - of + ln - 2  # the token before the eos
        lab[at[(ln >= 2) & (at >= start) & (at < end) & (at < limit)]] = IGNORE
    merged = np.concatenate([start, row_starts(R * L, L)])
    merged.sort()
    keep = np.empty(merged.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    bounds = merged[keep]  # piece starts: document starts and row starts (every lane start is a row start)
    widths = np.empty_like(bounds)  # np.diff(bounds, append=R * L), without its concatenation
    np.subtract(bounds[1:], bounds[:-1], out=widths[:-1])
    widths[-1] = R * L - bounds[-1]
    # positions restart at every piece: ones, minus the previous piece's width at each piece start, summed
    steps = scratch_int32(R * L)
    steps.fill(1)
    steps[0] = 0
    steps[bounds[1:]] = 1 - widths[:-1]
    np.cumsum(steps, out=pos)
    owner = start.searchsorted(bounds, side="right") - 1
    fstart = bounds - start[owner] + of[owner]  # framed offset of each piece in its document
    piece_sid = [sids[o] for o in owner.tolist()]
    wl = widths.tolist()
    fs = fstart.tolist()
    fe = (fstart + widths).tolist()
    cut = bounds.searchsorted(row_starts((R + 1) * L, L)).tolist()  # pieces of row r: cut[r]..cut[r+1]
    segs = list(zip(piece_sid, fs, fe))
    rows = [
        Row(t, b, p, tuple(wl[c0:c1]), tuple(segs[c0:c1]))
        for t, b, p, c0, c1 in zip(block[0], block[1], block[2], cut[:-1], cut[1:])
    ]
    return [rows[i * k:(i + 1) * k] for i in range(n_lanes)], block


_SCRATCH = threading.local()
_FRAME_IDS: dict[tuple[int, str], np.ndarray] = {}


def scratch_int32(n: int) -> np.ndarray:
    """An int32 buffer of exactly n entries, owned by the calling thread (grown on demand, reused)."""
    got = getattr(_SCRATCH, "buf", None)
    if got is None or len(got) < n:
        got = _SCRATCH.buf = np.empty(max(n, 1 << 15), dtype=np.int32)
    return got[:n]


def frame_id(token: int | None, dtype: np.dtype) -> np.ndarray:
    """`token` (0 for None) as a one-element array of the documents' own dtype where it fits.

    A gather of one dtype never converts per part: uint32 documents with an
    int32 separator made numpy go through int64, 3x slower (measured).
    """
    value = 0 if token is None else token
    key = (value, dtype.str)
    got = _FRAME_IDS.get(key)
    if got is None:
        if len(_FRAME_IDS) > 64:
            _FRAME_IDS.clear()
        fits = dtype.kind in "iu" and np.iinfo(dtype).min <= value <= np.iinfo(dtype).max
        got = _FRAME_IDS[key] = np.array([value], dtype=dtype if fits else np.int32)
    return got
