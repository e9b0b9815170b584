"""A BATCH's arrays through shared memory: what a daemon and a client on one host agree on (docs/protocol.md).

Moving a `[8, 2048]` micro-batch (196 KB) through the socket costs about
0.075 ms of CPU on the two sides together, a fifth of what sluice spends per
micro-batch (`bench/servefloor.py --jobs raw,shm`). A client of an ipc://
endpoint (on the daemon's host by construction) asks in HELLO for a ring of
`slots` slots; the daemon answers with a file it made for that connection
(`loaderd/rings.py`). A BATCH then carries its header and a reference frame
(`ref`: `MAGIC`, the ring's ID, the slot, the bytes, the turn) instead of its array frames (a
reply of an earlier connection, whose ring the client no longer holds, names another ID and is dropped
as stale): the slot
holds those frames' bytes back to back, the packed form a client reads anyway.

Each slot starts with its turn (the daemon's count of ring replies, uint64),
set to `WRITING` before the arrays are written and to the turn after; the
reference names the turn, and the client checks it where it reads the slot.

Why a slot is never written while its client reads it:

* leased slots (the client asks ``"lease": true``, the daemon's offer echoes
  it): the client's arrays view the slot; it names the slot in a GET's
  ``release`` once they are all gone, and the daemon writes only slots
  released (all of them at first), sending frames while none is free;
* otherwise the client copies a slot out as it receives the reply, before it
  sends another GET (the turn checked before and after the copy: a seqlock);
  the daemon writes a slot only to answer a GET, and uses the slots in turn.
  With at most `credits` GETs in flight, the replies sent but not yet copied
  are fewer than `credits`, so with ``slots > credits`` the slot written now
  was copied out long ago (the client asks for ``2 * credits``, at most ``credits + 8``).
"""

from __future__ import annotations

import os
import struct
from typing import Any

__all__ = ["ARENA_MAGIC", "HEAD", "MAGIC", "MAX_JOINED", "MAX_PARTS", "MAX_SLOTS", "REF_BYTES", "WRITING", "arena_ref",
           "is_hex", "own_process", "parse_arena_ref", "parse_ref", "ref", "slot_bytes", "start_ticks"]

MAGIC = b"SLRING01"
_REF = struct.Struct("<8sIIQ")  # the ring's ID, the slot, the bytes its arrays take, its turn (little-endian)
REF_BYTES = len(MAGIC) + _REF.size
MAX_SLOTS = 64
HEAD = 8  # a slot's turn, before its arrays
WRITING = 2**64 - 1  # a slot's turn while the daemon writes it
# The most ring replies one message joins (docs/protocol.md, "Joined replies"): 2 x MAX_JOINED frames, a
# header and a reference each; a client refuses a longer one.
MAX_JOINED = 16


def ref(ring_id: bytes, slot: int, nbytes: int, turn: int) -> bytes:
    """The frame that stands for a BATCH's arrays: `nbytes` in slot `slot` of ring `ring_id` (8 bytes, the
    offer's ``id``), written at `turn`."""
    return MAGIC + _REF.pack(ring_id, slot, nbytes, turn)


def parse_ref(frame: bytes | memoryview) -> tuple[bytes, int, int, int] | None:
    """(ring ID, slot, bytes, turn) of a reference frame; None for any other frame (frame 1 of a BATCH sent as
    frames, alone or packed, holds its token ids: never `REF_BYTES` long and starting with `MAGIC` at any
    real shape, which is how a client tells ring replies, one or joined, from frames)."""
    if len(frame) != REF_BYTES or bytes(frame[:len(MAGIC)]) != MAGIC:
        return None
    return _REF.unpack_from(frame, len(MAGIC))


def slot_bytes(micro_batch: int, seq_len: int) -> int:
    """A slot's size: its turn and the most bytes one micro-batch's arrays take (sluice/batcharrays.py):
    three int32 planes of ``micro_batch x seq_len`` and cu_seqlens, at most one piece a token (plus its end)."""
    tokens = micro_batch * seq_len
    return -(-(HEAD + 3 * 4 * tokens + 4 * (tokens + 1)) // 64) * 64  # (whole cache lines: every head aligned)


# The arena (docs/protocol.md, "Arena"): the producers' blocks in one shared file, a reply naming where its arrays lie.
ARENA_MAGIC = b"SLARENA1"
_AREF = struct.Struct("<8sIQH")  # the arena's ID, the slot, its turn, how many parts
_PART = struct.Struct("<qI")  # a part: its offset in the arena's file (-1: its bytes follow the parts), its bytes
_AHEAD = len(ARENA_MAGIC) + _AREF.size
MAX_PARTS = 16  # a BATCH's array frames at most (one a plane or array; the header's limit is higher)


def arena_ref(arena_id: bytes, slot: int, turn: int, parts: list[tuple[int, int]], inline: list[Any]) -> bytes:
    """The frame that stands for a BATCH's array frames in the arena `arena_id`: each of `parts` ``(offset,
    nbytes)`` is a frame's bytes at that offset of the arena's file (within `slot`, written at `turn`), or, with
    offset -1, the next buffer of `inline`, whose bytes follow the parts in this frame."""
    return b"".join((ARENA_MAGIC, _AREF.pack(arena_id, slot, turn, len(parts)),
                     *(_PART.pack(off, n) for off, n in parts), *inline))


def parse_arena_ref(frame: Any) -> tuple[bytes, int, int, list[tuple[int, int]], int] | None:
    """(arena ID, slot, turn, parts, where the inline bytes start) of an arena reference frame (`arena_ref`);
    None for any other frame: one that does not start with `ARENA_MAGIC`, or whose length is not exactly what
    its parts say (frame 1 of a BATCH sent as frames holds token ids, which never spell the magic at any real
    vocabulary: 0x52414c53 is over a billion)."""
    n = len(frame)
    if n < _AHEAD or frame[:8] != ARENA_MAGIC:
        return None
    count = frame[_AHEAD - 2] + 256 * frame[_AHEAD - 1]  # (the header's last field, uint16 little-endian)
    at = _AHEAD + count * _PART.size
    if count > MAX_PARTS or n < at:
        return None
    got = _parts(count).unpack_from(frame, 8)
    parts = [(got[i], got[i + 1]) for i in range(4, 4 + 2 * count, 2)]
    inline = 0
    for off, size in parts:
        if off < 0:
            if off != -1:
                return None
            inline += size
    return (got[0], got[1], got[2], parts, at) if at + inline == n else None


def _parts(count: int, _kept: dict[int, struct.Struct] = {}) -> struct.Struct:  # noqa: B006 - a cache
    """The `struct.Struct` of a reference's fields after the magic with `count` parts, made once a count."""
    got = _kept.get(count)
    if got is None:
        got = _kept[count] = struct.Struct(_AREF.format + "qI" * count)
    return got


def own_process() -> tuple[int, int, str] | None:
    """This process as an arena's HELLO names it: (pid, start time in clock ticks since boot, pid namespace);
    None where /proc does not say (not Linux)."""
    pid = os.getpid()
    start = start_ticks(pid)
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return None if start is None else (pid, start, ns)


def start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (after the command's parenthesis, which may hold spaces); None: no such
    process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text[text.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def is_hex(text: str) -> bool:
    """`text` is hexadecimal digits in pairs (an offer's ``id``)."""
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
