"""The fast path's compiled kernel (numba, the optional ``jit`` extra): the call into it.

`fusedmix.mixed_steps` (concat), `fusedbins.bins_steps` (best-fit) and
`fusedseqs.seqs_steps` (a concat packer per source) hand a call's walk and
rows to a loaded `Kernel`, which runs the compiled code of
`jitdraws` (the draws, and best-fit's bins) and `jitrows` (the rows, the
states' JSON); it gives `Plan.step`'s bytes and states. Where it is not
loaded (numba not installed, `--jit off`, not loaded yet) or declines a call
(a token dtype it was not compiled for), `Plan.step` makes the step.
`jitload.uncompiled` runs the same source as plain Python (the fast tier's tests).
Loading it (numba's import, its compile or its on-disk cache, or the module
compiled ahead of time; a background thread) is the physical plane's
business: `sluice/loaderd/physical/jitload.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sluice.errors import InternalError

# token dtypes compiled at load (the shard formats' dtypes); a call reading others is `Plan.step`'s
DTYPES = (np.uint16, np.uint32, np.int32, np.int64)
# Where a call's block is made: ``alloc(shape, dtype)`` gives an uninitialised C-contiguous array, or None for the
# heap (`Blocks`: the daemon's arena, loaderd/arena.py)
Alloc = Callable[[tuple[int, ...], Any], Any]
# `jitdraws.walk`'s status, as it defines them (a kernel module imports nothing of sluice: numba's cache keys
# each function on its own file), read here without numba (tests/test_logical_jit.py holds them equal)
WALK_DONE, WALK_ASIDE, WALK_NEED, WALK_FULL = 0, 1, 2, 3


class Kernel:
    """The compiled kernels, warmed: the walks (`jitdraws`: `walk` every lane's concat draws of a call,
    `walk_bins` best-fit's, `walk_seqs` per-source packers') and the rows and states (`jitrows`), what
    `fusedmix`, `fusedbins` and `fusedseqs` call."""

    def __init__(self, draws: Any, rows: Any) -> None:
        """`draws` and `rows`: the `jitdraws` and `jitrows` modules, their kernels warmed."""
        self._gather, self._finish = rows.gather, rows.finish
        self.walk = _Walk(draws)
        self._assemble = rows.assemble
        self._state_texts = rows.state_texts
        self.walk_bins = _Walk(draws, "walk_bins")
        self._assemble_bins, self._finish_bins = rows.assemble_bins, rows.finish_bins
        self._bins_texts = rows.bins_texts
        self.walk_seqs = _Walk(draws, "walk_seqs")
        self._seqs_texts = rows.seqs_texts
        self.calls = 0  # calls whose rows the kernel assembled
        self.declined = 0  # calls it declined (an argument type not compiled): `Plan.step`'s
        self.modules: dict[str, Any] = {}  # `jitload.uncompiled`'s: the kernels' modules run as Python

    def assemble(self, framing: Any, n: int, k: int, L: int, pieces: np.ndarray, counts: np.ndarray,
                 totals: np.ndarray, S: int, tokens_of: Callable[[list[int]], list[np.ndarray]],
                 alloc: Alloc | None = None) -> Any:
        """The rows of walked pieces (`walk`'s arrays; `S` the plan's sources; `tokens_of` the token arrays of
        the objects the pieces read, given as ``(source << 32) + object``, sorted; it may raise `shards.Aside`):
        (block, keys, owners, lane-major positions, entry starts, entry offsets, (every step's cu_seqlens, where
        each step's pieces start in the keys, its tokens per source), the pieces used (one an entry, lane after
        lane)), or NotImplemented where a token dtype or frame id was not compiled (`Plan.step` takes the call).
        `alloc` ``(shape, dtype) -> array | None`` gives the block (None, or None from it: a new numpy array)."""
        got = _frame(framing, 0, n, len(counts), k, L, alloc)
        if got is None:
            return NotImplemented
        lead, trail, bos, eos, block, flat = got
        P, T = len(counts), k * L
        try:
            (ok, copies, marks, cuts, keys, owners, glob, starts, offs, nexts, cu, bounds, tokens, used,
             objs) = self._assemble(P, n, T, L, lead, trail, bool(framing.masks_eos_target), bos, eos, pieces,
                                    counts, totals, flat, S)
        except TypeError:  # an argument type not compiled at load (compiling is off): `Plan.step`'s call
            self.declined += 1
            return NotImplemented
        if not ok:
            raise InternalError("fused kernel: the walked pieces do not tile the lanes' streams of the call")
        if not self._fill(tokens_of(objs.tolist()), copies, flat, nexts, n, T, P,
                          lambda: self._finish(flat, nexts, marks, P, n, T)):
            return NotImplemented
        flat[cuts] = nexts[P:]  # (after `finish`, which writes the label plane from the tokens)
        self.calls += 1
        return block, keys, owners, glob, starts, offs, (cu, bounds.tolist(), tokens.tolist()), used

    def _fill(self, toks: list[np.ndarray], copies: np.ndarray, flat: np.ndarray, nexts: np.ndarray, n: int, T: int,
              P: int, finish: Callable[[], None]) -> bool:
        """A call's document tokens into its block (`gather`, one call an object of `toks`), then its labels
        (`finish`); False where a token dtype or an argument type was not compiled (`Plan.step` takes the
        call)."""
        if any(t.dtype.type not in DTYPES or t.ndim != 1 for t in toks):
            return False
        try:
            NT, PT3 = n * T, 3 * P * T
            for o, t in enumerate(toks):
                self._gather(t, o, copies, flat, nexts, T, NT, PT3)
            finish()
        except TypeError:  # an argument type not compiled at load (compiling is off)
            self.declined += 1
            return False
        return True

    def assemble_bins(self, framing: Any, pad: int, n: int, k: int, L: int, pieces: np.ndarray, counts: np.ndarray,
                      pbin: np.ndarray, rowbin: np.ndarray, S: int,
                      tokens_of: Callable[[list[int]], list[np.ndarray]], alloc: Alloc | None = None) -> Any:
        """The rows of a best-fit call (`walk_bins`' arrays; `S`, `tokens_of`, `alloc` as `assemble`'s): (block, the
        pieces placed row after row (lane-major rows), where each row's start in them (`rptr`), every row's tokens
        per source), or NotImplemented where a token dtype or a frame or pad id was not compiled."""
        got = _frame(framing, pad, n, len(counts), k, L, alloc)
        if got is None:
            return NotImplemented
        lead, trail, bos, eos, block, flat = got
        P, T = len(counts), k * L
        try:
            ok, copies, spans, marks, cuts, nexts, used, rptr, tokens, objs = self._assemble_bins(
                P, n, k, L, lead, trail, bool(framing.masks_eos_target), bos, eos, pad, pieces, counts, pbin, rowbin,
                flat, S)
        except TypeError:  # (as `assemble`'s)
            self.declined += 1
            return NotImplemented
        if not ok:
            raise InternalError("fused kernel: the best-fit rows of the call are not whole rows of their pieces")
        if not self._fill(tokens_of(objs.tolist()), copies, flat, nexts, n, T, P,
                          lambda: self._finish_bins(flat, spans, marks, T, P * T, 3 * P * T)):
            return NotImplemented
        flat[cuts] = nexts  # (after `finish_bins`, which writes the label plane from the tokens)
        self.calls += 1
        return block, used, rptr, tokens

    def bins_texts(self, snaps: np.ndarray, meta: np.ndarray, rows0: np.ndarray, k: int, first: int, parts: Any,
                   packers: tuple, ended: np.ndarray, pieces: np.ndarray, pbin: np.ndarray, counts: np.ndarray,
                   fifo: np.ndarray, bsnap: np.ndarray, bopens: np.ndarray) -> list[bytes] | Any:
        """`state_texts` of a best-fit call (`jitrows.bins_texts`; `parts`: `state_parts(.., "bins")`, `packers`:
        `packer_keys(.., b'"ended":')`; the other arguments `walk_bins`' arrays)."""
        order, keys, key_offs, text, text_offs, doc_fixed, lane_fixed = parts
        P, n, S = snaps.shape[:3]
        G = bsnap.shape[2]
        # as `state_texts`', and each step's packers and bins: at most every piece of the call, 5 ints and 4
        # brackets or commas each, a bin's 3; each packer's key, and its flag, brackets and comma (31)
        per_step = doc_fixed + P * (lane_fixed + 10 * S + 20 * (7 + 8 * S) + 40 * G + len(packers[1])) + \
            int(counts.sum()) * (20 * 5 + 7)
        buf = np.empty(n * per_step, dtype=np.uint8)
        try:
            offs = self._bins_texts(snaps, meta, rows0, k, first, order, keys, key_offs, text, text_offs, *packers,
                                    ended, pieces, pbin, counts, fifo, bsnap, bopens, buf).tolist()
        except TypeError:  # (as `state_texts`')
            self.declined += 1
            return NotImplemented
        raw = buf.tobytes()
        return [raw[offs[j]:offs[j + 1]] for j in range(n)]

    def seqs_texts(self, snaps: np.ndarray, meta: np.ndarray, rsnaps: np.ndarray, rows0: np.ndarray, k: int,
                   first: int, parts: Any, sources: tuple) -> list[bytes] | Any:
        """`state_texts` of a call with one concat packer per source (`jitrows.seqs_texts`; `parts`:
        `state_parts(.., "seqs")`, `sources`: `packer_keys(.., b'"cur":')`; the other arguments `walk_seqs`' arrays)."""
        order, keys, key_offs, text, text_offs, doc_fixed, lane_fixed = parts
        P, n, S = snaps.shape[:3]
        # as `state_texts`', and each source's packer: its key, a residual's 5 ints, commas, brackets, a brace
        per_step = doc_fixed + P * (lane_fixed + 10 * S + 20 * (7 + 8 * S) + S * (16 + 20 * 5 + 8))
        buf = np.empty(n * per_step, dtype=np.uint8)
        try:
            offs = self._seqs_texts(snaps, meta, rsnaps, rows0, k, first, order, keys, key_offs, text, text_offs,
                                    *sources, buf).tolist()
        except TypeError:  # (as `state_texts`')
            self.declined += 1
            return NotImplemented
        raw = buf.tobytes()
        return [raw[offs[j]:offs[j + 1]] for j in range(n)]

    def state_texts(self, snaps: np.ndarray, meta: np.ndarray, rows0: np.ndarray, k: int, first: int,
                    parts: Any) -> list[bytes] | Any:
        """Every step's data state of a call as `datastate.state_json` writes it (`jitrows.state_texts`; `parts`:
        the plan and lanes' constant parts, `state_parts`)."""
        order, keys, key_offs, text, text_offs, doc_fixed, lane_fixed = parts
        P, n, S = snaps.shape[:3]
        # at most: an int64 in 20 characters; a lane's 7 + 8S of them, its sources' brackets and commas
        buf = np.empty(n * (doc_fixed + P * (lane_fixed + 10 * S + 20 * (7 + 8 * S))), dtype=np.uint8)
        try:
            offs = self._state_texts(snaps, meta, rows0, k, first, order, keys, key_offs, text, text_offs,
                                     buf).tolist()
        except TypeError:  # an argument type not compiled at load (as `assemble`'s)
            self.declined += 1
            return NotImplemented
        raw = buf.tobytes()
        return [raw[offs[j]:offs[j + 1]] for j in range(n)]


def _frame(framing: Any, pad: int, n: int, P: int, k: int, L: int, alloc: Alloc | None) -> tuple | None:
    """A call's frame ids as the row kernels take them (lead, trail, bos, eos: 0 where there is none) and its
    block (``(n, 3, P * k, L)`` int32, from `alloc` where it gives one, and flat), or None where an id is not an
    int32 (the kernels' cells)."""
    lead, trail = int(framing.bos is not None), int(framing.eos is not None)
    bos = 0 if framing.bos is None else framing.bos
    eos = 0 if framing.eos is None else framing.eos
    if not all(-(1 << 31) <= v < 1 << 31 for v in (bos, eos, pad)):
        return None
    shape = (n, 3, P * k, L)
    block = alloc(shape, np.int32) if alloc is not None else None
    if block is None:
        block = np.empty(shape, dtype=np.int32)
    return lead, trail, bos, eos, block, block.reshape(-1)


def state_parts(dataset_id: str, runspec_digest: str, lanes: list[int], kind: str = "concat") -> tuple:
    """The constant parts of `Kernel.state_texts` (`kind` "bins": of `Kernel.bins_texts`, "seqs": of
    `Kernel.seqs_texts`) for states of `lanes` (`datastate.state_json` of a state with no lanes, cut around
    them; the lanes' keys in the order the encoder sorts them), and the bytes a state and a lane take at most but
    for their ints, sources and bins."""
    from sluice.datastate import state_json, state_obj

    empty = state_json(state_obj(dataset_id, runspec_digest, 0, {}))
    at = empty.index(b'"lanes":{}') + len(b'"lanes":{')
    tail = empty[at + 1:]
    if not tail.endswith(b'"step":0}'):
        raise InternalError(f"a data state's JSON does not end with its step: {empty[-40:]!r}")
    # (the packers' keys sorted, as the encoder sorts them; "bins" and "seqs": each packer's key between parts
    # 2 and 4, `packer_keys`; "bins" also its "ended" flag and the open bins' head, parts 7 and 8)
    packer = {"bins": [b',"packers":{', b'],"pending":[', b'},"rows":'],
              "seqs": [b',"packers":{', b"null", b'},"rows":'],
              "concat": [b',"packers":{"*":{"cur":', b"null", b'}},"rows":']}[kind]
    parts = [empty[:at], b"}" + tail[:-2], *packer, b',"sources":[', b"]}"]
    if kind == "bins":
        parts += [b'false,"open":[', b'true,"open":[']
    order = sorted(range(len(lanes)), key=lambda i: str(lanes[i]))
    keys = [b'"%d":{"draws":' % lanes[i] for i in order]
    offsets = np.cumsum([0, *map(len, parts)]).astype(np.int64)
    key_offs = np.cumsum([0, *map(len, keys)]).astype(np.int64)
    doc_fixed = len(parts[0]) + len(parts[1]) + 21  # (the step and the closing brace)
    lane_fixed = max(map(len, keys), default=0) + sum(map(len, parts[2:])) + 8  # (a comma; a cur's brackets, commas)
    return (np.asarray(order, dtype=np.int64), np.frombuffer(b"".join(keys), dtype=np.uint8), key_offs,
            np.frombuffer(b"".join(parts), dtype=np.uint8), offsets, doc_fixed, lane_fixed)


def packer_keys(names: list[str], head: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packers' keys of `Kernel.seqs_texts` / `bins_texts` (`names`: the plan's `packer_keys`): the packers in
    the order the encoder sorts their names (``"10"`` before ``"2"``), and each one's ``"<name>":{<head>`` back to
    back, with offsets."""
    order = sorted(range(len(names)), key=lambda g: names[g])
    keys = [b'"%s":{%s' % (names[g].encode(), head) for g in order]
    return (np.asarray(order, dtype=np.int64), np.frombuffer(b"".join(keys), dtype=np.uint8),
            np.cumsum([0, *map(len, keys)]).astype(np.int64))


class _Walk:
    """`jitdraws.walk` (or `walk_bins`), called as the function itself; `status` its (done, aside, need, full)
    codes. An argument type not compiled (compiling is off) raises TypeError there, which `fusedmix` and
    `fusedbins` never pass: every argument is an int64 array or scalar they make themselves."""

    def __init__(self, mod: Any, name: str = "walk") -> None:
        self._fn = getattr(mod, name)
        self.status = (WALK_DONE, WALK_ASIDE, WALK_NEED, WALK_FULL)
        self.calls = 0

    def __call__(self, *args: Any) -> tuple[int, int]:
        self.calls += 1
        return self._fn(*args)


class Blocks:
    """`kernel` (a `Kernel`) whose calls make their blocks with `alloc` (`Kernel.assemble`'s): a producer's own
    face of the one kernel every replica shares."""

    def __init__(self, kernel: Any, alloc: Alloc) -> None:
        self._kernel, self._alloc = kernel, alloc

    def __getattr__(self, name: str) -> Any:  # (the walks, the states' texts, the counters)
        return getattr(self._kernel, name)

    def assemble(self, *args: Any) -> Any:
        return self._kernel.assemble(*args, alloc=self._alloc)

    def assemble_bins(self, *args: Any) -> Any:
        return self._kernel.assemble_bins(*args, alloc=self._alloc)
