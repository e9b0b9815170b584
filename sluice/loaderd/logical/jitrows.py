"""The fast path's rows as numba kernels: a call's block from its walked pieces; imported only by `jitload.load`.

The kernels of a call's rows, all ``nogil``, after `jitdraws.walk`:

- `assemble`: from the walked pieces, the frame tokens (bos/eos) written into
  the block, the list of document-token copies, the label cells to mask and
  the cut targets, the piece starts (keys, owners, lane-major positions), the
  position plane, every step's cu_seqlens and tokens per source (`_step_cu`),
  the pieces used and the objects they read (the caller maps those, then
  `gather`s: no per-piece work left in Python);
- `gather`: the copies of one object's tokens into the block's token plane
  (one call per object touched: numba takes one array per argument, and the
  objects' token arrays are separate memory maps), and the token after each
  lane's last position where it is a document token;
- `finish`: the label plane (tokens shifted; the next step's first token, or
  the token after the call) and the masked cells;
- `assemble_bins` / `finish_bins`: the same for a best-fit call's rows
  (`jitdraws.walk_bins`: pieces one after another, then padding);
- `state_texts` / `bins_texts` / `seqs_texts`: every step's data state as the
  JSON its entry carries (concat's residual, best-fit's open and pending bins,
  a residual per source).

Why one module of 700 lines: each kernel module is one face of `jit.Kernel`,
one part of the module compiled ahead of time's key and exports
(`jitaot.EXPORTS`), one source of numba's cache and of `jitload.uncompiled`.
The state writers (`state_texts` and below) are the seam to split along when
this grows: they call no row kernel.

Importing this module imports numba (0.2-0.4 s) and makes the dispatchers;
nothing is compiled until `jitload.load` warms them (or loads them from numba's
on-disk cache). Its kernels call no kernel of another module: numba's cache
checks only the source file of the function it compiled, so a call into
another file would run that file's old code after an edit of it.

Layout: pieces lane-major; a lane's stream position p of step j = p // T lies
in the block at flat index ``j * 3PT + lane * T + p % T`` (token plane), + PT
(labels), + 2PT (positions).

What runs once a piece or a copy is `_lean` (numba's runtime off), as in
`jitdraws` (its docstring says why): the slices of a piece's cells are taken
in `_run`, `_shift`, `_copy` and `_pad`, not in the kernels that allocate.
"""

from __future__ import annotations

import numba as nb
import numpy as np

IGNORE = -100

_jit = nb.njit(nogil=True, cache=True)
_lean = nb.njit(nogil=True, cache=True, _nrt=False)  # (no reference counts: jitdraws.py says why)


@_lean
def _run(block, at, w):
    """Positions 0 .. w - 1 into `block` from `at` (a piece's cells of the position plane)."""
    pos = block[at:at + w]
    for x in range(w):
        pos[x] = x


@_lean
def _shift(block, src, PT, w):
    """The labels of `w` tokens from `src` of the token plane: each the token after it, the last left as it is."""
    tok, lab = block[src + 1:src + w], block[src + PT:src + PT + w - 1]
    for x in range(w - 1):
        lab[x] = tok[x]


@_lean
def _copy(block, at, toks, src, w):
    """`w` ids of `toks` from `src` into `block` from `at` (slices: a loop over views from 0 vectorizes;
    offsets added to x did not)."""
    dst, got = block[at:at + w], toks[src:src + w]
    for x in range(w):
        dst[x] = got[x]


@_lean
def _pad(block, cell, w, PT, pad):
    """`w` cells of padding from `cell` of the token plane: `pad`, label -100, position 0."""
    tok, lab, pos = block[cell:cell + w], block[cell + PT:cell + PT + w], block[cell + 2 * PT:cell + 2 * PT + w]
    for y in range(w):
        tok[y] = pad
        lab[y] = IGNORE
        pos[y] = 0


@_lean
def _add_copy(copies, nc, src, lane, pos, ln, obj):
    """Row nc of `copies` (source token index, lane, lane position, length, object); returns nc + 1."""
    copies[nc, 0] = src
    copies[nc, 1] = lane
    copies[nc, 2] = pos
    copies[nc, 3] = ln
    copies[nc, 4] = obj
    return nc + 1


@_lean
def _label_cell(pm, i, T, PT, PT3):
    """Flat index of lane i's stream position pm in the label plane of the step-major block."""
    return (pm // T) * PT3 + PT + i * T + pm % T


@_lean
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


@_lean
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
                _run(block, j * PT3 + 2 * PT + i * T + p - j * T, w)
                p = nxt
    return keys, owners, glob


@_jit
def _step_cu(keys, owners, esrc, n, PT, S):
    """Every step's cu_seqlens of its whole rows in one int32 array (step j's: its piece starts less ``j * PT``,
    then PT, at ``bounds[j] + j .. bounds[j + 1] + j``), where each step's pieces start in `keys` (`bounds`), and
    each step's tokens per source (`esrc`: each entry's source), as `fused.unit_arrays` makes them in numpy for
    micro-batches of any whole rows. Every step starts with a piece (a row start is a piece start), so a piece
    ends at the next key."""
    nk = keys.shape[0]
    cu = np.empty(nk + n, dtype=np.int32)
    bounds = np.empty(n + 1, dtype=np.int64)
    tokens = np.zeros((n, S), dtype=np.int64)
    bounds[0] = 0
    j = 0
    for b in range(nk):
        while j < n and keys[b] >= (j + 1) * PT:  # step j ends before piece b
            cu[b + j] = PT
            j += 1
            bounds[j] = b
        cu[b + j] = keys[b] - j * PT
        nxt = keys[b + 1] if b + 1 < nk else n * PT
        tokens[j, esrc[owners[b]]] += nxt - keys[b]
    while j < n:
        cu[nk + j] = PT
        j += 1
        bounds[j] = nk
    return cu, bounds, tokens


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
        while ln > 0:
            t = p % T
            w = min(ln, T - t)
            _copy(block, (p // T) * PT3 + i * T + t, toks, src, w)
            src += w
            p += w
            ln -= w


@_jit
def finish(block, nexts, marks, P, n, T):
    """The label plane: each lane's tokens shifted by one (across steps), `nexts` after the last; then -100 at
    `marks`."""
    PT = P * T
    PT3 = 3 * PT
    for j in range(n):
        for i in range(P):
            src = j * PT3 + i * T
            _shift(block, src, PT, T)
            block[src + PT + T - 1] = block[src + PT3] if j < n - 1 else nexts[i]
    for m in range(marks.shape[0]):
        block[marks[m]] = IGNORE


@_jit
def assemble(P, n, T, L, lead, trail, masks_eos, bos, eos, pieces, counts, totals, block, S):
    """The rows of a call from the walked pieces (`walk`'s rows, lane after lane) less the document tokens:
    frames (bos/eos) into the token plane, the position plane, and what the other kernels and the caller finish.
    First returns whether the pieces tile every lane's stream and cover the call (False: nothing was written).

    `counts[i]` / `totals[i]`: lane i's pieces and stream length. Then returns (copies (c, 5): source token
    index, lane, lane position (n*T: the token after the call), length, object (gather's: the index of its
    piece's ``(source << 32) + object`` in `objs`, last); label cells to mask; label cells to set
    after `finish` from ``nexts[P + c]`` (a piece cut before its document's end targets the document's next
    token); piece starts (keys); their owner entries (lane-major); their lane-major positions; entries' starts
    and framed offsets; nexts (P + cuts: each lane's token after the call, then the cut targets); every step's
    cu_seqlens, where its pieces start in the keys and its tokens per source of `S` (`_step_cu`); the pieces
    used, one an entry (lane after lane); the objects they read, ``(source << 32) + object``, sorted).
    """
    NT, PT, PT3 = n * T, P * T, 3 * P * T
    E = counts.sum()
    first = np.empty(P, dtype=np.int64)
    ends = np.empty(E, dtype=np.int64)
    e_start = np.empty(E, dtype=np.int64)
    e_off = np.empty(E, dtype=np.int64)
    esrc = np.empty(E, dtype=np.int64)
    used = np.empty((E, pieces.shape[2]), dtype=np.int64)
    okey = np.empty(E, dtype=np.int64)
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
            esrc[e] = pieces[i, r, 0]
            used[e] = pieces[i, r]
            okey[e] = (pieces[i, r, 0] << 32) + pieces[i, r, 3]
            acc += end - a
            ends[e] = acc
            e += 1
        if acc - lane0 != totals[i] or totals[i] < NT or (counts[i] and e_start[e - 1] - lane0 >= NT):
            ok = False
    if not ok:
        z = np.zeros(0, dtype=np.int64)
        z2 = np.zeros((0, 0), dtype=np.int64)
        return (False, np.zeros((0, 5), dtype=np.int64), z, z, z, z, z, z, z, np.zeros(0, dtype=np.int32),
                np.zeros(0, dtype=np.int32), z, z2, z2, z)
    objs = np.unique(okey)
    eobj = np.searchsorted(objs, okey)
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
            obj = eobj[first[i] + r]
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
    cu, bounds, tokens = _step_cu(keys, owners, esrc, n, PT, S)
    return (True, copies[:nc], marks[:nm], cuts[:ncut], keys, owners, glob, e_start, e_off, nexts[:P + ncut], cu,
            bounds, tokens, used, objs)


@_jit
def assemble_bins(P, n, k, L, lead, trail, masks_eos, bos, eos, pad, pieces, counts, pbin, rowbin, block, S):
    """The rows of a best-fit call (`jitdraws.walk_bins`' pieces, bins and served bins: row q of lane i is bin
    ``rowbin[i, q]``, its pieces in the order placed) less the document tokens: frames into the token plane,
    padding (`pad`, labels -100, positions 0) after each row's pieces, the position plane, and what `gather`,
    `finish_bins` and the caller finish. Row q of lane i lies at lane stream positions ``q * L ..`` (step q // k,
    the block's row ``i * k + q % k``): `gather` and `_label_cell` read the block as for concat.

    Returns (ok: every row holds 1..L tokens of pieces inside their documents; copies (as `assemble`'s, the
    cut targets' into ``nexts[c]``); spans (lane, stream position, length) of the pieces placed; label cells to
    mask; cut cells (set from `nexts` after `finish_bins`); nexts; the pieces placed, row after row (lane-major,
    then row), with each row's first in `rptr` (``P * n * k + 1``); every row's tokens per source of `S`
    (lane-major rows); the objects read, ``(source << 32) + object``, sorted)."""
    T = k * L
    R = n * k
    PT = P * T
    PT3 = 3 * PT
    NT = n * T
    E = 0
    ok = True
    rowfill = np.zeros(P * R, dtype=np.int64)
    rowat = np.full(counts.sum() + 1, -1, dtype=np.int64)  # per piece (lane-major): its row, lane-major
    base = 0
    for i in range(P):
        binrow = np.full(counts[i] + 1, -1, dtype=np.int64)
        for q in range(R):
            b = rowbin[i, q]
            if b < 0 or b > counts[i]:
                ok = False
            else:
                binrow[b] = q
        for r in range(counts[i]):
            b = pbin[i, r]
            if 0 <= b <= counts[i] and binrow[b] >= 0:
                g = i * R + binrow[b]
                a, end, fl = pieces[i, r, 7], pieces[i, r, 8], pieces[i, r, 9]
                if not (0 <= a < end <= fl and pieces[i, r, 6] + lead + trail == fl and pieces[i, r, 5] >= 0):
                    ok = False
                rowat[base + r] = g
                rowfill[g] += end - a
                E += 1
        base += counts[i]
    for g in range(P * R):
        if not 0 < rowfill[g] <= L:
            ok = False
    z = np.zeros(0, dtype=np.int64)
    if not ok:
        z2 = np.zeros((0, 0), dtype=np.int64)
        return (False, np.zeros((0, 5), dtype=np.int64), z2, z, z, np.zeros(0, dtype=np.int32), z2, z, z2, z)
    rptr = np.zeros(P * R + 1, dtype=np.int64)
    for x in range(base):
        if rowat[x] >= 0:
            rptr[rowat[x] + 1] += 1
    for g in range(P * R):
        rptr[g + 1] += rptr[g]
    used = np.empty((E, pieces.shape[2]), dtype=np.int64)
    okey = np.empty(E, dtype=np.int64)
    fill = rptr[:-1].copy()
    base = 0
    for i in range(P):
        for r in range(counts[i]):
            g = rowat[base + r]
            if g >= 0:
                used[fill[g]] = pieces[i, r]
                okey[fill[g]] = (pieces[i, r, 0] << 32) + pieces[i, r, 3]
                fill[g] += 1
        base += counts[i]
    objs = np.unique(okey)
    eobj = np.searchsorted(objs, okey)
    copies = np.empty((2 * E, 5), dtype=np.int64)
    nc = 0
    spans = np.empty((E, 3), dtype=np.int64)
    marks = np.empty(2 * E, dtype=np.int64)
    nm = 0
    cuts = np.empty(E, dtype=np.int64)
    ncut = 0
    nexts = np.zeros(E, dtype=np.int32)
    tokens = np.zeros((P * R, S), dtype=np.int64)
    for g in range(P * R):
        i, q = g // R, g % R
        col = 0
        for x in range(rptr[g], rptr[g + 1]):
            a, end, fl, nt, t0 = used[x, 7], used[x, 8], used[x, 9], used[x, 6], used[x, 5]
            p0 = q * L + col
            w = end - a
            nc = _piece_tokens(block, copies, nc, i, p0, a, end, fl, nt, t0, eobj[x], lead, trail, bos, eos, T, PT3)
            _run(block, (p0 // T) * PT3 + 2 * PT + i * T + p0 % T, w)
            spans[x, 0], spans[x, 1], spans[x, 2] = i, p0, w
            eos_masked = masks_eos and fl >= 2 and a <= fl - 2 < end
            if end == fl:
                marks[nm] = _label_cell(p0 + w - 1, i, T, PT, PT3)
                nm += 1
            elif not (eos_masked and end == fl - 1):  # cut: the document's next token
                cuts[ncut] = _label_cell(p0 + w - 1, i, T, PT, PT3)
                nc = _last_target(copies, nc, nexts, ncut, end, fl, t0, eobj[x], lead, trail, bos, eos, NT)
                ncut += 1
            if eos_masked:
                marks[nm] = _label_cell(p0 + fl - 2 - a, i, T, PT, PT3)
                nm += 1
            tokens[g, used[x, 0]] += w
            col += w
        if col < L:  # padding
            p0 = q * L + col
            _pad(block, (p0 // T) * PT3 + i * T + p0 % T, L - col, PT, pad)
    return True, copies[:nc], spans, marks[:nm], cuts[:ncut], nexts[:ncut], used, rptr, tokens, objs


@_jit
def finish_bins(block, spans, marks, T, PT, PT3):
    """The label plane of a best-fit call's pieces (`spans`: lane, stream position, length): each piece's tokens
    shifted by one inside it (its last label is a document end, a cut target or masked: `marks`, the caller's);
    then -100 at `marks`."""
    for x in range(spans.shape[0]):
        i, p0, w = spans[x, 0], spans[x, 1], spans[x, 2]
        _shift(block, (p0 // T) * PT3 + i * T + p0 % T, PT, w)
    for m in range(marks.shape[0]):
        block[marks[m]] = IGNORE


@_lean
def _put(buf, at, text, lo, hi):
    """`text[lo:hi]` into `buf` at `at`; where it ends."""
    for x in range(lo, hi):
        buf[at] = text[x]
        at += 1
    return at


@_lean
def _put_int(buf, at, v):
    """`v` in decimal (as JSON and `str` write an int) into `buf` at `at`; where it ends."""
    if v < 0:
        buf[at] = 45  # "-"
        at += 1
        v = -v
    digits = 1
    t = v
    while t >= 10:
        t //= 10
        digits += 1
    for x in range(digits - 1, -1, -1):
        buf[at + x] = 48 + v % 10
        v //= 10
    return at + digits


_CURSOR = (0, 1, 2, 3, 4, 5, 6, 7)  # a cursor's columns, as JSON writes them
_PIECE = (0, 1, 2, 7, 8)  # a walked piece's (source, epoch, index, start, end): the packers' form
_RESIDUAL = (2, 3, 4, 5, 6)  # a concat residual's pointer in `state_texts`' meta


@_lean
def _put_ints(buf, at, row, cols):
    """``[row[cols[0]],row[cols[1]],..]`` into `buf` at `at`; where it ends."""
    buf[at] = 91  # "["
    at += 1
    for c in range(len(cols)):
        if c:
            buf[at] = 44  # ","
            at += 1
        at = _put_int(buf, at, row[cols[c]])
    buf[at] = 93  # "]"
    return at + 1


@_lean
def _lane_open(buf, at, p, keys, key_offs, draws, text, text_offs):
    """Lane ``order[p]``'s JSON up to its packers' state (a comma before all but the first lane; its key, its
    draws, text part 2); where it ends."""
    if p:
        buf[at] = 44  # ","
        at += 1
    at = _put(buf, at, keys, key_offs[p], key_offs[p + 1])
    at = _put_int(buf, at, draws)
    return _put(buf, at, text, text_offs[2], text_offs[3])


@_lean
def _lane_close(buf, at, rows, cur, text, text_offs):
    """A lane's JSON from after its packers' state (text part 4, its rows, part 5, its cursors `cur` (S, 8),
    part 6); where it ends."""
    at = _put(buf, at, text, text_offs[4], text_offs[5])
    at = _put_int(buf, at, rows)
    at = _put(buf, at, text, text_offs[5], text_offs[6])
    for s in range(cur.shape[0]):
        if s:
            buf[at] = 44
            at += 1
        at = _put_ints(buf, at, cur[s], _CURSOR)
    return _put(buf, at, text, text_offs[6], text_offs[7])


@_lean
def _state_close(buf, at, step, text, text_offs):
    """A state's JSON after its lanes (text part 1, its step, the closing brace); where it ends."""
    at = _put(buf, at, text, text_offs[1], text_offs[2])
    at = _put_int(buf, at, step)
    buf[at] = 125  # "}"
    return at + 1


@_jit
def state_texts(snaps, meta, rows0, k, first, order, keys, key_offs, text, text_offs, buf):
    """Every step's data state of a call as the JSON `stepqueue.state_json` writes for its `state_dict()`, back to
    back in `buf`; returns where each starts (n + 1 offsets). `snaps` (P, n, S, 8): each lane's cursors after
    each step; `meta` (P, n, 7): its draws, whether a concat residual is open, and that residual's pointer (5);
    lane i's rows after step j: ``rows0[i] + (j + 1) * k``. The lanes go in `order` (their decimal names sorted
    as strings, as the encoder sorts keys); `keys[key_offs[p]:key_offs[p + 1]]` is lane ``order[p]``'s
    ``"<lane>":{"draws":``. `text` holds the constant parts at `text_offs`: 0 the state's head through
    ``"lanes":{``, 1 ``},"runspec_digest":..,"step":`` (the state's tail but the step and ``}``), 2
    ``,"packers":{"*":{"cur":``, 3 ``null``, 4 ``}},"rows":``, 5 ``,"sources":[``, 6 ``]}``. `buf` must hold
    them all (the caller bounds it by the ints' widths)."""
    P, n = snaps.shape[0], snaps.shape[1]
    offs = np.empty(n + 1, dtype=np.int64)
    at = 0
    for j in range(n):
        offs[j] = at
        at = _put(buf, at, text, text_offs[0], text_offs[1])
        for p in range(P):
            i = order[p]
            at = _lane_open(buf, at, p, keys, key_offs, meta[i, j, 0], text, text_offs)
            if meta[i, j, 1]:
                at = _put_ints(buf, at, meta[i, j], _RESIDUAL)
            else:
                at = _put(buf, at, text, text_offs[3], text_offs[4])
            at = _lane_close(buf, at, rows0[i] + (j + 1) * k, snaps[i, j], text, text_offs)
        at = _state_close(buf, at, first + j, text, text_offs)
    offs[n] = at
    return offs


@_lean
def _put_bin(buf, at, pieces, members, lo, hi, npc):
    """One bin's pieces as JSON (``[[source,epoch,index,start,end],..]``): `members[lo:hi]` (piece rows,
    ascending) less those from `npc` on (placed after the state); where it ends."""
    buf[at] = 91
    at += 1
    first = True
    for m in range(lo, hi):
        x = members[m]
        if x >= npc:
            break
        if not first:
            buf[at] = 44
            at += 1
        first = False
        at = _put_ints(buf, at, pieces[x], _PIECE)
    buf[at] = 93
    return at + 1


@_jit
def bins_texts(snaps, meta, rows0, k, first, order, keys, key_offs, text, text_offs, gorder, gkeys, gkey_offs, ended,
               pieces, pbin, counts, fifo, bsnap, bopens, buf):
    """`state_texts` for a best-fit call (`jitdraws.walk_bins`' notes: `meta` (P, n, 2) [draws, pieces made],
    `bsnap` (P, n, G, 3) each packer's [open bins, pending head, pending tail], `bopens` its open bins, `fifo`
    its closed ones in closing order; `pieces` / `pbin` / `counts` the call's pieces and their bins; `ended`
    (P, G) whether each lane's packer g has ended): text parts 2, 3, 4 are ``,"packers":{``, ``],"pending":[``
    and ``},"rows":``, 7 and 8 ``false,"open":[`` and ``true,"open":[``; packer ``gorder[x]``'s key
    ``"<name>":{"ended":`` at `gkey_offs[x]` of `gkeys`. An open bin lists its pieces placed by the step's end,
    a pending one all of them."""
    P, n, G = snaps.shape[0], snaps.shape[1], bsnap.shape[2]
    offs = np.empty(n + 1, dtype=np.int64)
    cap = pieces.shape[1]
    starts = np.zeros((P, cap + 2), dtype=np.int64)  # per lane: its pieces by bin (bins <= pieces), ascending
    members = np.empty((P, cap), dtype=np.int64)
    for i in range(P):
        for x in range(counts[i]):
            starts[i, pbin[i, x] + 2] += 1
        for b in range(cap):
            starts[i, b + 2] += starts[i, b + 1]
        for x in range(counts[i]):
            b = pbin[i, x] + 1
            members[i, starts[i, b]] = x
            starts[i, b] += 1
    at = 0
    for j in range(n):
        offs[j] = at
        at = _put(buf, at, text, text_offs[0], text_offs[1])
        for p in range(P):
            i = order[p]
            npc = meta[i, j, 1]
            at = _lane_open(buf, at, p, keys, key_offs, meta[i, j, 0], text, text_offs)
            for y in range(G):
                g = gorder[y]
                if y:
                    buf[at] = 44
                    at += 1
                at = _put(buf, at, gkeys, gkey_offs[y], gkey_offs[y + 1])
                e = 8 if ended[i, g] else 7
                at = _put(buf, at, text, text_offs[e], text_offs[e + 1])
                nopen, head, tail = bsnap[i, j, g, 0], bsnap[i, j, g, 1], bsnap[i, j, g, 2]
                for x in range(nopen):
                    if x:
                        buf[at] = 44
                        at += 1
                    b = bopens[i, j, g, x]
                    at = _put_bin(buf, at, pieces[i], members[i], starts[i, b], starts[i, b + 1], npc)
                at = _put(buf, at, text, text_offs[3], text_offs[4])
                for x in range(head, tail):
                    if x > head:
                        buf[at] = 44
                        at += 1
                    b = fifo[i, g, x]
                    at = _put_bin(buf, at, pieces[i], members[i], starts[i, b], starts[i, b + 1], npc)
                buf[at] = 93  # "]"
                buf[at + 1] = 125  # "}"
                at += 2
            at = _lane_close(buf, at, rows0[i] + (j + 1) * k, snaps[i, j], text, text_offs)
        at = _state_close(buf, at, first + j, text, text_offs)
    offs[n] = at
    return offs

_SOURCE_RESIDUAL = (1, 2, 3, 8, 9)  # a source's residual in `seqs_texts`' rsnaps (held?, then its piece)


@_jit
def seqs_texts(snaps, meta, rsnaps, rows0, k, first, order, keys, key_offs, text, text_offs, sorder, skeys, skey_offs,
               buf):
    """`state_texts` for a call with one concat packer per source (`jitdraws.walk_seqs`' notes: `meta[i, j, 0]`
    the draws, `rsnaps` (P, n, S, 11) each source's residual): text parts 2, 3, 4 are ``,"packers":{``,
    ``null`` and ``},"rows":``; between 2 and 4 each source's ``"<s>":{"cur":<residual or null>}`` in `sorder`
    (`skeys[skey_offs[x]:skey_offs[x + 1]]` source ``sorder[x]``'s key)."""
    P, n, S = snaps.shape[0], snaps.shape[1], snaps.shape[2]
    offs = np.empty(n + 1, dtype=np.int64)
    at = 0
    for j in range(n):
        offs[j] = at
        at = _put(buf, at, text, text_offs[0], text_offs[1])
        for p in range(P):
            i = order[p]
            at = _lane_open(buf, at, p, keys, key_offs, meta[i, j, 0], text, text_offs)
            for x in range(S):
                if x:
                    buf[at] = 44
                    at += 1
                at = _put(buf, at, skeys, skey_offs[x], skey_offs[x + 1])
                r = rsnaps[i, j, sorder[x]]
                if r[0]:
                    at = _put_ints(buf, at, r, _SOURCE_RESIDUAL)
                else:
                    at = _put(buf, at, text, text_offs[3], text_offs[4])
                buf[at] = 125  # "}"
                at += 1
            at = _lane_close(buf, at, rows0[i] + (j + 1) * k, snaps[i, j], text, text_offs)
        at = _state_close(buf, at, first + j, text, text_offs)
    offs[n] = at
    return offs
