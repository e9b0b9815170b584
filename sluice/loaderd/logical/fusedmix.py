"""The fast path for concat packing in the compiled kernel: every lane and step of a call, draws and rows.

Concat cuts one stream a lane into rows, so what a call needs is each
lane's draws until its stream covers the call. With a loaded `jit.Kernel`,
`mixed_steps` walks them for every lane in one call of `jitdraws.walk`
(the walk of `walk.Lane`, as `lanemachine.LaneMachine` draws for concat: pick among
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

Without the kernel (numba not installed or not loaded yet), or where its
int64 arithmetic or a token dtype does not cover the call, it returns
NotImplemented and `fusedpack` computes the call (the same walk in Python,
the reference's packer and `materialize`): the same bytes and states, never
a third algorithm. It stands aside (None; `Plan.step` meets the case) where
the walk does (`walk.Aside`: a source exhausted under `stop` or `fail`, every
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
from sluice.loaderd.logical.fused import FusedSteps
from sluice.loaderd.logical.state import DataState, lane_obj
from sluice.loaderd.logical import located
from sluice.loaderd.logical.located import Kept
from sluice.loaderd.logical.walk import MIN_BATCH, REFILL_MAX, Aside, Shards, state_dicts

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan


def mixed_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
                kernel: Any) -> FusedSteps | None | Any:
    """`fast.fast_steps` for a concat plan (one or several live sources, quota or categorical, units documents,
    tokens and loss tokens, piece draws) in `kernel` (a loaded `jit.Kernel`): steps ``state.step + 1 ..
    state.step + n`` of `lanes`; None where it stands aside, NotImplemented where the kernel does not cover the
    call (module docstring). The caller has checked the state's identity, the lanes and `max_steps`."""
    if kernel is None:
        return NotImplemented
    try:
        return _mixed(plan, state, docs, list(lanes), n, kernel)
    except Aside:
        return None


def _compiled_walks(plan: Plan, shards: Shards, lanes: list[int], lstates: list[Any], kept: Kept | None,
                    residuals: list[Any], want: int, n: int, T: int, walk: Any) -> tuple[list[Any], list[Any]] | None:
    """Every lane's draws of the call in the kernel's `walk` (jitdraws), one call for all lanes (and one more per
    queue it asks to refill): (pieces, counts, stream totals, their cursors and residuals per step as
    `snaps`/`meta` lists); None where its integers could overflow int64 or a categorical weight total exceeds
    2**32 (`fusedpack` then takes the call)."""
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
    shares = np.asarray([plan.lane_shares(lane) for lane in lanes], dtype=np.int64).reshape(P, S)
    qfirst, qlen, qepoch, qdata = located.queues(plan, shards, lanes, cur, shares, want, kept)
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
            raise Aside
        if got == full:
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            continue
        s = int(st[i, 4])  # refill lane i's queue of source s from its cursor (its open document first)
        c = cur[i, s]
        pos = int(c[CUR_TAKEN]) - 1 if c[CUR_OPEN] and not opened[i, s, 0] else int(c[CUR_TAKEN])
        # (twice the queue it outran, bounded: a kept queue lives on from call to call and would double each time)
        hi = min(int(shares[i, s]), pos + max(MIN_BATCH, min(2 * int(qlen[i, s]), REFILL_MAX)))
        if not 0 <= pos < hi:
            raise Aside  # (the kernel asks only for positions inside the share)
        idx = plan.lane_samples(s, int(c[CUR_EPOCH]), lanes[i], pos, hi)
        if hi - pos > qdata.shape[2]:
            grow = np.zeros((P, S, hi - pos - qdata.shape[2], 5), dtype=np.int64)
            qdata = np.concatenate([qdata, grow], axis=2)
        qdata[i, s, :hi - pos] = np.stack([idx, *shards.arrays(s, idx, False)], axis=1)
        qfirst[i, s], qlen[i, s], qepoch[i, s] = pos, hi - pos, c[CUR_EPOCH]
    counts = st[:, 3].copy()
    located.Carry.of(plan).keep(lanes, (qfirst, qlen, qepoch, qdata), pieces, counts)
    return pieces, counts, st[:, 1].copy(), [snaps.tolist(), meta.tolist()]


def _kernel_assemble(plan: Plan, shards: Shards, kernel: Any, pieces: np.ndarray, counts: np.ndarray,
                     totals: np.ndarray, n: int, k: int, L: int) -> tuple | object:
    """The rows from the walked pieces' arrays in the kernel (`jit.Kernel.assemble`), with `FusedSteps`' provenance
    (piece starts, their owners, the owners' sample IDs, lane-major starts and offsets), or NotImplemented."""
    used = np.concatenate([pieces[i, :c] for i, c in enumerate(counts.tolist())])
    objects = used[:, 0] * (1 << 32) + used[:, 3]  # (source, object): the token array a piece reads
    uniq, inverse = np.unique(objects, return_inverse=True)
    okeys = np.zeros(pieces.shape[:2], dtype=np.int64)
    okeys[np.arange(pieces.shape[1]) < counts[:, None]] = inverse.reshape(-1)
    pairs = [(o >> 32, o & 0xFFFFFFFF) for o in uniq.tolist()]
    located.ensure_mapped(shards, pairs)  # (the kept queues' objects: mapped again, their reads verified)
    maps = shards.maps
    toks = [maps[s][o][1] for s, o in pairs]
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
    return block, keys, own_l, sids, starts, offs, glob, used[:, 0]


def _mixed(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
    T = k * L
    shards = Shards(plan, docs)
    want = int(n * T * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    lstates = [state.lanes[lane] for lane in lanes]
    kept = located.Carry.of(plan).take(lanes)  # (kept again by a call that walks to its end)
    residuals = _residuals(plan, shards, lstates, located.residual_docs(kept))
    got = _compiled_walks(plan, shards, lanes, lstates, kept, residuals, want, n, T, kernel.walk)
    if got is None:
        return NotImplemented
    pieces, counts, totals, (snaps, meta) = got
    assembled = _kernel_assemble(plan, shards, kernel, pieces, counts, totals, n, k, L)
    if assembled is NotImplemented:
        return NotImplemented
    per_obj: list[dict[str, Any]] = [{} for _ in range(n)]
    for i, (lane, ls) in enumerate(zip(lanes, lstates)):
        for j, (snap, m) in enumerate(zip(snaps[i], meta[i])):
            per_obj[j][str(lane)] = lane_obj(m[0], ls.rows + (j + 1) * k, snap, {"*": {"cur": m[2:] if m[1] else None}})
    used = np.concatenate([pieces[i, :c] for i, c in enumerate(counts.tolist())])
    # pieces handed out per source (docs.count), residuals included; the documents opened update the mean length
    for s, m in enumerate(np.bincount(used[:, 0], minlength=len(plan.weights)).tolist()):
        if m:
            docs.count(s, m)
    fresh = used[used[:, 7] == 0, 9]
    if len(fresh):
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * float(fresh.mean())
    block, keys, owners, sids, entry_start, entry_off, glob, entry_source = assembled
    return FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block,
                      state_dicts=state_dicts(plan, state, lanes, per_obj), keys=keys, owners=owners, sids=sids,
                      entry_start=entry_start, entry_off=entry_off, bound_global=glob, compiled=True,
                      entry_source=entry_source)


def _residuals(plan: Plan, shards: Shards, lstates: list[Any], docs: dict) -> list[tuple[int, ...] | None]:
    """Per lane, its concat residual as a piece (`walk.Lane.take`'s form), or None; its document from `docs` (the
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


