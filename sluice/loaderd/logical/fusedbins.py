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
`fusedmix`: `shards.Aside`), where a lane's packer state is not one it
continues (another packer's, an ended stream, more open bins than the
window, a bin past `seq_len`, a piece outside its document), and returns
NotImplemented where the kernel does not cover the call. tests/test_logical_bins.py holds it to `Plan.step`
byte for byte, states included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.errors import StateError
from sluice.loaderd.logical import fusedmix, located
from sluice.loaderd.logical.fused import BinRows, FusedSteps, StateTexts
from sluice.loaderd.logical.jit import state_parts
from sluice.loaderd.logical.packing import BestfitPacker
from sluice.loaderd.logical.shards import Aside, Shards

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan
    from sluice.loaderd.logical.state import DataState


def bins_steps(plan: Plan, state: DataState, docs: DocTokens, lanes: Sequence[int], n: int,
               kernel: Any) -> FusedSteps | None | Any:
    """`fast.fast_steps` for a plan with one best-fit packer, in `kernel` (a loaded `jit.Kernel`): steps
    ``state.step + 1 .. state.step + n`` of `lanes`; None where it stands aside, NotImplemented where the
    kernel does not cover the call (module docstring). The caller has checked the state's
    identity, the lanes and `max_steps`."""
    try:
        return _bins(plan, state, docs, list(lanes), n, kernel)
    except (Aside, StateError):  # (StateError: a packer state that does not load; Plan.step names it)
        return None


class Held:
    """Each lane's best-fit state in the kernel's form: its pieces held (`pieces` (P, m, 10), the walk's rows;
    `pbin` their bins: the open ones ``0 .. nopen - 1`` oldest first, then the pending ones in closing order),
    how many (`npc`), `nopen`, `npend`, the open bins' fills `bfill` (P, window); with the cursors `cur`, draw
    counters and rows. A call's end keeps one (`after`: the state it returned), so that the next call of the
    same stream starts from it without reading the state's lanes (as `located.Ended` for concat)."""

    __slots__ = ("after", "cur", "draws", "rows", "pieces", "pbin", "npc", "nopen", "npend", "bfill")

    def __init__(self, after: object, cur: np.ndarray, draws: np.ndarray, rows: list[int], pieces: np.ndarray,
                 pbin: np.ndarray, npc: np.ndarray, nopen: np.ndarray, npend: np.ndarray, bfill: np.ndarray) -> None:
        self.after, self.cur, self.draws, self.rows = after, cur, draws, rows
        self.pieces, self.pbin, self.npc, self.nopen, self.npend, self.bfill = pieces, pbin, npc, nopen, npend, bfill

    def located(self) -> np.ndarray:
        """The held pieces, lane after lane (their documents located: the next call's residuals)."""
        return np.concatenate([self.pieces[i, :c] for i, c in enumerate(self.npc.tolist())])


def _from_state(plan: Plan, shards: Shards, state: DataState, lanes: list[int], kept: located.Kept | None) -> Held:
    """`Held` from the state's lanes: each lane's packer state loaded (`BestfitPacker.load`, which raises
    StateError where it is malformed) and its pieces located; `Aside` where it is not one the kernel continues
    (another packer's, an ended stream, more open bins than the window, a bin past seq_len, a piece outside
    its source or its document)."""
    m = plan.manifest.packing
    frame = plan.framing.framed_len(0)
    S, P = len(plan.weights), len(lanes)
    lstates = [state.lanes[lane] for lane in lanes]
    bins = []
    for ls in lstates:
        if set(ls.packers) - {"*"}:
            raise Aside  # another plan's packers: Plan.step refuses them
        p = BestfitPacker(m.seq_len, m.window)
        if "*" in ls.packers:
            p.load(ls.packers["*"], "lane")
        if p.ended or len(p.open) > m.window or \
                any(not b or sum(pc[4] - pc[3] for pc in b) > m.seq_len for b in p.open + p.pending):
            raise Aside
        bins.append((p.open, p.pending))
    docs = located.residual_docs(kept)
    want = {tuple(pc[:3]) for o, pend in bins for b in o + pend for pc in b}
    if any(not 0 <= d[0] < S for d in want):
        raise Aside
    where = {d: docs[d] for d in want if d in docs}
    for s in sorted({d[0] for d in want if d not in where}):
        mine = sorted(d for d in want if d[0] == s and d not in where)
        for d, *at in zip(mine, *shards.locate(s, np.asarray([d[2] for d in mine], dtype=np.int64))):
            where[d] = tuple(at)
    npc = np.asarray([sum(map(len, o + pend)) for o, pend in bins], dtype=np.int64)
    pieces = np.zeros((P, int(npc.max(initial=0)), 10), dtype=np.int64)
    pbin = np.zeros(pieces.shape[:2], dtype=np.int64)
    bfill = np.zeros((P, m.window), dtype=np.int64)
    for i, (opened, pending) in enumerate(bins):
        r = 0
        for b, bin_ in enumerate(opened + pending):
            for pc in bin_:
                o, rec, a0, n0 = where[tuple(pc[:3])]
                if not 0 <= pc[3] < pc[4] <= n0 + frame:
                    raise Aside  # a piece outside its document
                pieces[i, r] = (*pc[:3], o, rec, a0, n0, pc[3], pc[4], n0 + frame)
                pbin[i, r] = b
                r += 1
            if b < len(opened):
                bfill[i, b] = sum(pc[4] - pc[3] for pc in bin_)
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(P, S, 8)
    return Held(None, cur, np.asarray([ls.draws for ls in lstates], dtype=np.int64), [ls.rows for ls in lstates],
                pieces, pbin, npc, np.asarray([len(o) for o, _ in bins], dtype=np.int64),
                np.asarray([len(pend) for _, pend in bins], dtype=np.int64), bfill)


def _held_at_end(pieces: np.ndarray, pbin: np.ndarray, bopen: np.ndarray, bfill: np.ndarray, fifo: np.ndarray,
                 st: np.ndarray, cur: np.ndarray, rows: list[int]) -> Held:
    """`Held` where the kernel's walk ended (it stops right after the call's last row: its arrays are the state
    after the call's last step), its pieces of served bins dropped and the bins numbered afresh."""
    P = len(st)
    keep, bins_of, npc = [], [], np.zeros(P, dtype=np.int64)
    for i in range(P):
        _, _, _, made, _, nopen, nb, head, tail = st[i].tolist()
        held = np.concatenate([bopen[i, :nopen], fifo[i, head:tail]])
        remap = np.full(nb + 1, -1, dtype=np.int64)
        remap[held] = np.arange(len(held), dtype=np.int64)
        new = remap[pbin[i, :made]]
        mask = new >= 0
        keep.append(pieces[i, :made][mask])
        bins_of.append(new[mask])
        npc[i] = len(bins_of[-1])
    m = int(npc.max(initial=0))
    out = np.zeros((P, m, 10), dtype=np.int64)
    obin = np.zeros((P, m), dtype=np.int64)
    for i in range(P):
        out[i, :npc[i]], obin[i, :npc[i]] = keep[i], bins_of[i]
    return Held(None, cur.copy(), st[:, 0].copy(), rows, out, obin, npc, st[:, 5].copy(), st[:, 8] - st[:, 7],
                bfill.copy())


def _bins(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    m = plan.manifest.packing
    k, L, window = plan.spec.per_lane, m.seq_len, m.window
    setup = fusedmix.call_setup(plan, lanes)
    if setup["big"]:
        return NotImplemented
    shards = Shards(plan, docs)
    P, S, R = len(lanes), setup["S"], n * k
    calls = located.Carry.of(plan)
    kept = calls.take(lanes)
    going = kept is not None and isinstance(kept.ended, Held) and kept.ended.after is state
    start = kept.ended if going else _from_state(plan, shards, state, lanes, kept)
    cur = start.cur.copy()  # (the walk moves it: `start` may be kept by a call that fails)
    if fusedmix.overflows(setup, cur, R * L):
        return NotImplemented
    want = int(R * L * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    cap = max(4 * want, 64) + start.pieces.shape[1]
    pieces = np.zeros((P, cap, 10), dtype=np.int64)
    pbin, fifo = np.zeros((P, cap), dtype=np.int64), np.zeros((P, cap), dtype=np.int64)
    held = start.pieces.shape[1]
    pieces[:, :held], pbin[:, :held] = start.pieces, start.pbin
    bopen, bfill = np.zeros((P, window), dtype=np.int64), start.bfill.copy()
    nopen, npend = start.nopen.tolist(), start.npend.tolist()
    for i in range(P):
        bopen[i, :nopen[i]] = np.arange(nopen[i])
        fifo[i, :npend[i]] = np.arange(nopen[i], nopen[i] + npend[i])
    st = np.zeros((P, 9), dtype=np.int64)
    st[:, 0], st[:, 3], st[:, 5], st[:, 6], st[:, 8] = start.draws, start.npc, nopen, start.nopen + start.npend, npend
    shares = setup["shares"]
    q = kept.q if going and kept.q is not None else located.queues(plan, shards, lanes, cur, shares, want, kept)
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
    got = kernel.assemble_bins(plan.framing, m.pad_id, n, k, L, pieces, counts, pbin, rowbin, S, located.tokens_of(shards))
    if got is NotImplemented:
        return NotImplemented
    block, used, rptr, tokens = got
    texts = kernel.bins_texts(snaps, meta, np.asarray(start.rows, dtype=np.int64), k, state.step + 1,
                              _parts(plan, lanes), pieces, pbin, counts, fifo, bopens)
    if texts is NotImplemented:
        return NotImplemented
    walked = np.concatenate([pieces[i, start.npc[i]:counts[i]] for i in range(P)])  # (drawn in this call)
    for s, c in enumerate(np.bincount(walked[:, 0], minlength=S).tolist()):
        if c:
            docs.count(s, c)
    fresh = walked[:, 9][walked[:, 7] == 0]
    if len(fresh):
        plan.mean_framed_len = 0.9 * plan.mean_framed_len + 0.1 * (int(fresh.sum()) / len(fresh))
    z = np.zeros(0, dtype=np.int64)
    # (every row's tokens per source, one source too: the producer's counts then read no sample ID)
    row_tokens = tokens.reshape(P, n, k, S).transpose(1, 0, 2, 3).reshape(n * P * k, S)
    fused = FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block, state_dicts=StateTexts(texts),
                       keys=z, owners=[], sids=[], entry_start=z, entry_off=z, bound_global=z,
                       packed=rows(plan, block, used, rptr, P, n, k, L), row_tokens=row_tokens)
    end = _held_at_end(pieces, pbin, bopen, bfill, fifo, st, cur, [r + R for r in start.rows])
    end.after = fused.state(n - 1)
    calls.keep(lanes, q, end.located(), end)
    return fused


def _parts(plan: Plan, lanes: list[int]) -> tuple:
    """`jit.state_parts` of a best-fit state of these lanes (kept with the plan's carry)."""
    setup = located.Carry.of(plan).setup(lanes)
    got = setup.get("bins_parts")
    if got is None:
        got = setup["bins_parts"] = state_parts(plan.dataset_id, plan.runspec_digest, lanes, "bins")
    return got


def rows(plan: Plan, block: np.ndarray, used: np.ndarray, rptr: np.ndarray, P: int, n: int, k: int, L: int
          ) -> BinRows:
    """Every row of the call, step-major (`FusedSteps.packed`; `fusedseqs`' too), from the placed pieces (`used`, lane-major rows,
    each row's first at `rptr`): each row's segments, its pieces' lengths then its padding's, in arrays."""
    R = n * k
    lengths = used[:, 8] - used[:, 7]
    per_row = np.diff(rptr)
    pad = L - np.add.reduceat(lengths, rptr[:-1])  # (every row holds a piece: `assemble_bins` checked)
    g = np.arange(P * R, dtype=np.int64)  # lane-major row g = i * R + j * k + r is step-major row t
    i, q = np.divmod(g, R)
    order = np.empty(P * R, dtype=np.int64)
    order[(q // k) * P * k + i * k + q % k] = g  # (step-major row t -> its lane-major row)
    cnt, padded = per_row[order], pad[order] > 0
    row_ptr = np.zeros(P * R + 1, dtype=np.int64)
    np.cumsum(cnt + padded, out=row_ptr[1:])
    first = np.repeat(rptr[order] - np.cumsum(cnt) + cnt, cnt)  # (each piece's row start, less the pieces before)
    at = np.arange(len(used), dtype=np.int64)
    piece = first + at  # (the placed pieces in step-major rows)
    seg_len = np.empty(row_ptr[-1], dtype=np.int32)
    seg_owner = np.full(row_ptr[-1], -1, dtype=np.int64)
    pos = np.repeat(row_ptr[:-1] - np.cumsum(cnt) + cnt, cnt) + at
    seg_len[pos], seg_owner[pos] = lengths[piece], piece
    seg_len[row_ptr[1:][padded] - 1] = pad[order][padded]
    return BinRows(block, k, seg_len, seg_owner, row_ptr, used, plan.sample_keys)
