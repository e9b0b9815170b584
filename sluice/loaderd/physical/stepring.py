"""The shared-memory step ring between a producer process and the daemon (`loaderd --producer process`).

A producer process writes each step's block into a ring of shared memory the
daemon mapped before starting it, and sends the daemon only a small fixed
binary notice (where the block lies and how it is cut) on its PUSH socket. The
daemon answers GETs from numpy views on the ring (copied into the reply frames
by libzmq, never sent zero-copy: the child reuses the bytes once the step is
released) and reports the floor (oldest unreleased step) as before; the child
frees the slots below the floor. Nothing from the child is unpickled or
trusted: every notice is validated against the ring's size and its own
arithmetic (`read_step`), and the JSON parts (the state, sample IDs) are decoded
strictly before they reach a client.

Slot of one step (offsets from the slot's start; the arrays of sluice/batcharrays.py in their order, each
of its declared dtype, at a multiple of its item size)::

    micro 0: input_ids[rows0*seq] labels[rows0*seq] position_ids[rows0*seq] cu_seqlens[cu0] (then any other)
    micro 1: ...
    samples JSON of micro 0, micro 1, ...   (bytes; lengths in the notice)
    state JSON                               (bytes; `stepqueue.state_json` of the state after the step)

Notice (little-endian): ``HEAD`` = magic, micro count, epoch, step, slot
offset, slot bytes, seq, state bytes; then per micro ``MICRO`` = rows, the
length of each `PIECES` array (cu_seqlens), samples bytes, source counts;
then each micro's source counts as ``COUNT`` = (source index, tokens) pairs
(the tokens of each source in it: ``sluice_source_served_tokens_total``).
A `ROWS` array holds ``rows * seq`` items.

Ring policy (`Ring`, the child's allocator): slots are freed in step order
(the daemon's floor); a new slot goes in the lowest-addressed gap that takes
it, so the touched extent of the mapping stays near the live bytes instead of
cycling through all of it (fewer cold pages and cache misses), while all of
it is used when the steps need it. At the limit (no room for the
next step) the child waits for the daemon's FLOOR or RESET, as it waited at
the byte bound before; a step larger than the whole ring goes over the socket
as wire frames instead (a too-small `--queue-bytes` slows the daemon down,
never deadlocks it). The memory is a `memfd` (or an unlinked temporary file
where there is none) passed to the child as a file descriptor: it has no name,
so a killed daemon or child never leaves a segment in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from collections import deque
from typing import Any

import numpy as np

from sluice import batcharrays
from sluice.errors import ProtocolError

MAGIC = b"SLR1"
HEAD = struct.Struct("<4sIqqQQII")  # magic, n_micro, epoch, step, offset, nbytes, seq, state_len
MICRO = struct.Struct("<I" + "I" * len(batcharrays.PIECE_ARRAYS) + "II")  # rows, piece lengths, samples, counts
COUNT = struct.Struct("<II")  # source index, tokens
ALIGN = 64  # slot offsets: int32 views aligned, and no two slots share a cache line
MAX_MICROS = 4096
# Per declared array, in order: (name, dtype, item size, a ROWS array (rows * seq items; else its length is in
# the notice), whether its start needs aligning: only an array whose items are wider than the narrowest
# declared can follow one that ends off its alignment, so while every array is int32 none does)
_NARROWEST = min(np.dtype(a.dtype).itemsize for a in batcharrays.ARRAYS)
_ARRAYS = tuple((a.name, np.dtype(a.dtype), np.dtype(a.dtype).itemsize, a.shape == batcharrays.ROWS,
                 np.dtype(a.dtype).itemsize > _NARROWEST) for a in batcharrays.ARRAYS)
_ndarray = np.ndarray  # (shape, dtype, buffer, offset): a view in one call (frombuffer + reshape: two arrays)


def create_memory(nbytes: int) -> int:
    """A new anonymous shared-memory file of `nbytes` (zero-filled, sparse); returns its fd (close-on-exec)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("sluice-step-ring")
    else:  # pragma: no cover - no memfd (not Linux): an unlinked file, in RAM where /dev/shm exists
        fd, path = tempfile.mkstemp(prefix="sluice-step-ring-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


CONTROL_BYTES = 4096  # after the ring: the control words (one page)
FLOOR_WORD, WAIT_WORD = 0, 1  # the daemon's floor (it writes); the floor the child waits for (it writes; 0: none)
_FLOOR_BITS = 48


def control_words(mem: Any, ring_size: int) -> np.ndarray:
    """The two int64 control words after the ring (aligned: each is read and written whole)."""
    return np.frombuffer(mem, np.int64, 2, ring_size)


def pack_floor(epoch: int, floor: int) -> int:
    """A control word: the epoch's low 15 bits over a 48-bit floor (an epoch's words are told from another's)."""
    return ((epoch & 0x7FFF) << _FLOOR_BITS) | (floor & ((1 << _FLOOR_BITS) - 1))


def unpack_floor(word: int, epoch: int) -> int | None:
    """The floor in `word` if it was written in `epoch`, else None."""
    if word >> _FLOOR_BITS != epoch & 0x7FFF:
        return None
    return word & ((1 << _FLOOR_BITS) - 1)


def slot_bytes(micros: list[dict[str, np.ndarray]], samples: list[bytes], state: bytes) -> int:
    """The bytes the slot of a step with these parts takes (before alignment)."""
    pos = 0
    for m in micros:
        for name, _, size, _, align in _ARRAYS:
            pos = (-(-pos // size) * size if align else pos) + m[name].nbytes
    return pos + sum(map(len, samples)) + len(state)


def writable(micros: list[dict[str, np.ndarray]]) -> bool:
    """True if the step's arrays fit the slot layout: every declared array of its dtype, the `ROWS` ones 2-D
    rows of one length, the `PIECES` ones 1-D."""
    if not micros:
        return False
    seq = micros[0]["input_ids"].shape[-1] if micros[0]["input_ids"].ndim == 2 else -1
    for m in micros:
        shape = m["input_ids"].shape
        if len(shape) != 2 or shape[1] != seq:
            return False
        for name, dt, _, by_rows, _ in _ARRAYS:
            a = m.get(name)
            if a is None or a.dtype != dt or (a.shape != shape if by_rows else a.ndim != 1):
                return False
    return seq > 0 and len(micros) <= MAX_MICROS


def write_step(mem: Any, offset: int, *, epoch: int, step: int, micros: list[dict[str, np.ndarray]],
               samples: list[bytes], state: bytes, counts: list[tuple[tuple[int, int], ...]] | None = None) -> bytes:
    """Write a step's slot at `offset` of `mem` (a writable buffer) and return its notice (the child's side);
    `counts`: each micro-batch's (source index, tokens) (`StepEntry.source_tokens`; None: none counted)."""
    seq = micros[0]["input_ids"].shape[1]
    pos = offset
    parts = []
    counted = counts if counts is not None else [()] * len(micros)
    for m, s, c in zip(micros, samples, counted, strict=True):
        lengths = []
        for name, dt, size, by_rows, align in _ARRAYS:
            a = m[name]
            if align:
                pos = -(-pos // size) * size
            np.copyto(_ndarray(a.shape, dt, mem, pos), a)
            pos += a.nbytes
            if not by_rows:
                lengths.append(a.size)
        parts.append(MICRO.pack(m["input_ids"].shape[0], *lengths, len(s), len(c)))
    parts += [COUNT.pack(src, n) for c in counted for src, n in c]
    for s in samples:
        mem[pos:pos + len(s)] = s
        pos += len(s)
    mem[pos:pos + len(state)] = state
    pos += len(state)
    return HEAD.pack(MAGIC, len(micros), epoch, step, offset, pos - offset, seq, len(state)) + b"".join(parts)


def is_notice(frame: bytes) -> bool:
    return frame[:4] == MAGIC


def read_step(notice: bytes, ring: Any, size: int, sources: int = 0) -> tuple[
        int, int, int, list[dict[str, np.ndarray]], list[Any], bytes, list[tuple[tuple[int, int], ...]]]:
    """Validate a notice against a ring of `size` bytes and a manifest of `sources` sources; (epoch, step, slot
    bytes, micros as views on `ring`, each micro's samples JSON as a memoryview slice, the state JSON bytes,
    each micro's (source index, tokens)). Raises ProtocolError naming what is wrong (the daemon's side)."""
    if len(notice) < HEAD.size:
        raise ProtocolError(f"step notice of {len(notice)} bytes is shorter than its {HEAD.size}-byte head")
    magic, n_micro, epoch, step, offset, nbytes, seq, state_len = HEAD.unpack_from(notice)
    heads = HEAD.size + n_micro * MICRO.size
    if magic != MAGIC or not 1 <= n_micro <= MAX_MICROS or len(notice) < heads:
        raise ProtocolError(f"step notice of {len(notice)} bytes with {n_micro} micro-batches is malformed")
    per = [MICRO.unpack_from(notice, HEAD.size + i * MICRO.size) for i in range(n_micro)]
    if len(notice) != heads + COUNT.size * sum(p[-1] for p in per):
        raise ProtocolError(f"step notice of {len(notice)} bytes with {n_micro} micro-batches is malformed")
    if offset % ALIGN or offset + nbytes > size or seq < 1:
        raise ProtocolError(f"step {step}: slot at {offset} of {nbytes} bytes (seq {seq}) lies outside the "
                            f"{size}-byte ring or is misaligned")
    micros: list[dict[str, np.ndarray]] = []
    lens = []
    pos, end = offset, offset + nbytes
    counts: list[tuple[tuple[int, int], ...]] = []
    at = heads
    for i, (rows, *lengths, samples_len, n_counts) in enumerate(per):
        got = tuple(COUNT.unpack_from(notice, at + j * COUNT.size) for j in range(n_counts))
        at += n_counts * COUNT.size
        if any(src >= sources or k > rows * seq for src, k in got) or sum(k for _, k in got) > rows * seq:
            raise ProtocolError(f"step {step}: micro-batch {i}'s source counts {list(got)[:8]} name a source "
                                f"beyond the manifest's {sources} or more tokens than its {rows} x {seq}")
        counts.append(got)
        micro = {}
        piece_lengths = iter(lengths)
        for name, dt, size, by_rows, align in _ARRAYS:
            if align:
                pos = -(-pos // size) * size
            shape = (rows, seq) if by_rows else (next(piece_lengths),)
            nxt = pos + (rows * seq if by_rows else shape[0]) * size
            if nxt > end:
                pieces = ", ".join(f"{k} {p}" for k, p in zip(lengths, batcharrays.PIECE_ARRAYS))
                raise ProtocolError(f"step {step}: micro-batch {i} ({rows} x {seq} rows, {pieces}) "
                                    f"runs past its {nbytes}-byte slot")
            micro[name] = _ndarray(shape, dt, ring, pos)
            pos = nxt
        micros.append(micro)
        lens.append(samples_len)
    if pos + sum(lens) + state_len != offset + nbytes:
        raise ProtocolError(f"step {step}: slot of {nbytes} bytes does not match its parts "
                            f"({pos - offset + sum(lens) + state_len} bytes)")
    view = memoryview(ring)
    samples = []
    for n in lens:
        samples.append(view[pos:pos + n])
        pos += n
    return epoch, step, nbytes, micros, samples, bytes(view[pos:pos + state_len]), counts


class Ring:
    """The child's allocator over a ring of `size` bytes: FIFO slots, one per step (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.live: deque[tuple[int, int, int]] = deque()  # (step, offset, end) oldest first
        self.used = 0  # bytes of the live slots

    def alloc(self, step: int, nbytes: int) -> int | None:
        """The offset of a new slot of `nbytes` for `step` (later than every live step), or None if no room.

        Lowest-address first fit among the live slots (a few: at most the step lead, so sorting them costs
        microseconds): the touched extent stays near the live bytes, yet the whole ring is used when needed.
        """
        n = -(-max(nbytes, 1) // ALIGN) * ALIGN
        at = 0
        off = None
        for lo, hi in sorted((lo, hi) for _, lo, hi in self.live):
            if lo - at >= n:
                off = at
                break
            at = max(at, hi)
        else:
            if self.size - at >= n:
                off = at
        if off is not None:
            self.live.append((step, off, off + n))
            self.used += n
        return off

    def free_below(self, floor: int) -> None:
        """Free the slots of steps below `floor` (the daemon released them)."""
        while self.live and self.live[0][0] < floor:
            _, off, end = self.live.popleft()
            self.used -= end - off

    def clear(self) -> None:
        """Free every slot (a RESET: the daemon dropped every step it held)."""
        self.live.clear()
        self.used = 0


def map_memory(fd: int, size: int) -> mmap.mmap:
    """Map the ring (both sides, shared, read-write)."""
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
