"""The fast path for concat packing in the compiled kernel: every lane and step of a call, draws and rows.

Concat cuts one stream a lane into rows, so what a call needs is each
lane's draws until its stream covers the call. With a loaded `jit.Kernel`,
`mixed_steps` walks them for every lane in one call of `jitdraws.walk`
(as `lanemachine.LaneMachine` draws for concat: pick among
the live sources by quota or categorical weights, open document or next
position, exhaustion, the piece's cut, the realized counts; handing back to
Python only to locate more positions of a source), writing each lane's state
at every step boundary ``(j + 1) * T`` (cursors, draws, rows, the residual
straddling it). `jitrows.assemble` with `gather` and `finish` then build
the rows of every lane and step into the step-major block
``(n, 3, P*k, L)``: frames and document tokens copied, labels shifted (a piece
cut before its document's end targets the document's next token, not the
next piece's), -100 at a document's last token and, with
``exclude_separator``, on the eos target; positions restart at every piece
start and every row start.

A call continuing from the very state the last call of its lanes returned
(a producer's stream) starts from where the kernel left them (`located.Ended`:
cursors, draw counters, residual pieces, kept queues), reading neither the
state's lanes nor checking the queues first: the kernel asks for a refill
where one runs short. What a call derives from the plan and lanes alone is
made once (`call_setup`).

Where its int64 arithmetic or a token dtype does not cover the call it
returns NotImplemented (`Plan.step` makes the step). It stands aside (None;
`Plan.step` meets the case) where the walk does (`shards.Aside`: a source
exhausted under `stop` or `fail`, every
source exhausted, a `repeat` loop that draws no token, an object whose tokens
are being made from text, a record past its shard's end, a residual or open offset that does not fit
its document, a packer state that is not concat's).
(tests/test_logical_jit.py, test_logical_fused.py and test_mixture_pieces.py
hold it to `Plan.step` byte for byte, states included.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.datastate import CUR_EPOCH, CUR_OPEN, CUR_TAKEN, CUR_TOKENS
from sluice.loaderd.logical.fused import FusedSteps, StateTexts
from sluice.loaderd.logical.jit import state_parts
from sluice.loaderd.logical.state import DataState
from sluice.loaderd.logical import located
from sluice.loaderd.logical.located import Kept
from sluice.loaderd.logical.shards import MIN_BATCH, REFILL_MAX, Aside, Shards

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan


def mixed_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
                kernel: Any) -> FusedSteps | None | Any:
    """`fast.fast_steps` for a concat plan (one or several live sources, quota or categorical, units documents,
    tokens and loss tokens, piece draws) in `kernel` (a loaded `jit.Kernel`): steps ``state.step + 1 ..
    state.step + n`` of `lanes`; None where it stands aside, NotImplemented where the kernel does not cover the
    call (module docstring). The caller has checked the state's identity, the lanes and `max_steps`."""
    try:
        return _mixed(plan, state, docs, list(lanes), n, kernel)
    except Aside:
        return None


def call_setup(plan: Plan, lanes: list[int]) -> dict[str, Any]:
    """What every call of these lanes passes the kernel and derives from the plan and lanes alone (kept with the
    plan's carry, made on first use)."""
    got = located.Carry.of(plan).setup(lanes)
    if not got:
        S = len(plan.weights)
        mode = 2 if plan.manifest.mixture.policy == "categorical" else 1 if plan.counted else 0
        W = sum(plan.weights)
        got.update(
            mode=mode, col=plan.unit_column, S=S,
            big=mode == 2 and W > 1 << 32, scale=8 * S * (W + 1) * (max(plan.weights) + 1),
            shares=np.asarray([plan.lane_shares(lane) for lane in lanes], dtype=np.int64).reshape(len(lanes), S),
            keys=np.asarray([plan.rng(lane).key if mode == 2 else 0 for lane in lanes], dtype=np.uint64),
            rules=np.asarray([{"repeat": 0, "renormalize": 1}.get(src.exhaustion, 2) for src in plan.manifest.sources],
                             dtype=np.int64),
            weights=np.asarray(plan.weights, dtype=np.int64),
            B=plan.piece_tokens or 0, frame=plan.framing.framed_len(0), masks=bool(plan.framing.masks_eos_target),
            keys_of=plan.sample_keys, state_parts=state_parts(plan.dataset_id, plan.runspec_digest, lanes),
            lane_index=np.arange(len(lanes), dtype=np.int64))
    return got


def _start(plan: Plan, state: DataState, shards: Shards, lanes: list[int], kept: Kept | None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Where the call starts, in the walk's form: cursors (lanes, sources, 8), draw counters, residual pieces
    (lanes, 10) and which lanes have one, rows per lane. From `kept` where the call continues the stream the
    kept call returned (`state` is its very state object: `located.Ended`), else from `state`'s lanes."""
    ended = None if kept is None else kept.ended
    if ended is not None and ended.after is state:
        return ended.cur, ended.draws, ended.residual, ended.has, ended.rows
    lstates = [state.lanes[lane] for lane in lanes]
    S = len(plan.weights)
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(len(lanes), S, 8)
    residual = np.zeros((len(lanes), 10), dtype=np.int64)
    has = np.zeros(len(lanes), dtype=bool)
    for i, r in enumerate(_residuals(plan, shards, lstates, located.residual_docs(kept))):
        if r is not None:
            residual[i], has[i] = r, True
    return cur, np.asarray([ls.draws for ls in lstates], dtype=np.int64), residual, has, [ls.rows for ls in lstates]


def _compiled_walks(plan: Plan, setup: dict[str, Any], shards: Shards, lanes: list[int], start: tuple,
                    kept: Kept | None, check: bool, want: int, n: int, T: int, walk: Any
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any] | None:
    """Every lane's draws of the call in the kernel's `walk` (jitdraws), one call for all lanes (and one more per
    queue it asks to refill), from `start` (`_start`): (pieces, counts, stream totals, the cursors and meta of
    each step (`snaps`, `meta`), the queues); None where its integers could overflow int64 or a categorical
    weight total exceeds 2**32 (`Plan.step` then takes the call). `check`: check the kept queues first
    (`located.queues`; else the kernel asks for what they lack)."""
    cur, draws, residual, has, _ = start
    P, S = cur.shape[:2]
    col, shares = setup["col"], setup["shares"]
    if setup["big"]:
        return None
    if overflows(setup, cur, n * T):
        return None
    cur = cur.copy()  # (the walk moves it: `start` may be kept by a call that fails)
    st = np.zeros((P, 5), dtype=np.int64)
    st[:, 0] = draws
    cap = max(4 * want, 64)
    pieces = np.zeros((P, cap, 10), dtype=np.int64)
    # each lane's residual as its first piece (a lane without one: the walk writes its first piece over it)
    pieces[:, 0] = residual
    st[:, 1] = (residual[:, 8] - residual[:, 7]) * has
    st[:, 3] = has
    if check or kept is None or kept.q is None:
        qfirst, qlen, qepoch, qdata = located.queues(plan, shards, lanes, cur, shares, want, kept)
    else:
        qfirst, qlen, qepoch, qdata = kept.q
    wraps = np.full((P, S), -1, dtype=np.int64)
    opened = np.zeros((P, S, 7), dtype=np.int64)
    snaps = np.zeros((P, n, S, 8), dtype=np.int64)
    meta = np.zeros((P, n, 7), dtype=np.int64)
    done, aside, _, full = walk.status
    keys, weights, rules, B, frame, masks = (setup[x] for x in ("keys", "weights", "rules", "B", "frame", "masks"))
    mode = setup["mode"]
    while True:
        got, i = walk(n, T, B, frame, masks, mode, keys, col, weights, shares, rules, cur, st, wraps, qfirst, qlen,
                      qepoch, qdata, opened, pieces, snaps, meta)
        if got == done:
            break
        if got == aside:
            raise Aside
        if got == full:
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            continue
        qdata = refill(plan, shards, lanes, i, int(st[i, 4]), cur, opened, shares, (qfirst, qlen, qepoch, qdata))
    return pieces, st[:, 3].copy(), st[:, 1].copy(), snaps, meta, (qfirst, qlen, qepoch, qdata)


def overflows(setup: dict[str, Any], cur: np.ndarray, tokens: int) -> bool:
    """Whether a walk from the cursors `cur` (lanes, sources, 8) over `tokens` tokens a lane could overflow its
    int64 products (`call_setup`'s ``scale`` times the furthest a unit column can reach)."""
    most = cur.sum(axis=1).max(axis=0).tolist()  # (per column: the largest of the lanes' sums over sources)
    return setup["scale"] * (max(most[setup["col"]], most[CUR_TOKENS]) + 4 * tokens + 64) >= 1 << 62


def refill(plan: Plan, shards: Shards, lanes: list[int], i: int, s: int, cur: np.ndarray, opened: np.ndarray,
           shares: np.ndarray, q: tuple[np.ndarray, ...]) -> np.ndarray:
    """Refill lane i's queue of source s from its cursor (its open document first), as a walk kernel's
    WALK_NEED asks, in the queues `q` (qfirst, qlen, qepoch: updated in place); returns `qdata` (grown where
    the refill is longer than its rows). `Aside` where the position is outside the lane's share."""
    qfirst, qlen, qepoch, qdata = q
    c = cur[i, s]
    pos = int(c[CUR_TAKEN]) - 1 if c[CUR_OPEN] and not opened[i, s, 0] else int(c[CUR_TAKEN])
    # (twice the queue it outran, bounded: a kept queue lives on from call to call and would double each time)
    hi = min(int(shares[i, s]), pos + max(MIN_BATCH, min(2 * int(qlen[i, s]), REFILL_MAX)))
    if not 0 <= pos < hi:
        raise Aside  # (the kernel asks only for positions inside the share)
    idx = plan.lane_samples(s, int(c[CUR_EPOCH]), lanes[i], pos, hi)
    if hi - pos > qdata.shape[2]:
        P, S = qdata.shape[:2]
        qdata = np.concatenate([qdata, np.zeros((P, S, hi - pos - qdata.shape[2], 5), dtype=np.int64)], axis=2)
    qdata[i, s, :hi - pos] = np.stack([idx, *shards.arrays(s, idx, False)], axis=1)
    qfirst[i, s], qlen[i, s], qepoch[i, s] = pos, hi - pos, c[CUR_EPOCH]
    return qdata


def handed_out(plan: Plan, docs: Any, pieces: np.ndarray, S: int) -> None:
    """Count the pieces a call handed out per source (`docs.count`, as `Plan.step`'s documents callback counts)
    and fold the documents it opened (pieces from offset 0) into the plan's mean framed length (its estimate of
    a call's draws)."""
    if S == 1:
        docs.count(0, len(pieces))
    else:
        for s, m in enumerate(np.bincount(pieces[:, 0], minlength=S).tolist()):
            if m:
                docs.count(s, m)
    fresh = pieces[:, 9][pieces[:, 7] == 0]
    if len(fresh):  # (the mean: its int64 sum is exact, as numpy's float mean of it)
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * (int(fresh.sum()) / len(fresh))


def _mixed(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
    T = k * L
    setup = call_setup(plan, lanes)
    shards = Shards(plan, docs)
    want = int(n * T * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    carry = located.Carry.of(plan)
    kept = carry.take(lanes)  # (kept again by a call that walks to its end)
    start = _start(plan, state, shards, lanes, kept)
    ended = None if kept is None else kept.ended
    going = ended is not None and ended.after is state
    check = not going  # (a stream of calls: the kernel asks for what the kept queues lack, `located.Ended`)
    got = _compiled_walks(plan, setup, shards, lanes, start, kept, check, want, n, T, kernel.walk)
    if got is None:
        return NotImplemented
    pieces, counts, totals, snaps, meta, q = got
    # the rows, and `FusedSteps`' provenance: piece starts, their owners, lane-major starts and offsets, every
    # step's cu_seqlens and tokens per source, the pieces used (lane after lane: the entries)
    got = kernel.assemble(plan.framing, n, k, L, pieces, counts, totals, setup["S"], located.tokens_of(shards))
    if got is NotImplemented:
        return NotImplemented
    block, keys, owners, glob, entry_start, entry_off, (cu, bounds, tokens), used = got
    rows0 = start[4]
    # every step's state as the JSON its entry carries, written by the kernel (its dicts made only where read)
    texts = kernel.state_texts(snaps, meta, np.asarray(rows0, dtype=np.int64), k, state.step + 1,
                               setup["state_parts"])
    if texts is NotImplemented:
        return NotImplemented
    handed_out(plan, docs, used, setup["S"])  # (residuals included)
    fused = FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block,
                       state_dicts=StateTexts(texts), keys=keys, owners=owners, sids=None,
                       entry_start=entry_start, entry_off=entry_off, bound_global=glob,
                       entry_source=used[:, 0], used=used, keys_of=setup["keys_of"], sources=setup["S"],
                       _cu=cu, _bounds=bounds, _tokens=tokens, _unit=len(lanes) * T)
    # where the call ended, for the next call that continues from the state it returns (located.Ended)
    end = meta[:, n - 1]
    last = pieces[setup["lane_index"], counts - 1]  # (every lane's last piece: the residual's, if any)
    last[:, 7] = end[:, 5]
    ended = located.Ended(fused.state(n - 1), snaps[:, n - 1].copy(), end[:, 0].copy(), [r + n * k for r in rows0],
                          last, end[:, 1] != 0)
    carry.keep(lanes, q, last, ended)
    return fused


def _residuals(plan: Plan, shards: Shards, lstates: list[Any], docs: dict) -> list[tuple[int, ...] | None]:
    """Per lane, its concat residual as a piece (the walk's form), or None; its document from `docs` (the
    last call's last pieces, `located.Kept`) or located in one `locate` per source."""
    cur = []
    for ls in lstates:
        if ls.packers and set(ls.packers) != {"*"}:
            raise Aside  # not concat's state: Plan.step refuses it
        c = ls.packers.get("*", {}).get("cur") if ls.packers else None
        if c is not None and not 0 <= c[0] < len(plan.weights):
            raise Aside
        cur.append(c)
    out: list[tuple[int, ...] | None] = [None] * len(lstates)
    frame = plan.framing.framed_len(0)
    known = {i: docs.get(tuple(c[:3])) for i, c in enumerate(cur) if c is not None}
    for s in sorted({c[0] for i, c in enumerate(cur) if c is not None and known[i] is None}):
        mine = [i for i, c in enumerate(cur) if c is not None and c[0] == s and known[i] is None]
        for i, *doc in zip(mine, *shards.locate(s, np.asarray([cur[i][2] for i in mine], dtype=np.int64))):
            known[i] = tuple(doc)
    for i, (o, r, a0, n0) in known.items():
        s, re_, ridx, roff, rend = cur[i]
        if not 0 <= roff < rend <= n0 + frame:
            raise Aside  # a residual outside its document: Plan.step meets it
        out[i] = (s, re_, ridx, o, r, a0, n0, roff, rend, n0 + frame)
    return out


