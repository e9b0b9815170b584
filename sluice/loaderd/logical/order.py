"""Order: which sample of a source sits at each position of an epoch.

Every order is a pure, versioned function of (dataset ID, seed, source, epoch)
and a position, with O(1) memory in the number of samples N and an inverse, so
"which position holds sample X?" is answered without a scan.

* ``feistel-v1`` (run spec ``order = "global"``): a uniform-looking keyed
  permutation of [0, N). A balanced Feistel network on 2h bits (2**(2h) >= N, six
  rounds, splitmix64 round function keyed by BLAKE3) with cycle walking: values
  >= N are encrypted again until they fall inside [0, N). Because 2**(2h) < 4N,
  a walk takes fewer than 4 rounds on average.
* ``block-shuffle-v1`` (``order = "block"``): locality-friendly, NOT uniform.
  Objects (shards) are permuted with feistel-v1; consecutive groups of
  ``block_window`` permuted shards form windows; within each window the samples
  are permuted with feistel-v1. Reading a window touches only its shards.
  Memory O(number of objects).
* ``none``: position i holds sample i.

Lanes: lane l of P owns positions l, l+P, l+2P, ... of every source's epoch
order, so lanes partition each epoch with no overlap and no gap.

Worked example, N = 10, P = 4, feistel-v1 giving the order [7 2 9 0 4 1 8 3 6 5]:
lane 0 reads positions 0, 4, 8 -> samples 7, 4, 6; lane 1 reads 1, 5, 9 -> 2, 1, 5;
lane 2 reads 2, 6 -> 9, 8; lane 3 reads 3, 7 -> 0, 3.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable

import numpy as np
from functools import lru_cache

import blake3

from sluice.runspec import ORDER_VERSIONS
from sluice.npsets import sorted_unique

M64 = (1 << 64) - 1
ROUNDS = 6



def mix64(z: int) -> int:
    """splitmix64 finalizer: a fast bijective 64-bit mixer."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


# `Feistel.forward_many` in compiled code (`jitdraws.feistel_many`, handed over by `jitload.load`), or None.
_COMPILED: Callable[..., None] | None = None


def use_compiled(fn: Callable[..., None] | None) -> None:
    """Compute `Feistel.forward_many` with `fn` (`jitdraws.feistel_many`: the same values, held so by
    tests/test_logical_jit.py) from now on in this process; None: numpy again."""
    global _COMPILED
    _COMPILED = fn


def derive_keys(*parts: object, count: int = ROUNDS) -> tuple[int, ...]:
    """`count` 64-bit keys from BLAKE3 of the '|'-joined parts (stable across machines)."""
    text = "|".join(str(p) for p in parts).encode("utf-8")
    raw = blake3.blake3(text).digest(length=8 * count)
    return struct.unpack(f"<{count}Q", raw)


class Feistel:
    """Keyed bijection of [0, n) with O(1) memory; `forward` and `inverse`."""

    __slots__ = ("n", "half", "mask", "keys")
    _SCALAR_TAIL = 16  # forward_many walks at most this many values one at a time

    def __init__(self, n: int, keys: tuple[int, ...]) -> None:
        if n < 0:
            raise ValueError(f"Feistel domain must be >= 0, got {n}")
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = keys

    def _enc(self, x: int) -> int:
        half, mask = self.half, self.mask
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        return (left << half) | right

    def _dec(self, y: int) -> int:
        half, mask = self.half, self.mask
        left, right = y >> half, y & mask
        for k in reversed(self.keys):
            left, right = right ^ (mix64(left ^ k) & mask), left
        return (left << half) | right

    def forward(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"position {i} outside [0, {self.n})")
        y = self._enc(i)
        while y >= self.n:  # cycle walking keeps the map inside [0, n)
            y = self._enc(y)
        return y

    def forward_many(self, xs: np.ndarray) -> np.ndarray:
        """Vectorized `forward` over an int64 array of positions (all in [0, n)); in compiled code once a kernel
        was handed over (`use_compiled`), the same values."""
        if _COMPILED is not None and len(xs):
            out = np.empty(len(xs), dtype=np.int64)
            try:
                _COMPILED(np.ascontiguousarray(xs, dtype=np.int64), np.array(self.keys, dtype=np.uint64),
                          np.uint64(self.half), np.uint64(self.mask), np.uint64(self.n), out)
                return out
            except TypeError:  # a type not compiled (compiling is off after the load): numpy below
                pass
        half = np.uint64(self.half)
        mask = np.uint64(self.mask)
        y = xs.astype(np.uint64)
        todo = np.ones(y.shape, dtype=bool)
        n = np.uint64(self.n)
        keys = [np.uint64(k) for k in self.keys]
        while True:  # cycle walking, only on the values still outside [0, n)
            v = y[todo]
            left, right = v >> half, v & mask
            with np.errstate(over="ignore"):
                for k in keys:  # right' = left ^ (mix64(right ^ k) & mask), in place, modulo 2**64
                    z = right ^ k
                    z ^= z >> _S30
                    z *= _C1
                    z ^= z >> _S27
                    z *= _C2
                    z ^= z >> _S31
                    z &= mask
                    z ^= left
                    left, right = right, z
            y[todo] = (left << half) | right
            todo = y >= n
            at = np.flatnonzero(todo)
            if len(at) <= self._SCALAR_TAIL:
                break
        out = y.astype(np.int64)
        # The last few values walk one at a time: a vectorized round costs ~60 numpy calls whatever the
        # size, many times a scalar encryption, and the tail of a chunk takes several rounds for a
        # handful of values (measured, docs/logical.md).
        for i in at.tolist():
            z = self._enc(int(out[i]))
            while z >= self.n:
                z = self._enc(z)
            out[i] = z
        return out

    def inverse(self, y: int) -> int:
        if not 0 <= y < self.n:
            raise IndexError(f"value {y} outside [0, {self.n})")
        x = self._dec(y)
        while x >= self.n:
            x = self._dec(x)
        return x


class Order:
    """Epoch order of one source: `sample_at(position)` and `position_of(sample)`."""

    name = ORDER_VERSIONS["none"]  # also a key-derivation prefix: a new version is a new stream

    def __init__(self, n: int) -> None:
        self.n = n

    def sample_at(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        return position

    def position_of(self, sample: int) -> int:
        if not 0 <= sample < self.n:
            raise IndexError(f"sample {sample} outside [0, {self.n})")
        return sample

    def sample_many(self, positions: np.ndarray) -> np.ndarray:
        """`sample_at` for an array of positions (the fast path of lanes' prefetch)."""
        return np.array([self.sample_at(int(p)) for p in positions], dtype=np.int64)


class FeistelOrder(Order):
    name = ORDER_VERSIONS["global"]

    def __init__(self, n: int, key: tuple[object, ...]) -> None:
        super().__init__(n)
        self.perm = Feistel(n, derive_keys(self.name, *key))

    def sample_at(self, position: int) -> int:
        return self.perm.forward(position)

    def position_of(self, sample: int) -> int:
        return self.perm.inverse(sample)

    def sample_many(self, positions: np.ndarray) -> np.ndarray:
        return self.perm.forward_many(positions)


class BlockShuffleOrder(Order):
    """Shards permuted, then samples permuted within windows of `window` shards."""

    name = ORDER_VERSIONS["block"]

    def __init__(self, counts: tuple[int, ...], window: int, key: tuple[object, ...]) -> None:
        super().__init__(sum(counts))
        self.counts = counts
        self.window = window
        self.key = key
        # Object start offsets in source order (for sample -> object lookups).
        self.obj_start = [0]
        for c in counts:
            self.obj_start.append(self.obj_start[-1] + c)
        shard_perm = Feistel(len(counts), derive_keys(self.name, "shards", *key))
        self.perm_objs = [shard_perm.forward(i) for i in range(len(counts))]
        self.rank_of_obj = {o: i for i, o in enumerate(self.perm_objs)}
        # Window w covers permuted shards [w*window, (w+1)*window); positions of
        # window w start at win_start[w]. Within a window, shards are laid out in
        # permuted order: shard_off[i] is the offset of permuted shard i there.
        self.win_start = [0]
        self.shard_off = []
        for w in range(0, len(counts), window):
            off = 0
            for o in self.perm_objs[w : w + window]:
                self.shard_off.append(off)
                off += counts[o]
            self.win_start.append(self.win_start[-1] + off)
        self._win_start_np = np.asarray(self.win_start, dtype=np.int64)
        self._obj_start_np = np.asarray(self.obj_start, dtype=np.int64)
        self._perm_objs_np = np.asarray(self.perm_objs, dtype=np.int64)
        self._shard_off_np = np.asarray(self.shard_off, dtype=np.int64)

    @lru_cache(maxsize=64)  # noqa: B019 - bounded, per-instance windows
    def _win_perm(self, w: int) -> Feistel:
        return Feistel(self.win_start[w + 1] - self.win_start[w], derive_keys(self.name, "window", w, *self.key))

    def sample_at(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        w = bisect.bisect_right(self.win_start, position) - 1
        local = self._win_perm(w).forward(position - self.win_start[w])
        first = w * self.window
        offs = self.shard_off[first : first + self.window]
        i = bisect.bisect_right(offs, local) - 1
        obj = self.perm_objs[first + i]
        return self.obj_start[obj] + (local - offs[i])

    def sample_many(self, positions: np.ndarray) -> np.ndarray:
        """`sample_at` over an int64 array: one vectorized Feistel call per window the positions touch.

        A lane's chunk of positions lies in one or two windows, so this costs a few numpy calls
        instead of a Python Feistel walk per position (the block order's share of a pre-tokenized
        step, docs/performance.md).
        """
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise IndexError(f"position {bad} outside [0, {self.n})")
        win = np.searchsorted(self._win_start_np, pos, side="right") - 1
        out = np.empty(len(pos), dtype=np.int64)
        for w in sorted_unique(win).tolist():
            at = win == w
            local = self._win_perm(w).forward_many(pos[at] - self.win_start[w])
            first = w * self.window
            offs = self._shard_off_np[first : first + self.window]
            i = np.searchsorted(offs, local, side="right") - 1  # = bisect_right: skips empty shards
            out[at] = self._obj_start_np[self._perm_objs_np[first + i]] + (local - offs[i])
        return out

    def position_of(self, sample: int) -> int:
        if not 0 <= sample < self.n:
            raise IndexError(f"sample {sample} outside [0, {self.n})")
        obj = bisect.bisect_right(self.obj_start, sample) - 1
        while self.counts[obj] == 0 or sample >= self.obj_start[obj + 1]:
            obj += 1
        rank = self.rank_of_obj[obj]
        w = rank // self.window
        local = self.shard_off[rank] + (sample - self.obj_start[obj])
        return self.win_start[w] + self._win_perm(w).inverse(local)


def make_order(
    kind: str, counts: tuple[int, ...], *, dataset_id: str, seed: int, source: str, epoch: int, window: int
) -> Order:
    """The epoch order of a source; `kind` is the run spec's `order` value."""
    key = (dataset_id, seed, source, epoch)
    if kind == "global":
        return FeistelOrder(sum(counts), key)
    if kind == "block":
        return BlockShuffleOrder(counts, window, key)
    if kind == "none":
        return Order(sum(counts))
    raise ValueError(f"unknown order {kind!r}")


def lane_share(n: int, lanes: int, lane: int) -> int:
    """How many positions of an epoch of n samples lane `lane` of `lanes` owns."""
    return max(0, (n - lane + lanes - 1) // lanes)
