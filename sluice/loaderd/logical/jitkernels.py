"""The fast path's concat walk and rows (`fusedmix`) as numba kernels; imported only by `jitload.load`.

Importing this module imports numba (0.2-0.4 s) and makes the dispatchers;
nothing is compiled until `jitload.load` warms them (or loads them from numba's
on-disk cache). The kernels of a call, all ``nogil``:

- `walk`: every lane's draws of the call (as `walk.Lane.pull` draws them), handing
  back to Python only to locate more positions of a source;
- `assemble`: from the walked pieces, the frame tokens (bos/eos) written into
  the block, the list of document-token copies, the label cells to mask and
  the cut targets, the piece starts (keys, owners, lane-major positions) and
  the position plane;
- `gather`: the copies of one object's tokens into the block's token plane
  (one call per object touched: numba takes one array per argument, and the
  objects' token arrays are separate memory maps), and the token after each
  lane's last position where it is a document token;
- `finish`: the label plane (tokens shifted; the next step's first token, or
  the token after the call) and the masked cells.

And one for the orders (`order.Feistel.forward_many`, once `jitload.load`
hands it over): `feistel_many`, a chunk of lane positions through the keyed
permutation (8 lanes x 1,024 positions: ~1.2 ms of numpy's uint64 rounds,
holding the GIL, every 1,024 steps of a lane group).

Why over 450 lines: numba takes one compiled module's functions together
(one cache, one warm-up, one switch-off of compiling), and the kernels share
the block layout below and their per-piece helpers.

Layout: pieces lane-major; a lane's stream position p of step j = p // T lies
in the block at flat index ``j * 3PT + lane * T + p % T`` (token plane), + PT
(labels), + 2PT (positions).
"""

from __future__ import annotations

import numba as nb
import numpy as np

IGNORE = -100

_jit = nb.njit(nogil=True, cache=True)


@_jit
def _add_copy(copies, nc, src, lane, pos, ln, obj):
    """Row nc of `copies` (source token index, lane, lane position, length, object); returns nc + 1."""
    copies[nc, 0] = src
    copies[nc, 1] = lane
    copies[nc, 2] = pos
    copies[nc, 3] = ln
    copies[nc, 4] = obj
    return nc + 1


@_jit
def _label_cell(pm, i, T, PT, PT3):
    """Flat index of lane i's stream position pm in the label plane of the step-major block."""
    return (pm // T) * PT3 + PT + i * T + pm % T


@_jit
def _piece_tokens(block, copies, nc, i, p0, a, b, fl, nt, t0, obj, lead, trail, bos, eos, T, PT3):
    """Framed range [a, b) of a document (`nt` ids from token `t0` of object `obj`; `fl` framed) at lane i's
    stream position p0: its bos / eos into the token plane, its ids as one copy. Returns the copies made."""
    if lead and a == 0 and b > 0:
        block[(p0 // T) * PT3 + i * T + p0 % T] = bos
    x0 = max(a, lead)
    x1 = min(b, lead + nt)
    if x1 > x0:
        nc = _add_copy(copies, nc, t0 + x0 - lead, i, p0 + x0 - a, x1 - x0, obj)
    if trail and b == fl:
        pe = p0 + fl - 1 - a
        block[(pe // T) * PT3 + i * T + pe % T] = eos
    return nc


@_jit
def _last_target(copies, nc, nexts, i, b, fl, t0, obj, lead, trail, bos, eos, NT):
    """The token after lane i's call: framed token b of its last document (0 past its end) into `nexts[i]`,
    or a copy `gather` makes. Returns the copies made."""
    if b >= fl:
        nexts[i] = 0
    elif lead and b == 0:
        nexts[i] = bos
    elif trail and b == fl - 1:
        nexts[i] = eos
    else:
        nc = _add_copy(copies, nc, t0 + b - lead, i, NT, 1, obj)
    return nc


@_jit
def _piece_starts(block, n, P, T, L, lane_start, first, last, starts, ends):
    """Every row start and every entry start inside a row (lane i's entries ``first[i] .. last[i]``, their
    lane-major `starts` / `ends`; its stream from ``lane_start[i]``), step-major: (keys, owner entries, lane-major
    positions); the position plane of `block` restarts at each."""
    PT = P * T
    PT3 = 3 * PT
    NT = n * T
    dcount = 0
    for i in range(P):
        for e in range(first[i] + 1, last[i] + 1):
            p = starts[e] - lane_start[i]
            if p < NT and p % L != 0:
                dcount += 1
    nk = n * P * (T // L) + dcount
    keys = np.empty(nk, dtype=np.int64)
    owners = np.empty(nk, dtype=np.int64)
    glob = np.empty(nk, dtype=np.int64)
    dnext = first + 1  # per lane: its next entry to place
    optr = first.copy()  # per lane: the entry owning its last piece
    b = 0
    for j in range(n):
        for i in range(P):
            ls = lane_start[i]
            p = j * T
            end = (j + 1) * T
            while p < end:
                keys[b] = j * PT + i * T + p - j * T
                g = ls + p
                glob[b] = g
                while ends[optr[i]] <= g:
                    optr[i] += 1
                owners[b] = optr[i]
                b += 1
                # the next piece start: the next row start or the next entry start inside this row
                nxt = (p // L + 1) * L
                while dnext[i] <= last[i]:
                    d = starts[dnext[i]] - ls
                    if d <= p or d % L == 0:
                        dnext[i] += 1
                        continue
                    if d < nxt:
                        nxt = d
                    break
                w = nxt - p
                base = j * PT3 + 2 * PT + i * T + p - j * T
                pos = block[base:base + w]
                for x in range(w):
                    pos[x] = x
                p = nxt
    return keys, owners, glob


@_jit
def gather(toks, obj, copies, block, nexts, T, NT, PT3):
    """The copies of object `obj` (rows of `copies` naming it) from `toks` into the block's token plane."""
    for c in range(copies.shape[0]):
        if copies[c, 4] != obj:
            continue
        src, i, p, ln = copies[c, 0], copies[c, 1], copies[c, 2], copies[c, 3]
        if p == NT:
            nexts[i] = toks[src]
            continue
        while ln > 0:  # (slices: a loop over views from 0 vectorizes; offsets added to x did not)
            t = p % T
            w = min(ln, T - t)
            base = (p // T) * PT3 + i * T + t
            dst, got = block[base:base + w], toks[src:src + w]
            for x in range(w):
                dst[x] = got[x]
            src += w
            p += w
            ln -= w


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@_jit
def feistel_many(xs, keys, half, mask, n, out):
    """`order.Feistel.forward` of every position of `xs` (int64, all in [0, n)) into `out`: the rounds of
    `keys` (uint64) on the halves (`half` bits, `mask`), cycle-walking until the value is inside [0, n); all
    arithmetic modulo 2**64 as `order.mix64_array`'s."""
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


@_jit
def finish(block, nexts, marks, P, n, T):
    """The label plane: each lane's tokens shifted by one (across steps), `nexts` after the last; then -100 at
    `marks`."""
    PT = P * T
    PT3 = 3 * PT
    for j in range(n):
        for i in range(P):
            src = j * PT3 + i * T
            tok, lab = block[src + 1:src + T], block[src + PT:src + PT + T - 1]
            for x in range(T - 1):
                lab[x] = tok[x]
            block[src + PT + T - 1] = block[src + PT3] if j < n - 1 else nexts[i]
    for m in range(marks.shape[0]):
        block[marks[m]] = IGNORE


WALK_DONE, WALK_ASIDE, WALK_NEED, WALK_FULL = 0, 1, 2, 3  # `walk`'s status
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@_jit
def _mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@_jit
def _walk_pick(mode, key, draws, weights, cur, col):
    """`LaneMachine._pick` on the cursors `cur` (S, 8): mode 0 quota by tokens (largest deficit), 1 quota by a
    counted unit (the chairman rule, else the largest deficit), 2 categorical (the counter RNG at `draws`;
    the caller guarantees an active weight total <= 2**32). -1 when no source is active."""
    S = weights.shape[0]
    if mode == 2:
        tw = 0
        for s in range(S):
            if cur[s, 2]:
                tw += weights[s]
        if tw == 0:
            return -1
        u = _mix64(_mix64(key ^ np.uint64(draws)) ^ _GOLD)
        W = np.uint64(tw)
        hi, lo = u >> _S32, u & _M32
        target = np.int64((hi * W + ((lo * W) >> _S32)) >> _S32)
        acc = 0
        for s in range(S):
            if cur[s, 2]:
                acc += weights[s]
                if target < acc:
                    return s
        return -1
    tw = 0
    total = 0
    k = 0
    for s in range(S):
        if cur[s, 2] and weights[s]:
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
            if cur[s, 2] and w and m * (w * t - tw * cur[s, col]) >= tw:
                num, den = m * cur[s, col] + (m - 1), w
                if best < 0 or num * best_den < best_num * den:
                    best, best_num, best_den = s, num, den
        if best >= 0:
            return best
    best, best_score = -1, 0
    for s in range(S):
        w = weights[s]
        if cur[s, 2] and w:
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


@_jit
def _walk_lane(n, T, B, frame, masks_eos, mode, key, col, weights, shares, rules, cur, st, wraps, qfirst, qlen, qepoch,
               qdata, opened, pieces, snaps, meta):
    """One lane's concat draws for steps ``st[2] .. n - 1`` of a call, as `walk.Lane.pull` makes them
    (`LaneMachine`'s pick, open document, exhaustion, piece cut, realized counts), resumable.

    `cur` (S, 8) the cursors, `st` [draws, stream total, next step, pieces made, source needed] and `wraps`
    (S; -1: none) the walk's state, all updated in place. Source s's queue: its positions ``qfirst[s] ..
    + qlen[s] - 1`` of epoch ``qepoch[s]`` as `qdata[s]` rows (index, object, record, first token, count);
    `opened[s]` (valid, epoch, index, object, record, first token, count) its open document once known.
    `rules`: 0 repeat, 1 renormalize, 2 stop or fail. `B` the piece bound (0: whole documents). Writes
    `pieces` rows (source, epoch, index, object, record, first token, count, framed off, end, framed length)
    and per step j the cursors `snaps[j]` and `meta[j]` (draws, residual?, its source, epoch, index, offset,
    end). Returns WALK_DONE; WALK_NEED with ``st[4] = s`` (fill s's queue from the cursor: its open
    document's position if one is open and not known, else its next; then call again); WALK_FULL (more
    `pieces` rows); WALK_ASIDE (what `walk.Aside` stands for).
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
            while True:
                s = _walk_pick(mode, key, draws, weights, cur, col)
                if s < 0:
                    return WALK_ASIDE
                off = cur[s, 7]
                if off != 0:
                    if opened[s, 0] == 0:
                        p = cur[s, 1] - 1
                        if p < 0 or p >= shares[s]:
                            return WALK_ASIDE
                        if qepoch[s] != cur[s, 0] or not qfirst[s] <= p < qfirst[s] + qlen[s]:
                            st[0], st[1], st[2], st[3], st[4] = draws, total, j, npc, s
                            return WALK_NEED
                        r = p - qfirst[s]
                        opened[s, 0] = 1
                        opened[s, 1] = cur[s, 0]
                        for x in range(5):
                            opened[s, 2 + x] = qdata[s, r, x]
                    e, idx, obj, rec, a, nt = opened[s, 1], opened[s, 2], opened[s, 3], opened[s, 4], \
                        opened[s, 5], opened[s, 6]
                    break
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
                        continue
                    else:
                        return WALK_ASIDE
                p = cur[s, 1]
                if qepoch[s] != cur[s, 0] or not qfirst[s] <= p < qfirst[s] + qlen[s]:
                    st[0], st[1], st[2], st[3], st[4] = draws, total, j, npc, s
                    return WALK_NEED
                r = p - qfirst[s]
                e, idx, obj, rec, a, nt = cur[s, 0], qdata[s, r, 0], qdata[s, r, 1], qdata[s, r, 2], \
                    qdata[s, r, 3], qdata[s, r, 4]
                cur[s, 1] += 1
                cur[s, 3] += 1
                break
            draws += 1
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
            if end > off:
                pc = pieces[npc]
                pc[0], pc[1], pc[2], pc[3], pc[4] = s, e, idx, obj, rec
                pc[5], pc[6], pc[7], pc[8], pc[9] = a, nt, off, end, length
                npc += 1
                total += end - off
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
def assemble(P, n, T, L, lead, trail, masks_eos, bos, eos, pieces, counts, totals, okeys, block):
    """The rows of a call from the walked pieces (`walk`'s rows, lane after lane) less the document tokens:
    frames (bos/eos) into the token plane, the position plane, and what the other kernels and the caller finish.
    First returns whether the pieces tile every lane's stream and cover the call (False: nothing was written).

    `counts[i]` / `totals[i]`: lane i's pieces and stream length; `okeys[i, r]`: the token array (gather's
    object) of its piece r. Then returns (copies (c, 5): source token index, lane, lane position (n*T: the
    token after the call), length, object; label cells to mask; label cells to set
    after `finish` from ``nexts[P + c]`` (a piece cut before its document's end targets the document's next
    token); piece starts (keys); their owner entries (lane-major); their lane-major positions; entries' starts
    and framed offsets; nexts (P + cuts: each lane's token after the call, then the cut targets)).
    """
    NT, PT, PT3 = n * T, P * T, 3 * P * T
    E = counts.sum()
    first = np.empty(P, dtype=np.int64)
    ends = np.empty(E, dtype=np.int64)
    e_start = np.empty(E, dtype=np.int64)
    e_off = np.empty(E, dtype=np.int64)
    acc = 0
    e = 0
    ok = True  # the pieces tile each lane's stream, and cover the call: else nothing is written
    for i in range(P):
        first[i] = e
        lane0 = acc
        if counts[i] < 1:
            ok = False
        for r in range(counts[i]):
            a, end, fl = pieces[i, r, 7], pieces[i, r, 8], pieces[i, r, 9]
            if not (0 <= a < end <= fl and pieces[i, r, 6] + lead + trail == fl and pieces[i, r, 5] >= 0):
                ok = False
            e_start[e] = acc
            e_off[e] = a
            acc += end - a
            ends[e] = acc
            e += 1
        if acc - lane0 != totals[i] or totals[i] < NT or (counts[i] and e_start[e - 1] - lane0 >= NT):
            ok = False
    if not ok:
        z = np.zeros(0, dtype=np.int64)
        return False, np.zeros((0, 5), dtype=np.int64), z, z, z, z, z, z, z, np.zeros(0, dtype=np.int32)
    copies = np.empty((2 * E + P, 5), dtype=np.int64)
    nc = 0
    marks = np.empty(2 * E, dtype=np.int64)
    nm = 0
    cuts = np.empty(E, dtype=np.int64)
    ncut = 0
    nexts = np.zeros(P + E, dtype=np.int32)
    for i in range(P):
        ls = e_start[first[i]] if counts[i] else 0
        last = counts[i] - 1
        for r in range(counts[i]):
            pc = pieces[i, r]
            a, end, fl, nt, t0 = pc[7], pc[8], pc[9], pc[6], pc[5]
            p0 = e_start[first[i] + r] - ls  # the piece's start in its lane's stream
            b = end if r < last else end - (totals[i] - NT)
            obj = okeys[i, r]
            nc = _piece_tokens(block, copies, nc, i, p0, a, b, fl, nt, t0, obj, lead, trail, bos, eos, T, PT3)
            e_end = p0 + end - a
            eos_masked = masks_eos and fl >= 2 and a <= fl - 2 < end
            if e_end <= NT and end == fl:
                marks[nm] = _label_cell(e_end - 1, i, T, PT, PT3)
                nm += 1
            elif e_end < NT and not (eos_masked and end == fl - 1):  # cut: the document's next token
                cuts[ncut] = _label_cell(e_end - 1, i, T, PT, PT3)
                # (as the last target of a lane, `nexts[P + ncut]`: never 0 or bos here, end < fl and end > 0)
                nc = _last_target(copies, nc, nexts, P + ncut, end, fl, t0, obj, lead, trail, bos, eos, NT)
                ncut += 1
            if eos_masked:
                pm = p0 - a + fl - 2
                if pm < NT:
                    marks[nm] = _label_cell(pm, i, T, PT, PT3)
                    nm += 1
            if r == last:  # the token after the call: the target of the lane's last label
                nc = _last_target(copies, nc, nexts, i, b, fl, t0, obj, lead, trail, bos, eos, NT)
    # piece starts: every row start and every piece start inside a row, step-major; owners and positions
    lane_start = np.empty(P, dtype=np.int64)
    for i in range(P):
        lane_start[i] = e_start[first[i]]
    keys, owners, glob = _piece_starts(block, n, P, T, L, lane_start, first, first + counts - 1, e_start, ends)
    return True, copies[:nc], marks[:nm], cuts[:ncut], keys, owners, glob, e_start, e_off, nexts[:P + ncut]
