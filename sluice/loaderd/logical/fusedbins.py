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
bins and pending rows as pieces) is read off the call's pieces. With one
packer per source (unit `sequences`, `LaneMachine.next_pieces`) each row
picks its source (one draw) and that source's packer pulls the source's own
pieces (`jitdraws._take`) while it has no row pending; a source that runs out
makes that call `Plan.step`'s (its packer flushes and ends), and the kernel
then carries the ended packer, its source picked again only while the packer
holds flushed rows (`LaneMachine._active`).
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

from sluice.datastate import CUR_ACTIVE
from sluice.errors import StateError
from sluice.loaderd.logical import fusedmix, located
from sluice.loaderd.logical.fused import BinRows, FusedSteps, StateTexts
from sluice.loaderd.logical.jit import packer_keys, state_parts
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
    """Each lane's best-fit packers in the kernel's form (G of them: one, or one per source): their pieces held
    (`pieces` (P, m, 10), the walk's rows; `pbin` their bins, numbered packer after packer, each packer's open
    ones oldest first, then its pending ones in closing order), how many (`npc`), each packer's open and pending
    bins (`nopen`, `npend` (P, G)), the open bins' fills `bfill` (P, G, window), whether it has ended (`ended`
    (P, G): a source's packer whose source ran out); with the cursors `cur`, draw counters and rows. A call's end
    keeps one (`after`: the state it returned), so that the next call of the same stream starts from it without
    reading the state's lanes (as `located.Ended` for concat)."""

    __slots__ = ("after", "cur", "draws", "rows", "pieces", "pbin", "npc", "nopen", "npend", "bfill", "ended")

    def __init__(self, after: object, cur: np.ndarray, draws: np.ndarray, rows: list[int], pieces: np.ndarray,
                 pbin: np.ndarray, npc: np.ndarray, nopen: np.ndarray, npend: np.ndarray, bfill: np.ndarray,
                 ended: np.ndarray) -> None:
        self.after, self.cur, self.draws, self.rows = after, cur, draws, rows
        self.pieces, self.pbin, self.npc, self.nopen, self.npend, self.bfill = pieces, pbin, npc, nopen, npend, bfill
        self.ended = ended

    def located(self) -> np.ndarray:
        """The held pieces, lane after lane (their documents located: the next call's residuals)."""
        return np.concatenate([self.pieces[i, :c] for i, c in enumerate(self.npc.tolist())])


def _from_state(plan: Plan, shards: Shards, state: DataState, lanes: list[int], kept: located.Kept | None) -> Held:
    """`Held` from the state's lanes: each lane's packer states loaded (`BestfitPacker.load`, which raises
    StateError where one is malformed) and their pieces located; `Aside` where one is not a state the kernel
    continues (another plan's packers, an ended stream, more open bins than the window, a bin past seq_len, a
    piece outside its source or its document; per source: a piece of another source, a packer ended while its
    source is live)."""
    m = plan.manifest.packing
    frame = plan.framing.framed_len(0)
    S, P = len(plan.weights), len(lanes)
    names = plan.packer_keys
    per_source = plan.per_source_packers
    lstates = [state.lanes[lane] for lane in lanes]
    cur = np.asarray([[c.to_list() for c in ls.sources] for ls in lstates], dtype=np.int64).reshape(P, S, 8)
    bins, ended = [], np.zeros((P, len(names)), dtype=np.int64)
    for i, ls in enumerate(lstates):
        if set(ls.packers) - set(names):
            raise Aside  # another plan's packers: Plan.step refuses them
        for g, name in enumerate(names):
            p = BestfitPacker(m.seq_len, m.window)
            if name in ls.packers:
                p.load(ls.packers[name], "lane")
            if (p.ended and not (per_source and not cur[i, g, CUR_ACTIVE])) or len(p.open) > m.window or \
                    any(not b or sum(pc[4] - pc[3] for pc in b) > m.seq_len for b in p.open + p.pending) or \
                    (per_source and any(pc[0] != g for b in p.open + p.pending for pc in b)):
                raise Aside
            ended[i, g] = p.ended
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
    G = len(names)
    per_lane = [bins[i * G:(i + 1) * G] for i in range(P)]
    npc = np.asarray([sum(len(b) for o, pend in lane for b in o + pend) for lane in per_lane], dtype=np.int64)
    pieces = np.zeros((P, int(npc.max(initial=0)), 10), dtype=np.int64)
    pbin = np.zeros(pieces.shape[:2], dtype=np.int64)
    bfill = np.zeros((P, G, m.window), dtype=np.int64)
    for i, lane in enumerate(per_lane):
        r = b = 0
        for g, (opened, pending) in enumerate(lane):
            for x, bin_ in enumerate(opened + pending):
                for pc in bin_:
                    o, rec, a0, n0 = where[tuple(pc[:3])]
                    if not 0 <= pc[3] < pc[4] <= n0 + frame:
                        raise Aside  # a piece outside its document
                    pieces[i, r] = (*pc[:3], o, rec, a0, n0, pc[3], pc[4], n0 + frame)
                    pbin[i, r] = b
                    r += 1
                if x < len(opened):
                    bfill[i, g, x] = sum(pc[4] - pc[3] for pc in bin_)
                b += 1
    nopen = np.asarray([[len(o) for o, _ in lane] for lane in per_lane], dtype=np.int64).reshape(P, G)
    npend = np.asarray([[len(pend) for _, pend in lane] for lane in per_lane], dtype=np.int64).reshape(P, G)
    return Held(None, cur, np.asarray([ls.draws for ls in lstates], dtype=np.int64), [ls.rows for ls in lstates],
                pieces, pbin, npc, nopen, npend, bfill, ended)


def _held_at_end(pieces: np.ndarray, pbin: np.ndarray, bopen: np.ndarray, bfill: np.ndarray, fifo: np.ndarray,
                 bst: np.ndarray, st: np.ndarray, cur: np.ndarray, rows: list[int], ended: np.ndarray) -> Held:
    """`Held` where the kernel's walk ended (it stops right after the call's last row: its arrays are the state
    after the call's last step), its pieces of served bins dropped and the bins numbered afresh."""
    P = len(st)
    keep, bins_of, npc = [], [], np.zeros(P, dtype=np.int64)
    for i in range(P):
        made, nb = int(st[i, 3]), int(st[i, 5])
        held = np.concatenate([np.concatenate([bopen[i, g, :o], fifo[i, g, h:t]])
                               for g, (o, h, t) in enumerate(bst[i].tolist())])
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
    return Held(None, cur.copy(), st[:, 0].copy(), rows, out, obin, npc, bst[:, :, 0].copy(),
                bst[:, :, 2] - bst[:, :, 1], bfill.copy(), ended)


def begin(plan: Plan, state: DataState, docs: Any, lanes: list[int], tokens: int, held: type, from_state: Any
          ) -> tuple | None:
    """Where a call of packers the kernel holds in `held`'s form (`Held`, `fusedseqs.Residuals`) starts: (its
    setup, its shards, the plan's carry, the kept call, its queues, the start: the kept call's `held` where this
    call continues the state it returned, else `from_state`'s, and the draws it is expected to make); None where
    the walk's int64 arithmetic could overflow over `tokens` a lane (`Plan.step` takes the call)."""
    setup = fusedmix.call_setup(plan, lanes)
    if setup["big"]:
        return None
    shards = Shards(plan, docs)
    calls = located.Carry.of(plan)
    kept = calls.take(lanes)
    going = kept is not None and isinstance(kept.ended, held) and kept.ended.after is state
    start = kept.ended if going else from_state(plan, shards, state, lanes, kept)
    if fusedmix.overflows(setup, start.cur, tokens):
        return None
    want = int(tokens * 1.25 / max(plan.mean_framed_len, 1.0)) + 2
    q = kept.q if going and kept.q is not None else located.queues(plan, shards, lanes, start.cur, setup["shares"],
                                                                    want, kept)
    return setup, shards, calls, q, start, want


def _bins(plan: Plan, state: DataState, docs: Any, lanes: list[int], n: int, kernel: Any) -> Any:
    m = plan.manifest.packing
    k, L, window = plan.spec.per_lane, m.seq_len, m.window
    P, R, G = len(lanes), n * k, len(plan.packer_keys)
    got = begin(plan, state, docs, lanes, R * L, Held, _from_state)
    if got is None:
        return NotImplemented
    setup, shards, calls, q, start, want = got
    S = setup["S"]
    cur = start.cur.copy()  # (the walk moves it: `start` may be kept by a call that fails)
    cap = max(4 * want, 64) + start.pieces.shape[1]
    pieces = np.zeros((P, cap, 10), dtype=np.int64)
    pbin, fifo = np.zeros((P, cap), dtype=np.int64), np.zeros((P, G, cap), dtype=np.int64)
    held = start.pieces.shape[1]
    pieces[:, :held], pbin[:, :held] = start.pieces, start.pbin
    bopen, bfill = np.zeros((P, G, window), dtype=np.int64), start.bfill.copy()
    bst = np.zeros((P, G, 3), dtype=np.int64)
    bst[:, :, 0], bst[:, :, 2] = start.nopen, start.npend
    base = np.cumsum(start.nopen + start.npend, axis=1) - (start.nopen + start.npend)  # (each packer's first bin)
    for i, g in zip(*np.nonzero(start.nopen + start.npend)):
        b0, o, p = int(base[i, g]), int(start.nopen[i, g]), int(start.npend[i, g])
        bopen[i, g, :o] = np.arange(b0, b0 + o)
        fifo[i, g, :p] = np.arange(b0 + o, b0 + o + p)
    st = np.zeros((P, 6), dtype=np.int64)
    st[:, 0], st[:, 3], st[:, 5] = start.draws, start.npc, (start.nopen + start.npend).sum(axis=1)
    shares = setup["shares"]
    wraps = np.full((P, S), -1, dtype=np.int64)
    opened = np.zeros((P, S, 7), dtype=np.int64)
    rowbin = np.zeros((P, R), dtype=np.int64)
    carry = np.zeros((P, 11), dtype=np.int64)
    snaps = np.zeros((P, n, S, 8), dtype=np.int64)
    meta = np.zeros((P, n, 2), dtype=np.int64)
    bsnap = np.zeros((P, n, G, 3), dtype=np.int64)
    bopens = np.zeros((P, n, G, window), dtype=np.int64)
    done, aside, _, full = kernel.walk_bins.status
    keys, weights, rules, B, frame, masks, mode, col = (setup[x] for x in (
        "keys", "weights", "rules", "B", "frame", "masks", "mode", "col"))
    per_source = bool(plan.per_source_packers)
    while True:
        got, i = kernel.walk_bins(n, k, L, window, per_source, B, frame, masks, mode, keys, col, weights, shares,
                                  rules, cur, st, wraps, *q, opened, pieces, pbin, bopen, bfill, fifo, bst, rowbin,
                                  carry, snaps, meta, bsnap, bopens)
        if got == done:
            break
        if got == aside:
            raise Aside
        if got == full:  # (pieces, their bins and the pending queues grow together: bins <= pieces)
            pieces = np.concatenate([pieces, np.zeros_like(pieces)], axis=1)
            pbin, fifo = (np.concatenate([a, np.zeros_like(a)], axis=a.ndim - 1) for a in (pbin, fifo))
            continue
        q = (*q[:3], fusedmix.refill(plan, shards, lanes, i, int(st[i, 4]), cur, opened, shares, q))
    counts = st[:, 3].copy()
    got = kernel.assemble_bins(plan.framing, m.pad_id, n, k, L, pieces, counts, pbin, rowbin, S,
                               located.tokens_of(shards))
    if got is NotImplemented:
        return NotImplemented
    block, used, rptr, tokens = got
    texts = kernel.bins_texts(snaps, meta, np.asarray(start.rows, dtype=np.int64), k, state.step + 1,
                              *_parts(plan, lanes), start.ended, pieces, pbin, counts, fifo, bsnap, bopens)
    if texts is NotImplemented:
        return NotImplemented
    fusedmix.handed_out(plan, docs, np.concatenate([pieces[i, start.npc[i]:counts[i]] for i in range(P)]), S)
    z = np.zeros(0, dtype=np.int64)
    # (every row's tokens per source, one source too: the producer's counts then read no sample ID)
    row_tokens = tokens.reshape(P, n, k, S).transpose(1, 0, 2, 3).reshape(n * P * k, S)
    fused = FusedSteps(first=state.step + 1, lanes=lanes, k=k, L=L, block=block, state_dicts=StateTexts(texts),
                       keys=z, owners=[], sids=[], entry_start=z, entry_off=z, bound_global=z,
                       packed=rows(plan, block, used, rptr, P, n, k, L), row_tokens=row_tokens)
    end = _held_at_end(pieces, pbin, bopen, bfill, fifo, bst, st, cur, [r + R for r in start.rows], start.ended)
    end.after = fused.state(n - 1)
    calls.keep(lanes, q, end.located(), end)
    return fused


def _parts(plan: Plan, lanes: list[int]) -> tuple:
    """`jit.state_parts` of a best-fit state of these lanes and its packers' keys (kept with the plan's carry)."""
    setup = located.Carry.of(plan).setup(lanes)
    got = setup.get("bins_parts")
    if got is None:
        got = setup["bins_parts"] = (state_parts(plan.dataset_id, plan.runspec_digest, lanes, "bins"),
                                     packer_keys(plan.packer_keys, b'"ended":'))
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
