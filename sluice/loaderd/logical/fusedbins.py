"""The fast path for best-fit packing in the compiled kernel: every lane and step of a call, draws, bins and rows.

Under one shared best-fit packer a lane's draws are those of concat (the
packer pulls `LaneMachine._pull_mixed` without choosing what it pulls); only
how many are pulled, and which rows they make, differ. `bins_steps` runs
`jitdraws.walk_bins`: the draws of `jitdraws._draw` (the one draw concat's
walk makes too), pulled only while no row is pending, each piece cut into
whole-row chunks and its remainder placed as `packing.BestfitPacker` places
it (the open bin with the least room that fits it, ties the oldest; else a
new bin, the fullest closing first when `window` are open; a bin exactly
full closes at once); closed bins are served in closing order. After the
row that ends each step the kernel notes the cursors, the draw counter and
which bins are open and pending, so every step's state (its packer's open
bins and pending rows as pieces) is read off the call's pieces.
`jitrows.assemble_bins` with `gather` and `finish_bins` then write the rows
into the step-major block: pieces one after another, padding after them
(`pad_id`, label -100, position 0), labels shifted inside each piece (a
piece cut before its document's end targets the document's next token).

It stands aside (None; `Plan.step` meets the case) where the draws do (as
`fusedmix`: `walk.Aside`), where a lane's packer state is not one it
continues (another packer's, an ended stream, more open bins than the
window, a bin past `seq_len`, a piece outside its document), and returns
NotImplemented where the kernel is not loaded or does not cover the call
(`fusedpack` takes it). tests/test_logical_bins.py holds it to `Plan.step`
byte for byte, states included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.datastate import CUR_TOKENS, lane_obj
from sluice.errors import StateError
from sluice.loaderd.logical import fusedmix, located
from sluice.loaderd.logical.fused import FusedSteps
from sluice.loaderd.logical.packing import BestfitPacker, Row
from sluice.loaderd.logical.walk import Aside, Shards, state_dicts

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState

_PIECE = [0, 1, 2, 7, 8]  # a walked piece's (source, epoch, index, start, end): the packers' form


def bins_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
               kernel: Any) -> FusedSteps | None | Any:
    """`fast.fast_steps` for a plan with one best-fit packer, in `kernel` (a loaded `jit.Kernel`): steps
    ``state.step + 1 .. state.step + n`` of `lanes`; None where it stands aside, NotImplemented where the
    kernel is not there or does not cover the call (module docstring). The caller has checked the state's
    identity, the lanes and `max_steps`."""
    if kernel is None:
        return NotImplemented
    try:
        return _bins(plan, state, docs, list(lanes), n, kernel)
    except (Aside, StateError):  # (StateError: a packer state that does not load; Plan.step names it)
        return None


def _packers(plan: Plan, shards: Shards, lstates: list[Any], kept: located.Kept | None
             ) -> list[tuple[list[list[tuple[int, ...]]], list[list[tuple[int, ...]]]]]:
    """Each lane's best-fit state as (open bins, pending rows), every piece located in the walk's form
    (source, epoch, index, object, record, first token, count, start, end, framed length); `Aside` where it
    is not one the kernel continues."""
    m = plan.manifest.packing
    frame = plan.framing.framed_len(0)
    S = len(plan.weights)
    states = []
    for ls in lstates:
        if set(ls.packers) - {"*"}:
            raise Aside  # another plan's packers: Plan.step refuses them
        p = BestfitPacker(m.seq_len, m.window)
        if "*" in ls.packers:
            p.load(ls.packers["*"], "lane")
        if p.ended or len(p.open) > m.window or any(not b or p._fill(b) > m.seq_len for b in p.open + p.pending):
            raise Aside
        states.append((p.open, p.pending))
    docs = located.residual_docs(kept)
    want = {tuple(pc[:3]) for o, pend in states for b in o + pend for pc in b}
    if any(not 0 <= d[0] < S for d in want):
        raise Aside
    where = {d: docs[d] for d in want if d in docs}
    for s in sorted({d[0] for d in want if d not in where}):
        mine = sorted(d for d in want if d[0] == s and d not in where)
        for d, *at in zip(mine, *shards.locate(s, np.asarray([d[2] for d in mine], dtype=np.int64))):
            where[d] = tuple(at)

    def walked(pc: tuple[int, ...]) -> tuple[int, ...]:
        o, r, a0, n0 = where[tuple(pc[:3])]
        if not 0 <= pc[3] < pc[4] <= n0 + frame:
            raise Aside  # a piece outside its document
        return (*pc[:3], o, r, a0, n0, pc[3], pc[4], n0 + frame)

    return [([[walked(pc) for pc in b] for b in o], [[walked(pc) for pc in b] for b in pend]) for o, pend in states]


def _bins(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    m = plan.manifest.packing
    k, L, window = plan.spec.per_lane, m.seq_len, m.window
    setup = fusedmix.call_setup(plan, lanes)
    if setup["big"]:
        return NotImplemented
    shards = Shards(plan, docs)
    P, S, R = len(lanes), setup["S"], n * k
    lstates = [state.lanes[lane] for lane in lanes]
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(P, S, 8)
    most = cur.sum(axis=1).max(axis=0).tolist()  # (as `fusedmix._compiled_walks`: the walk's int64 products)
    if setup["scale"] * (max(most[setup["col"]], most[CUR_TOKENS]) + 4 * R * L + 64) >= 1 << 62:
        return NotImplemented
    kept = located.Carry.of(plan).take(lanes)
    packers = _packers(plan, shards, lstates, kept)
    want = int(R * L * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    held = [sum(map(len, o + pend)) for o, pend in packers]
    cap = max(4 * want, 64) + max(held)
    pieces = np.zeros((P, cap, 10), dtype=np.int64)
    pbin, fifo = np.zeros((P, cap), dtype=np.int64), np.zeros((P, cap), dtype=np.int64)
    bopen, bfill = np.zeros((P, window), dtype=np.int64), np.zeros((P, window), dtype=np.int64)
    st = np.zeros((P, 9), dtype=np.int64)
    for i, (opened_bins, pending) in enumerate(packers):
        r = b = 0
        for x, bin_ in enumerate(opened_bins + pending):
            for pc in bin_:
                pieces[i, r], pbin[i, r] = pc, b
                r += 1
            if x < len(opened_bins):
                bopen[i, x], bfill[i, x] = b, sum(pc[8] - pc[7] for pc in bin_)
            else:
                fifo[i, x - len(opened_bins)] = b
            b += 1
        st[i] = (lstates[i].draws, 0, 0, r, 0, len(opened_bins), b, 0, len(pending))
    shares = setup["shares"]
    q = located.queues(plan, shards, lanes, cur, shares, want, kept)
    wraps = np.full((P, S), -1, dtype=np.int64)
    opened = np.zeros((P, S, 7), dtype=np.int64)
    rowbin = np.zeros((P, R), dtype=np.int64)
    carry = np.zeros((P, 11), dtype=np.int64)
    snaps = np.zeros((P, n, S, 8), dtype=np.int64)
    meta = np.zeros((P, n, 5), dtype=np.int64)
    bopens = np.zeros((P, n, window), dtype=np.int64)
    done, aside, _, full = kernel.walk_bins.status
    keys, weights, rules, B, frame, masks, mode, col = (setup[x] for x in (
        "keys", "weights", "rules", "B", "frame", "masks", "mode", "col"))
    while True:
        got, i = kernel.walk_bins(n, k, L, window, B, frame, masks, mode, keys, col, weights, shares, rules, cur, st,
                                  wraps, *q, opened, pieces, pbin, bopen, bfill, fifo, rowbin, carry, snaps, meta,
                                  bopens)
        if got == done:
            break
        if got == aside:
            raise Aside
        if got == full:  # (pieces, their bins and the pending queue grow together: bins <= pieces)
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            pbin, fifo = (np.concatenate([a, np.zeros_like(a)], axis=1) for a in (pbin, fifo))
            continue
        q = (*q[:3], fusedmix.refill(plan, shards, lanes, i, int(st[i, 4]), cur, opened, shares, q))
    counts = st[:, 3].copy()

    def tokens_of(objects: list[int]) -> list[np.ndarray]:
        pairs = [(o >> 32, o & 0xFFFFFFFF) for o in objects]
        located.ensure_mapped(shards, pairs)  # (the kept queues' and residuals' objects: mapped, verified)
        return [shards.maps[s][o][1] for s, o in pairs]

    got = kernel.assemble_bins(plan.framing, m.pad_id, n, k, L, pieces, counts, pbin, rowbin, S, tokens_of)
    if got is NotImplemented:
        return NotImplemented
    block, used, rptr, tokens = got
    made = _rows(plan, block, used, rptr, P, n, k, L)
    per_obj, last = _states(pieces, pbin, fifo, counts, snaps, meta, bopens, lstates, lanes, n, k)
    walked = np.concatenate([pieces[i, held[i]:counts[i]] for i in range(P)])  # (drawn in this call)
    for s, c in enumerate(np.bincount(walked[:, 0], minlength=S).tolist()):
        if c:
            docs.count(s, c)
    fresh = walked[:, 9][walked[:, 7] == 0]
    if len(fresh):
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * (int(fresh.sum()) / len(fresh))
    located.Carry.of(plan).keep(lanes, q, last)
    z = np.zeros(0, dtype=np.int64)
    row_tokens = None if S < 2 else tokens.reshape(P, n, k, S).transpose(1, 0, 2, 3).reshape(n * P * k, S)
    return FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block,
                      state_dicts=state_dicts(plan, state, lanes, per_obj), keys=z, owners=[], sids=[],
                      entry_start=z, entry_off=z, bound_global=z, compiled=True, packed=made, row_tokens=row_tokens)


def _rows(plan: Plan, block: np.ndarray, used: np.ndarray, rptr: np.ndarray, P: int, n: int, k: int, L: int
          ) -> list[Row]:
    """Every row of the call, step-major, as `Plan.step` makes them (arrays view the block; segments and
    seqlens from the placed pieces, padding a segment of its own)."""
    keys_of = plan.sample_keys
    ul, rp = used[:, [0, 3, 4, 7, 8]].tolist(), rptr.tolist()
    R = n * k
    made: list[Row] = [None] * (P * R)  # type: ignore[list-item]
    for g in range(P * R):
        i, q = divmod(g, R)
        j, r = divmod(q, k)
        row = i * k + r
        segs, lens = [], []
        for s, o, rec, a, e in ul[rp[g]:rp[g + 1]]:
            segs.append((f"{keys_of[s][o]}:{rec}", a, e))
            lens.append(e - a)
        fill = sum(lens)
        if fill < L:
            lens.append(L - fill)  # padding is its own segment
        made[j * P * k + row] = Row(block[j, 0, row], block[j, 1, row], block[j, 2, row], tuple(lens), tuple(segs))
    return made


def _states(pieces: np.ndarray, pbin: np.ndarray, fifo: np.ndarray, counts: np.ndarray, snaps: np.ndarray,
            meta: np.ndarray, bopens: np.ndarray, lstates: list[Any], lanes: list[int], n: int, k: int
            ) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Every step's lane objects (`lane_obj` by lane name: cursors, draws, rows, the packer's open bins and
    pending rows as pieces, read off the call's pieces by the kernel's notes), and the pieces of the last
    step's bins (their documents, located: the next call's residuals)."""
    per_obj: list[dict[str, Any]] = [{} for _ in range(n)]
    last = []
    for i, lane in enumerate(lanes):
        c = int(counts[i])
        as_lists = pieces[i, :c][:, _PIECE].tolist()
        by_bin: dict[int, list[int]] = {}
        for x, b in enumerate(pbin[i, :c].tolist()):
            by_bin.setdefault(b, []).append(x)
        lane_meta, lane_fifo, lane_open = meta[i].tolist(), fifo[i].tolist(), bopens[i].tolist()
        rows0 = lstates[i].rows
        for j in range(n):
            draws, npc, head, tail, nopen = lane_meta[j]
            open_ = [[as_lists[x] for x in by_bin[b] if x < npc] for b in lane_open[j][:nopen]]
            pending = [[as_lists[x] for x in by_bin[b]] for b in lane_fifo[head:tail]]
            per_obj[j][str(lane)] = lane_obj(draws, rows0 + (j + 1) * k, snaps[i, j].tolist(),
                                             {"*": {"open": open_, "pending": pending, "ended": False}})
            if j == n - 1:
                held = [x for b in lane_open[j][:nopen] + lane_fifo[head:tail] for x in by_bin[b] if x < npc]
                last.append(pieces[i, held])
    return per_obj, np.concatenate(last) if last else np.zeros((0, 10), dtype=np.int64)
