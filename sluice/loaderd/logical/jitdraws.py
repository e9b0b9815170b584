"""The fast path's draws as numba kernels: which documents every lane takes; imported only by `jitload.load`.

- `walk`: every lane's concat draws of a call (as `LaneMachine` draws them), handing
  back to Python only to locate more positions of a source (`located`); its
  pieces go to `jitrows.assemble`;
- `walk_bins`: the same draws (`_draw`, one draw of either walk) for a best-fit
  call, pulled only while no row is pending and placed in bins as
  `packing.BestfitPacker` places them (or, with one packer per source, a
  row's source picked first and its packer pulling that source's pieces); its
  rows go to `jitrows.assemble_bins`;
- `walk_seqs`: one concat packer per source (unit `sequences`): a row a
  draw, filled from its source's residual and next documents (`_take`, the
  source's draw every walk makes); its rows go to `jitrows.assemble_bins`
  too (each row a full bin);
- `feistel_many`: for the orders (`order.Feistel.forward_many`, once
  `jitload.load` hands it over), a chunk of lane positions through the keyed
  permutation (8 lanes x 1,024 positions: ~1.2 ms of numpy's uint64 rounds,
  holding the GIL, every 1,024 steps of a lane group).

Both mix with splitmix64 (its constants below), all ``nogil``.

Why one module of ~560 lines: the three walks call the same `_walk_pick`,
`_take` and `_draw`, and a numba kernel may call only kernels of its own
file (below), so splitting the walks apart would copy those; and each kernel
module is one face of `jit.Kernel`, one part of the ahead-of-time module's
key and exports (`jitaot.EXPORTS`) and one source of `jitload.uncompiled`.
The seam if it grows: `feistel_many`, which calls nothing else here.

Two decorators. `_jit`: the kernels Python calls and those that allocate an
array. `_lean` (numba's runtime off, ``_nrt=False``): what they call once a
draw or a piece, and the lanes' walks, none of which allocates or returns an
array (numba refuses to compile one that allocates). Numba counts references
to an array with calls into its runtime: a function's array argument is
counted at its entry and again at its end, and so is every view it takes;
its pruning pass left most of those pairs in place here (a draw handed about
25 arrays and views down `_draw`, `_take` and `_walk_pick`). A lean function
counts none (its arrays stay alive in its caller): the producer's CPU a step
12-19% less with piece draws from one or five sources, 7% with best-fit
(`bench/fused_mix.py`; bench/results/README.md, "Stop 42").

Importing this module imports numba (0.2-0.4 s) and makes the dispatchers;
nothing is compiled until `jitload.load` warms them (or loads them from numba's
on-disk cache). Its kernels call no kernel of another module: numba's cache
checks only the source file of the function it compiled, so a call into
another file would run that file's old code after an edit of it.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_jit = nb.njit(nogil=True, cache=True)
_lean = nb.njit(nogil=True, cache=True, _nrt=False)  # (no reference counts: the module docstring)

_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@_jit
def feistel_many(xs, keys, half, mask, n, out):
    """`order.Feistel.forward` of every position of `xs` (int64, all in [0, n)) into `out`: the rounds of
    `keys` (uint64) on the halves (`half` bits, `mask`), cycle-walking until the value is inside [0, n); all
    arithmetic modulo 2**64 as `order.mix64`'s."""
    for i in range(xs.shape[0]):
        y = np.uint64(xs[i])
        while True:
            left = y >> half
            right = y & mask
            for j in range(keys.shape[0]):
                z = right ^ keys[j]
                z = (z ^ (z >> _S30)) * _C1
                z = (z ^ (z >> _S27)) * _C2
                z = z ^ (z >> _S31)
                z = (z & mask) ^ left
                left = right
                right = z
            y = (left << half) | right
            if y < n:
                break
        out[i] = np.int64(y)


WALK_DONE, WALK_ASIDE, WALK_NEED, WALK_FULL = 0, 1, 2, 3  # `walk`'s status (as `jit.WALK_*`, which Python reads)
_INACTIVE = 4  # `_take`'s: the source just became inactive (its share taken under renormalize, or an empty share)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@_lean
def _mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@_lean
def _walk_pick(mode, key, draws, weights, live, cur, col):
    """`LaneMachine._pick` among the sources `live` marks (S; the cursors' active column, or with a best-fit
    packer per source also those whose packer holds rows), on the cursors `cur` (S, 8): mode 0 quota by tokens
    (largest deficit), 1 quota by a counted unit (the chairman rule, else the largest deficit), 2 categorical
    (the counter RNG at `draws`; the caller guarantees a live weight total <= 2**32). -1 when none is live."""
    S = weights.shape[0]
    if mode == 2:
        tw = 0
        for s in range(S):
            if live[s]:
                tw += weights[s]
        if tw == 0:
            return -1
        u = _mix64(_mix64(key ^ np.uint64(draws)) ^ _GOLD)
        W = np.uint64(tw)
        hi, lo = u >> _S32, u & _M32
        target = np.int64((hi * W + ((lo * W) >> _S32)) >> _S32)
        acc = 0
        for s in range(S):
            if live[s]:
                acc += weights[s]
                if target < acc:
                    return s
        return -1
    tw = 0
    total = 0
    k = 0
    for s in range(S):
        if live[s] and weights[s]:
            tw += weights[s]
            total += cur[s, col]
            k += 1
    if tw == 0:
        return -1
    if mode == 1 and k > 1:
        t = total + 1
        m = 2 * k - 2
        best, best_num, best_den = -1, 0, 1
        for s in range(S):
            w = weights[s]
            if live[s] and w and m * (w * t - tw * cur[s, col]) >= tw:
                num, den = m * cur[s, col] + (m - 1), w
                if best < 0 or num * best_den < best_num * den:
                    best, best_num, best_den = s, num, den
        if best >= 0:
            return best
    best, best_score = -1, 0
    for s in range(S):
        w = weights[s]
        if live[s] and w:
            score = w * total - tw * cur[s, col]
            if best < 0 or score > best_score:
                best, best_score = s, score
    return best


@_jit
def walk(n, T, B, frame, masks_eos, mode, keys, col, weights, shares, rules, cur, st, wraps, qfirst, qlen, qepoch,
         qdata, opened, pieces, snaps, meta):
    """`_walk_lane` for every lane of a call whose walk is not done (``st[i, 2] < n``): every array argument but
    `weights` and `rules` with a leading lane axis. Returns (WALK_DONE, -1), or the first other status and its
    lane (the caller acts on it and calls again: done lanes are skipped)."""
    for i in range(cur.shape[0]):
        if st[i, 2] >= n:
            continue
        got = _walk_lane(n, T, B, frame, masks_eos, mode, keys[i], col, weights, shares[i], rules, cur[i], st[i],
                         wraps[i], qfirst[i], qlen[i], qepoch[i], qdata[i], opened[i], pieces[i], snaps[i], meta[i])
        if got != WALK_DONE:
            return got, i
    return WALK_DONE, -1


@_lean
def _draw(B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, draws, wraps, qfirst, qlen, qepoch, qdata,
          opened, pc):
    """One draw of a lane (`LaneMachine._pull_mixed`: pick, then `_take`) into `pc`, the cursors `cur` (S, 8)
    moved. Returns WALK_DONE (drawn: the caller counts the draw), WALK_NEED with ``pc[0] = s`` (fill s's queue,
    then draw again: nothing was moved that a new try repeats) or WALK_ASIDE. `_walk_lane` documents the other
    arguments."""
    while True:
        s = _walk_pick(mode, key, draws, weights, cur[:, 2], cur, col)
        if s < 0:
            return WALK_ASIDE
        got = _take(s, B, frame, masks_eos, shares, rules, cur, wraps, qfirst, qlen, qepoch, qdata, opened, pc)
        if got != _INACTIVE:
            return got


@_lean
def _take(s, B, frame, masks_eos, shares, rules, cur, wraps, qfirst, qlen, qepoch, qdata, opened, pc):
    """Source s's next draw (`LaneMachine._take`: its open document or next position, exhaustion, the piece's
    cut, the realized counts) into `pc` (source, epoch, index, object, record, first token, count, framed off,
    end, framed length). Returns WALK_DONE, WALK_NEED (``pc[0] = s``; nothing moved), WALK_ASIDE (a `stop` or
    `fail` source exhausted, a `repeat` epoch that drew no token, an open offset past its document) or
    `_INACTIVE` (s just became inactive: ``cur[s, 2] = 0``)."""
    S = cur.shape[0]
    off = cur[s, 7]
    if off != 0:
        if opened[s, 0] == 0:
            p = cur[s, 1] - 1
            if p < 0 or p >= shares[s]:
                return WALK_ASIDE
            if qepoch[s] != cur[s, 0] or not qfirst[s] <= p < qfirst[s] + qlen[s]:
                pc[0] = s
                return WALK_NEED
            r = p - qfirst[s]
            opened[s, 0] = 1
            opened[s, 1] = cur[s, 0]
            for x in range(5):
                opened[s, 2 + x] = qdata[s, r, x]
        e, idx, obj, rec, a, nt = opened[s, 1], opened[s, 2], opened[s, 3], opened[s, 4], \
            opened[s, 5], opened[s, 6]
    else:
        if cur[s, 1] >= shares[s]:
            if rules[s] == 0 and shares[s] > 0:
                tot = 0
                for x in range(S):
                    tot += cur[x, 4]
                if wraps[s] == tot:
                    return WALK_ASIDE
                wraps[s] = tot
                cur[s, 0] += 1
                cur[s, 1] = 0
            elif rules[s] <= 1:
                cur[s, 2] = 0
                return _INACTIVE
            else:
                return WALK_ASIDE
        p = cur[s, 1]
        if qepoch[s] != cur[s, 0] or not qfirst[s] <= p < qfirst[s] + qlen[s]:
            pc[0] = s
            return WALK_NEED
        r = p - qfirst[s]
        e, idx, obj, rec, a, nt = cur[s, 0], qdata[s, r, 0], qdata[s, r, 1], qdata[s, r, 2], \
            qdata[s, r, 3], qdata[s, r, 4]
        cur[s, 1] += 1
        cur[s, 3] += 1
    length = nt + frame
    if off != 0 and off >= length:
        return WALK_ASIDE
    end = length if B == 0 or length - off <= B else off + B
    if end == length:
        cur[s, 7] = 0
        opened[s, 0] = 0
    else:
        cur[s, 7] = end
        opened[s, 0] = 1
        opened[s, 1] = e
        opened[s, 2] = idx
        opened[s, 3] = obj
        opened[s, 4] = rec
        opened[s, 5] = a
        opened[s, 6] = nt
    cur[s, 4] += end - off
    loss = min(end, length - 1) - off
    if loss < 0:
        loss = 0
    if masks_eos and length >= 2 and off <= length - 2 < end:
        loss -= 1
    cur[s, 5] += loss
    pc[0], pc[1], pc[2], pc[3], pc[4] = s, e, idx, obj, rec
    pc[5], pc[6], pc[7], pc[8], pc[9] = a, nt, off, end, length
    return WALK_DONE


@_lean
def _walk_lane(n, T, B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, st, wraps, qfirst, qlen, qepoch,
               qdata, opened, pieces, snaps, meta):
    """One lane's concat draws for steps ``st[2] .. n - 1`` of a call, as `LaneMachine._pull_mixed` makes them
    (`LaneMachine`'s pick, open document, exhaustion, piece cut, realized counts: `_draw`), resumable.

    `cur` (S, 8) the cursors, `st` [draws, stream total, next step, pieces made, source needed] and `wraps`
    (S; -1: none) the walk's state, all updated in place. Source s's queue: its positions ``qfirst[s] ..
    + qlen[s] - 1`` of epoch ``qepoch[s]`` as `qdata[s]` rows (index, object, record, first token, count);
    `opened[s]` (valid, epoch, index, object, record, first token, count) its open document once known.
    `rules`: 0 repeat, 1 renormalize, 2 stop or fail. `B` the piece bound (0: whole documents). Writes
    `pieces` rows (source, epoch, index, object, record, first token, count, framed off, end, framed length)
    and per step j the cursors `snaps[j]` and `meta[j]` (draws, residual?, its source, epoch, index, offset,
    end). Returns WALK_DONE; WALK_NEED with ``st[4] = s`` (fill s's queue from the cursor: its open
    document's position if one is open and not known, else its next; then call again); WALK_FULL (more
    `pieces` rows); WALK_ASIDE (what `shards.Aside` stands for).
    """
    S = weights.shape[0]
    draws, total, j, npc = st[0], st[1], st[2], st[3]
    cap = pieces.shape[0]
    while j < n:
        b = (j + 1) * T
        while total < b:
            if npc >= cap:
                st[0], st[1], st[2], st[3] = draws, total, j, npc
                return WALK_FULL
            pc = pieces[npc]
            got = _draw(B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, draws, wraps, qfirst, qlen,
                        qepoch, qdata, opened, pc)
            if got == WALK_NEED:
                st[0], st[1], st[2], st[3], st[4] = draws, total, j, npc, pc[0]
                return WALK_NEED
            if got != WALK_DONE:
                return got
            draws += 1
            if pc[8] > pc[7]:  # (an empty piece is not kept: the next draw writes over it)
                npc += 1
                total += pc[8] - pc[7]
        for x in range(S):
            for y in range(8):
                snaps[j, x, y] = cur[x, y]
        m = meta[j]
        m[0] = draws
        if total > b:
            pc = pieces[npc - 1]
            m[1], m[2], m[3], m[4], m[5], m[6] = 1, pc[0], pc[1], pc[2], pc[8] - (total - b), pc[8]
        else:
            m[1] = 0
        j += 1
    st[0], st[1], st[2], st[3] = draws, total, j, npc
    return WALK_DONE


@_jit
def walk_bins(n, k, L, window, per_source, B, frame, masks_eos, mode, keys, col, weights, shares, rules, cur, st, wraps,
              qfirst, qlen, qepoch, qdata, opened, pieces, pbin, bopen, bfill, fifo, bst, rowbin, carry, snaps, meta,
              bsnap, bopens):
    """`_bins_lane` for every lane of a best-fit call whose rows are not all made (``st[i, 2] < n * k``); as
    `walk`, every array argument but `weights` and `rules` with a leading lane axis."""
    live = np.empty(weights.shape[0], dtype=np.int64)  # (`_bins_lane`'s scratch: it allocates nothing)
    for i in range(cur.shape[0]):
        if st[i, 2] >= n * k:
            continue
        got = _bins_lane(n, k, L, window, per_source, B, frame, masks_eos, mode, keys[i], col, weights, shares[i],
                         rules, cur[i], st[i], wraps[i], qfirst[i], qlen[i], qepoch[i], qdata[i], opened[i], pieces[i],
                         pbin[i], bopen[i], bfill[i], fifo[i], bst[i], rowbin[i], carry[i], snaps[i], meta[i], bsnap[i],
                         bopens[i], live)
        if got != WALK_DONE:
            return got, i
    return WALK_DONE, -1


@_lean
def _drop(bopen, bfill, x, nopen):
    """Open bin x out of the open bins (closed), the younger ones moved up; returns the open bins left."""
    for y in range(x, nopen - 1):
        bopen[y] = bopen[y + 1]
        bfill[y] = bfill[y + 1]
    return nopen - 1


@_lean
def _bins_lane(n, k, L, window, per_source, B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, st,
               wraps, qfirst, qlen, qepoch, qdata, opened, pieces, pbin, bopen, bfill, fifo, bst, rowbin, carry, snaps,
               meta, bsnap, bopens, live):
    """One lane's best-fit rows ``st[2] .. n * k - 1`` of a call, as `packing.BestfitPacker.next_row` makes them,
    resumable: with one packer (`per_source` False) from the draws of `_draw`, pulled only while no row is
    pending; with one packer per source (unit `sequences`, `LaneMachine.next_pieces`) each row picks its source
    (one draw), whose packer pulls that source's next pieces (`_take`) while it has no row pending.

    `st` [draws, the row's packer + 1 (per source; 0: not picked yet), rows made, pieces made, source needed,
    bins made]. A piece row of `pieces` (as `_walk_lane`'s) is one a packer holds: a chunk of ``L`` tokens (a
    row of its own) or a placed remainder; `pbin[r]` its bin. Bins are numbered as made; packer g's open ones
    are ``bopen[g, :bst[g, 0]]`` oldest first, `bfill[g]` their tokens, its closed ones not yet served
    ``fifo[g, bst[g, 1]:bst[g, 2]]`` in closing order; `rowbin[q]` the bin served as the lane's row q of the
    call. `carry` [pending?, piece (10)] the drawn piece whose chunks and placement are not all done (the call
    ran out of `pieces` rows: WALK_FULL); it is placed whole before a row is served, as the packer places a
    draw. After the row ending step j: `snaps[j]` the cursors, `meta[j]` [draws, pieces made], `bsnap[j]` the
    packers' `bst`, `bopens[j]` their open bins. Statuses as
    `_walk_lane`'s (`pieces`, `pbin` and `fifo` grow together); WALK_ASIDE also where a source's packer would
    end (its source exhausted: `Plan.step` flushes it). A source that ran out stays pickable while its packer
    holds flushed rows (`LaneMachine._active`).
    """
    S = weights.shape[0]
    draws, g, q, npc, nb = st[0], st[1] - 1, st[2], st[3], st[5]
    cap = pieces.shape[0]
    R = n * k
    while q < R:
        if not per_source:
            g = 0
        elif g < 0:
            for x in range(S):  # (a source that ran out stays live while its packer holds flushed rows)
                live[x] = 1 if cur[x, 2] != 0 or bst[x, 1] < bst[x, 2] else 0
            g = _walk_pick(mode, key, draws, weights, live, cur, col)
            if g < 0:
                return WALK_ASIDE
            draws += 1
        nopen, head, tail = bst[g, 0], bst[g, 1], bst[g, 2]
        while head == tail or carry[0] != 0:  # (a draw cut short by WALK_FULL is placed whole first)
            if carry[0] == 0:
                if per_source:
                    got = _take(g, B, frame, masks_eos, shares, rules, cur, wraps, qfirst, qlen, qepoch, qdata, opened,
                                carry[1:])
                else:
                    got = _draw(B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, draws, wraps, qfirst,
                                qlen, qepoch, qdata, opened, carry[1:])
                if got != WALK_DONE:
                    if got == _INACTIVE:
                        got = WALK_ASIDE
                    st[0], st[1], st[2], st[3], st[4], st[5] = draws, g + 1, q, npc, carry[1], nb
                    bst[g, 0], bst[g, 1], bst[g, 2] = nopen, head, tail
                    return got
                if not per_source:
                    draws += 1
                carry[0] = 1
            off, end = carry[8], carry[9]
            while end - off > 0:
                if npc >= cap:
                    carry[8] = off
                    st[0], st[1], st[2], st[3], st[5] = draws, g + 1, q, npc, nb
                    bst[g, 0], bst[g, 1], bst[g, 2] = nopen, head, tail
                    return WALK_FULL
                pc = pieces[npc]
                for x in range(10):
                    pc[x] = carry[1 + x]
                pc[7] = off
                if end - off >= L:  # a chunk of a whole row: a bin of its own, closed
                    pc[8] = off + L
                    pbin[npc] = nb
                    fifo[g, tail] = nb
                    tail += 1
                    nb += 1
                    npc += 1
                    off += L
                    continue
                r = end - off
                best, best_room = -1, L + 1
                for x in range(nopen):
                    room = L - bfill[g, x]
                    if r <= room < best_room:
                        best, best_room = x, room
                if best >= 0:
                    pbin[npc] = bopen[g, best]
                    if best_room == r:  # exactly full: closed at once
                        fifo[g, tail] = bopen[g, best]
                        tail += 1
                        nopen = _drop(bopen[g], bfill[g], best, nopen)
                    else:
                        bfill[g, best] += r
                else:
                    if nopen >= window:  # the fullest (ties: the oldest) closes first
                        full = 0
                        for x in range(1, nopen):
                            if bfill[g, x] > bfill[g, full]:
                                full = x
                        fifo[g, tail] = bopen[g, full]
                        tail += 1
                        nopen = _drop(bopen[g], bfill[g], full, nopen)
                    bopen[g, nopen] = nb
                    bfill[g, nopen] = r
                    nopen += 1
                    pbin[npc] = nb
                    nb += 1
                npc += 1
                off = end
            carry[0] = 0
        rowbin[q] = fifo[g, head]
        head += 1
        bst[g, 0], bst[g, 1], bst[g, 2] = nopen, head, tail
        if per_source:
            cur[g, 6] += 1
            g = -1
        q += 1
        if q % k == 0:
            j = q // k - 1
            for x in range(S):
                for y in range(8):
                    snaps[j, x, y] = cur[x, y]
            meta[j, 0], meta[j, 1] = draws, npc
            for x in range(bst.shape[0]):
                for y in range(3):
                    bsnap[j, x, y] = bst[x, y]
                for y in range(bst[x, 0]):
                    bopens[j, x, y] = bopen[x, y]
    st[0], st[1], st[2], st[3], st[5] = draws, 0, q, npc, nb
    return WALK_DONE


@_jit
def walk_seqs(n, k, L, B, frame, masks_eos, mode, keys, col, weights, shares, rules, cur, st, wraps, qfirst, qlen,
              qepoch, qdata, opened, resid, pieces, pbin, snaps, meta, rsnaps):
    """`_seqs_lane` for every lane of a call with one concat packer per source (unit `sequences`) whose rows are
    not all made (``st[i, 2] < n * k``); as `walk`, every array argument but `weights` and `rules` with a
    leading lane axis."""
    for i in range(cur.shape[0]):
        if st[i, 2] >= n * k:
            continue
        got = _seqs_lane(n, k, L, B, frame, masks_eos, mode, keys[i], col, weights, shares[i], rules, cur[i], st[i],
                         wraps[i], qfirst[i], qlen[i], qepoch[i], qdata[i], opened[i], resid[i], pieces[i], pbin[i],
                         snaps[i], meta[i], rsnaps[i])
        if got != WALK_DONE:
            return got, i
    return WALK_DONE, -1


@_lean
def _seqs_lane(n, k, L, B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, st, wraps, qfirst, qlen,
               qepoch, qdata, opened, resid, pieces, pbin, snaps, meta, rsnaps):
    """One lane's rows ``st[2] .. n * k - 1`` of a call with one concat packer per source, as
    `LaneMachine.next_pieces` makes them: each row picks its source (one draw), whose packer fills it from its
    residual, then from the source's own next pieces (`_take`; empty ones skipped); a source that becomes
    inactive mid-row drops the row's pieces (`packing.ConcatPacker`: steps are whole) and the row picks again.
    Resumable.

    `st` [draws, -, rows made, pieces made, source needed, the row's source + 1 (0: not picked yet), its fill,
    its first piece]. `resid` (S, 11) each source's residual [held?, piece (10)]. Writes `pieces` (as
    `_walk_lane`'s, each inside one row) and `pbin[r]`, the call's row of piece r. After the row ending step
    j: `snaps[j]` the cursors, `meta[j, 0]` the draws, `rsnaps[j]` the residuals. Statuses as `_walk_lane`'s
    (WALK_ASIDE also where every source is exhausted: `Plan.step` ends the stream)."""
    draws, q, npc = st[0], st[2], st[3]
    s, fill, first = st[5] - 1, st[6], st[7]
    cap = pieces.shape[0]
    R = n * k
    while q < R:
        if s < 0:
            s = _walk_pick(mode, key, draws, weights, cur[:, 2], cur, col)
            if s < 0:
                return WALK_ASIDE
            draws += 1
            fill, first = 0, npc
        r = resid[s]
        while fill < L:
            if r[0] == 0:
                got = _take(s, B, frame, masks_eos, shares, rules, cur, wraps, qfirst, qlen, qepoch, qdata, opened,
                            r[1:])
                if got == _INACTIVE:  # (the row's pieces dropped; the row picks again)
                    npc, s = first, -1
                    break
                if got != WALK_DONE:
                    st[0], st[2], st[3], st[4], st[5], st[6], st[7] = draws, q, npc, s, s + 1, fill, first
                    return got
                if r[9] == r[8]:  # (an empty piece: the packer pulls again)
                    continue
                r[0] = 1
            if npc >= cap:
                st[0], st[2], st[3], st[5], st[6], st[7] = draws, q, npc, s + 1, fill, first
                return WALK_FULL
            pc = pieces[npc]
            for x in range(10):
                pc[x] = r[1 + x]
            take = min(r[9] - r[8], L - fill)
            pc[8] = r[8] + take
            pbin[npc] = q
            npc += 1
            fill += take
            if pc[8] == r[9]:
                r[0] = 0
            else:
                r[8] = pc[8]
        if s < 0:
            continue
        cur[s, 6] += 1
        s = -1
        q += 1
        if q % k == 0:
            j = q // k - 1
            for x in range(cur.shape[0]):
                for y in range(8):
                    snaps[j, x, y] = cur[x, y]
                for y in range(11):
                    rsnaps[j, x, y] = resid[x, y]
            meta[j, 0] = draws
    st[0], st[2], st[3], st[5], st[6], st[7] = draws, q, npc, 0, 0, 0
    return WALK_DONE
