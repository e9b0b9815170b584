"""The client's end of a daemon's arena: BATCH arrays read where the producer wrote them (loaderd/arena.py).

Nothing in the daemon's offer is taken on trust: the path must be a ring
file name under /dev/shm, the file a regular one of this user at least as
large as the offer says, and every reference's parts inside one slot of it,
whose turn is the reference's.

The file is mapped privately (copy on write): a trainer that writes into its
batch (labels masked in place) writes its own copy of those pages, never
what the daemon serves to anyone else. Those copies would hide the daemon's
next block in the same pages, so before this process returns its leases on
a slot (the next GET's ``release_arena``), once none of its arrays there is
alive, it reads which pages of the slot it wrote (/proc/self/pagemap: an
anonymous page where the file's was) and drops them (``MADV_DONTNEED``: the
file's pages again). A client asks for the arena only where it can read
that (`available`); elsewhere its ring or frames serve it.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import os
import stat
import sys
import tempfile
import weakref
from typing import Any

import numpy as np

from sluice.errors import ProtocolError
from sluice.wire import ring as wire_ring

__all__ = ["ClientArena", "available", "hello_field", "take_offer"]

_PREFIX = "/dev/shm/sluice-ring-"
_frombuffer, _finalize, _UINT8 = np.frombuffer, weakref.finalize, np.dtype(np.uint8)
_MAX_BYTES = 1 << 36
PAGE = mmap.PAGESIZE
# A page this process wrote: the pagemap entry's top byte (bits 56-63) says present (0x80) or swapped (0x40) and
# not a file page (0x20): copied on write.
_WRITTEN = bytes(1 if (b & 0x20) == 0 and (b & 0xC0) else 0 for b in range(256))


@functools.cache
def available() -> bool:
    """This process can tell which arena pages it wrote and reads the slots' turns as the daemon writes them
    (little-endian): tried once on a page of its own in /dev/shm, mapped as an arena is (read: the file's page;
    written: this process's copy, as /proc/self/pagemap must say, or no arena is asked for)."""
    if sys.byteorder != "little" or not os.path.isdir("/dev/shm"):
        return False
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        with tempfile.TemporaryFile(dir="/dev/shm") as f:
            f.write(bytes(PAGE))  # (a page in the file: a hole would read as the zero page, no file's page)
            f.flush()
            m = mmap.mmap(f.fileno(), PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                at = ctypes.c_char.from_buffer(m)
                entry = ctypes.addressof(at) // PAGE * 8
                del at
                if m[0] != 0:
                    return False
                read = os.pread(fd, 8, entry)[7]
                m[0] = 1
                written = os.pread(fd, 8, entry)[7]
            finally:
                m.close()
        return bool(read & 0x80) and not _WRITTEN[read] and bool(_WRITTEN[written])
    except (OSError, ValueError, IndexError):
        return False
    finally:
        os.close(fd)


def hello_field(endpoint: str, ring: bool) -> dict[str, Any]:
    """A HELLO body's ``arena`` (this process: pid, start time, pid namespace) where a client of `endpoint` that
    reads shared memory (`ring`) can take the arena; else nothing."""
    if not (ring and endpoint.startswith("ipc://") and available()):
        return {}
    me = wire_ring.own_process()
    return {} if me is None else {"arena": {"pid": me[0], "start": me[1], "pidns": me[2]}}


class ClientArena:
    """The arena a daemon offered in HELLO_OK (`offer`: path, id, slots, slot_bytes, head), mapped privately.
    OSError where it cannot be opened, ProtocolError where the offer is not an arena's."""

    def __init__(self, offer: Any) -> None:
        if not (type(offer) is dict and set(offer) == {"path", "id", "slots", "slot_bytes", "head"}
                and type(offer["id"]) is str and len(offer["id"]) == 16 and wire_ring.is_hex(offer["id"])
                and type(offer["path"]) is str and offer["path"].startswith(_PREFIX)
                and "/" not in offer["path"][len(_PREFIX):]
                and type(offer["slots"]) is int and 1 <= offer["slots"] <= 1024
                and type(offer["slot_bytes"]) is int and 0 < offer["slot_bytes"] and offer["slot_bytes"] % PAGE == 0
                and type(offer["head"]) is int and 8 * offer["slots"] <= offer["head"] and offer["head"] % PAGE == 0
                and offer["head"] + offer["slots"] * offer["slot_bytes"] <= _MAX_BYTES):
            raise ProtocolError(f"the arena offered in HELLO_OK must be a file {_PREFIX}* of whole-page slots, got "
                                f"{offer!r:.300}")
        self.id, self.slots = bytes.fromhex(offer["id"]), offer["slots"]
        self.slot_bytes, self.head = offer["slot_bytes"], offer["head"]
        self.size = self.head + self.slots * self.slot_bytes
        fd = os.open(offer["path"], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < self.size:
                raise ProtocolError(f"arena file {offer['path']} is not an arena of this user of {self.size} bytes")
            # private: writable as torch wants, a write copying the page for this process only (module docstring)
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        at = ctypes.c_char.from_buffer(self._map)
        self._page0 = ctypes.addressof(at) // PAGE  # (the map starts on a page)
        del at
        self._turns = memoryview(self._map)[:8 * self.slots].cast("Q")  # each slot's turn (native: little-endian)
        self._alive = [0] * self.slots  # replies of the slot whose arrays live here
        self._seen = [False] * self.slots  # viewed since its last check
        self._owed: dict[tuple[int, int], int] = {}  # (slot, turn) -> leases not yet returned
        self._ready: list[tuple[int, int, int]] = []  # leases to return in the next GET
        self.released: collections.deque[tuple[int, int]] = collections.deque()  # finalizers' (any thread)
        self.dropped = 0  # slots whose pages this process had written, dropped before their leases went back

    def take(self, slot: int, turn: int, parts: list[tuple[int, int]], frame: Any, at: int) -> list[Any]:
        """The array frames of a reference (`wire.ring.parse_arena_ref`'s slot, turn, parts; `frame` the
        reference's buffer, its inline bytes from `at`): views of the slot (one lease, returned once they are all
        gone) and of the frame. ProtocolError for a part outside the slot or a slot not of that turn."""
        lo = self.head + slot * self.slot_bytes
        first = last = -1
        for off, n in parts:
            if off != -1:
                if first == -1 or off < first:
                    first = off
                if off + n > last:
                    last = off + n
        if first < lo or last > lo + self.slot_bytes or last <= first or slot >= self.slots:
            raise ProtocolError(f"loaderd sent an arena reference outside slot {slot} of its {self.slots}")
        if self._turns[slot] != turn:
            raise ProtocolError(f"arena slot {slot} holds turn {self._turns[slot]}, the reply names turn {turn} "
                                "(a bug in sluice; report it)")
        view = _frombuffer(self._map, _UINT8, last - first, first)
        _finalize(view, self.released.append, (slot, turn))
        self._alive[slot] += 1
        self._seen[slot] = True
        out: list[Any] = []
        for off, n in parts:
            if off == -1:
                out.append(frame[at:at + n])
                at += n
            else:
                out.append(view[off - first:off - first + n])
        return out

    def release_field(self) -> bytes:
        """The next GET's ``release_arena`` member (``,"release_arena":[[slot,turn,n],...]``, JSON as `encoding`
        writes it): the leases of each slot none of whose arrays is alive any more, its written pages dropped
        first; b"" when none (at most `slots` triples a GET, the rest the next)."""
        done, owed, alive = self.released, self._owed, self._alive
        while done:
            key = done.popleft()  # (slot, turn); a finalizer may append meanwhile, in any thread
            owed[key] = owed.get(key, 0) + 1
            slot = key[0]
            alive[slot] -= 1
            if not alive[slot]:
                self._clean(slot)
                for k in [k for k in owed if k[0] == slot]:
                    self._ready.append((slot, k[1], owed.pop(k)))
        if not self._ready:
            return b""
        send, self._ready = self._ready[:self.slots], self._ready[self.slots:]
        return b',"release_arena":[' + b",".join(b"[%d,%d,%d]" % t for t in send) + b"]"

    def _clean(self, slot: int) -> None:
        """Drop the pages of `slot` this process wrote (module docstring): one read of the slot's pagemap entries
        (6 KiB for a 3 MiB slot) once its arrays are all gone, not one a reply."""
        if not self._seen[slot]:
            return
        self._seen[slot] = False
        p0 = (self.head + slot * self.slot_bytes) // PAGE
        p1 = p0 + self.slot_bytes // PAGE
        tops = os.pread(self._pagemap, 8 * (p1 - p0), 8 * (self._page0 + p0))[7::8]
        if b"\x01" in tops.translate(_WRITTEN):
            self._map.madvise(mmap.MADV_DONTNEED, p0 * PAGE, (p1 - p0) * PAGE)
            self.dropped += 1

    def close(self) -> None:
        os.close(self._pagemap)
        self._turns.release()
        try:
            self._map.close()
        except BufferError:  # (an array still viewing it: closed with it)
            pass


def take_offer(old: ClientArena | None, offer: Any, endpoint: str) -> ClientArena | None:
    """The arena a HELLO_OK offers (None: none) in place of `old`: `old` itself where it is the same arena (a
    reconnection to the same daemon: its arrays stay valid and its leases are returned as before), else `old`
    closed and the offer mapped; one that cannot be opened leaves the connection on its ring or frames."""
    if old is not None and type(offer) is dict and offer.get("id") == old.id.hex():
        return old
    if old is not None:
        old.close()
    if offer is None:
        return None
    try:
        return ClientArena(offer)
    except OSError as exc:
        import logging

        logging.getLogger("sluice.client").info(f"loaderd at {endpoint} offered an arena this client cannot open "
                                                f"({exc}); reading its ring or frames")
        return None
