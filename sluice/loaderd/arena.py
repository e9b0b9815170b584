"""The daemon's arena: the producers' blocks in shared memory, so a BATCH for a client on this host is a reference.

Without it every micro-batch's arrays were written twice in the daemon: by
the producer into its call's block, then by the IO thread into the client's
ring slot (rings.py), 15-20 us of the IO thread's ~65 a micro-batch at
`[8, 2048]` (bench/results/README.md, "Stop 41"). With it the producer's
kernel writes a call's block (``(steps, 3, rows, seq_len)`` int32) into a
slot of one file under /dev/shm that the daemon's ipc:// clients map (a slot
holds the largest block a call makes, or several smaller ones, each on whole
pages), and a BATCH carries a reference frame naming where each of its array
frames lies (wire/ring.py, `arena_ref`); small arrays not in a block
(cu_seqlens) ride inline in that frame.

When a slot is written again -- only once both hold:

* every block in it is gone in the daemon: every step of its call left the
  step queue (a `weakref.finalize` on the block; numpy's views keep it alive);
* no client holds a lease on it: each reference sent is a lease of its
  client's process, returned by the client once none of its arrays in that
  slot is alive (GET ``release_arena``: ``[[slot, turn, n], ...]``), or
  dropped when that process is gone (`reap`: the pid and start time its HELLO
  gave, checked in /proc; offered only to a process in this daemon's pid
  namespace, where that check means something).

A client maps the arena privately (copy on write): a trainer that writes into
its batch (labels masked in place) changes its own pages only, and drops them
before it returns the lease (client/arena.py), so the bytes a re-sent step
carries are the producer's.

Bounds and fall-backs, each counted in STATS ``arena``: `slots` slots of one
call's largest block (a few MiB at `[8, 2048]`); a block that does not fit a
slot (``heap.too_large``) or finds every slot in use (``heap.full``: a
trainer keeping its batches, a client process that stopped reading) is made
on the heap and sent as before (its client's ring, or frames); a client that
cannot be offered the arena (``refused`` by reason) gets its ring or frames.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

from sluice.errors import WireError
from sluice.loaderd.rings import PREFIX, SHM_DIR
from sluice.wire import errorcodes
from sluice.wire import ring as wire_ring
from sluice.wire.ring import own_process, start_ticks

log = logging.getLogger("sluice.loaderd")

__all__ = ["Arena", "asked", "make", "slots_for"]

PAGE = mmap.PAGESIZE
MAX_SLOTS = 64
MAX_LEASES = 1 << 20  # leases one [slot, turn, n] may return (n), far above what a slot's replies can be
MAX_CONNECTIONS = 1024  # connections whose process is known (the least recently used forgotten first)
REAP_EVERY_S = 2.0  # how often `reap` reads /proc for the processes holding leases


def slots_for(replicas: int, slot_bytes: int, free_bytes: int) -> int:
    """Slots of an arena for `replicas` producers whose calls' blocks take up to `slot_bytes`: four a replica
    (its queue's lead of two calls, partly three, and the call being made; its clients' leases on the slot they
    read) and four to spare; at most a quarter of `free_bytes` (what /dev/shm has left: the rings, other daemons
    and the trainers use it too); 0 where that leaves fewer than two a replica and one."""
    fits = free_bytes // 4 // max(1, slot_bytes)
    want = min(MAX_SLOTS, 4 + 4 * replicas)
    return min(want, fits) if fits >= 2 * replicas + 1 else 0


def asked(body: dict[str, Any]) -> dict[str, Any] | None:
    """A HELLO body's ``arena`` (None: not asked); WireError(MALFORMED) unless it is ``{"pid": int, "start": int,
    "pidns": str}`` (the client's process: `own_process`)."""
    got = body.get("arena")
    if got is not None and not (type(got) is dict and set(got) == {"pid", "start", "pidns"}
                                and type(got["pid"]) is int and 0 < got["pid"] < 1 << 31
                                and type(got["start"]) is int and 0 <= got["start"] < 1 << 62
                                and type(got["pidns"]) is str and len(got["pidns"]) <= 64):
        raise WireError(errorcodes.E_MALFORMED, f"HELLO arena must be {{\"pid\": int, \"start\": int, \"pidns\": "
                                                f"str}}, got {got!r:.200}")
    return got


class Arena:
    """`slots` slots of `slot_bytes` (whole pages) in a new file under /dev/shm (OSError where it cannot be made
    in full), after a head page of each slot's turn (uint64): what `block` hands the producers and `ref` names."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE
        self.head = -(-8 * slots // PAGE) * PAGE
        self.size = self.head + slots * self.slot_bytes
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-arena-{secrets.token_hex(8)}")
        self.id = secrets.token_bytes(8)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)  # (pages now: a full tmpfs refused here, never a SIGBUS later)
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._turns = np.ndarray((slots,), dtype="<u8", buffer=self._map)
        at = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(at)
        del at  # (an export of the map kept would stop `close`)
        self._lock = threading.RLock()  # `block`: the producers of several replicas; `_gone`: any thread
        self._alive = [0] * slots  # the slot's blocks alive in the daemon
        self._fill = [0] * slots  # bytes of the slot handed out in its turn
        self._open = -1  # the slot blocks are handed out of
        self._turn = [0] * slots  # the slot's turn: how often it was opened
        self._leased = [0] * slots  # references out to clients, not yet returned
        self._procs: dict[tuple[int, int], collections.Counter] = {}  # (pid, start) -> (slot, turn) -> leases
        self._who: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()  # identity -> proc
        self._ns = own_process()
        self._reaped_at = 0.0
        self._closed = False
        self.blocks = self.batches = self.stale = self.reaped = 0
        self.most = 0  # the most slots in use at once (a block alive or leased): how many a run needs
        self.heap = {"full": 0, "too_large": 0}
        self.refused: dict[str, int] = {}

    # -- the producers' side ----------------------------------------------------------
    def block(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """An uninitialised array of `shape` and `dtype` in the arena, or None (counted in ``heap``): the caller
        makes it on the heap. Thread-safe. Each block lies on whole pages of its own (a page a client wrote is
        never one of another block: module docstring), after the blocks before it in its slot's turn: in the
        open slot while it has room; else at the end of the first slot in use with room for it (blocks alive or
        leases out: its turn goes on, and pages past its end were no block's this turn, so no client wrote
        them); else the lowest free slot (the same few stay warm in the caches) opens, at its next turn.
        Looking past the open slot packs calls of mixed sizes (a producer that keeps up with its consumer
        refills a few steps a call), where a small block after a full one would take a slot of its own
        (bench/results/README.md, "Stop 42")."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        need = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            if self._closed:  # (a producer's last call while the daemon stops)
                return None
            if need > self.slot_bytes:
                self.heap["too_large"] += 1
                return None
            s, room = self._open, self.slot_bytes - need
            if s < 0 or self._fill[s] > room:
                alive, leased, fill = self._alive, self._leased, self._fill
                s = next((t for t in range(self.slots) if (alive[t] or leased[t]) and fill[t] <= room), -1)
                if s < 0:
                    s = next((t for t in range(self.slots) if not alive[t] and not leased[t]), -1)
                    if s < 0:
                        self.heap["full"] += 1
                        return None
                    fill[s] = 0
                    self._turn[s] += 1
                    self._turns[s] = self._turn[s]
                self._open = s
            at = self._fill[s]
            self._fill[s] = at + need
            self._alive[s] += 1
            self.most = max(self.most, sum(1 for t in range(self.slots) if self._alive[t] or self._leased[t]))
            self.blocks += 1
        # np.frombuffer holds the map's buffer (an ndarray made with buffer= does not: the map could be closed under
        # it); every view of the block has this flat array as its base, so it lives as long as any of them
        flat = np.frombuffer(self._map, dtype=dt, count=nbytes // dt.itemsize,
                             offset=self.head + s * self.slot_bytes + at)
        weakref.finalize(flat, self._gone, s)
        return flat.reshape(shape)

    def _gone(self, slot: int) -> None:
        with self._lock:  # (re-entrant: a block may be collected in the producer's thread within `block`)
            self._alive[slot] -= 1

    # -- the IO thread's side -----------------------------------------------------------
    def offer(self, identity: bytes, asked: dict[str, Any]) -> dict[str, Any] | None:
        """The HELLO_OK body's ``arena`` for `identity`, whose HELLO named its process (`asked`, validated by
        `asked`): None (counted by reason) where that process is not one this daemon can watch."""
        why = None
        if self._ns is None or asked["pidns"] != self._ns[2]:
            why = "other_pid_namespace"
        elif start_ticks(asked["pid"]) != asked["start"]:
            why = "no_such_process"
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return None
        self._who.pop(identity, None)
        self._who[identity] = (asked["pid"], asked["start"])
        while len(self._who) > MAX_CONNECTIONS:
            self._who.popitem(last=False)
        return {"path": self.path, "id": self.id.hex(), "slots": self.slots, "slot_bytes": self.slot_bytes,
                "head": self.head}

    def ref(self, identity: bytes, bufs: list[Any]) -> bytes | None:
        """The reference frame for a BATCH's array frames `bufs` sent to `identity`, a lease of its process on the
        slot they lie in; None where the connection has no arena or no frame lies in one (the caller sends them
        as before). Frames outside the arena go inline (small ones: cu_seqlens)."""
        proc = self._who.get(identity)
        if proc is None:
            return None
        self._who.move_to_end(identity)  # (in use: the last forgotten when `MAX_CONNECTIONS` others came since)
        parts: list[tuple[int, int]] = []
        inline: list[Any] = []
        slot = -1
        base, head, size, per = self._base, self.head, self.size, self.slot_bytes
        for b in bufs:
            n = len(b) if type(b) is bytes else b.nbytes
            off = -1
            if type(b) is np.ndarray and n:
                try:
                    off = _addressof(_char_at(b)) - base
                except (TypeError, ValueError):  # read-only: not ours
                    off = -1
                if not head <= off < size:
                    off = -1
                elif not b.flags.c_contiguous:
                    return None
                else:
                    s = (off - head) // per
                    if (slot != -1 and s != slot) or off + n > head + (s + 1) * per:
                        return None  # (never from one call's block: sent as before)
                    slot = s
            if off != -1 and parts and parts[-1][0] != -1 and sum(parts[-1]) == off:
                parts[-1] = (parts[-1][0], parts[-1][1] + n)  # (planes back to back: one part, one frame)
                continue
            parts.append((off, n))
            if off == -1:
                inline.append(b)
        if slot == -1 or len(parts) > wire_ring.MAX_PARTS:
            return None
        turn = self._turn[slot]
        self._leased[slot] += 1
        held = self._procs.get(proc)
        if held is None:
            held = self._procs[proc] = collections.Counter()
        held[(slot, turn)] += 1
        self.batches += 1
        return wire_ring.arena_ref(self.id, slot, turn, parts, inline)

    def unsent(self, identity: bytes, frames: list[Any]) -> None:
        """The references among `frames` (a message for `identity`: header and reference pairs) did not leave
        (its client's connection is gone): their leases are returned here, as its process cannot."""
        for frame in frames[1::2]:
            got = wire_ring.parse_arena_ref(frame) if type(frame) is bytes else None
            if got is not None and got[0] == self.id:
                self.release(identity, [[got[1], got[2], 1]])

    def release(self, identity: bytes, triples: Any) -> None:
        """Leases `identity`'s process returns (a GET's ``release_arena``: ``[[slot, turn, n], ...]``); any it
        does not hold are counted (`stale`) and ignored. WireError(MALFORMED) for another form."""
        if not (type(triples) is list and len(triples) <= MAX_SLOTS and all(
                type(t) is list and len(t) == 3 and all(type(v) is int for v in t) and 0 < t[2] <= MAX_LEASES
                for t in triples)):
            raise WireError(errorcodes.E_MALFORMED, f"release_arena must be a list of at most {MAX_SLOTS} "
                                                    f"[slot, turn, n] integer triples, n in [1, {MAX_LEASES}], "
                                                    f"got {triples!r:.200}")
        held = self._procs.get(self._who.get(identity))  # type: ignore[arg-type]
        for slot, turn, n in triples:
            have = held.get((slot, turn), 0) if held is not None else 0
            take = min(n, have)
            if take:
                if take == have:
                    del held[(slot, turn)]  # type: ignore[union-attr]
                else:
                    held[(slot, turn)] = have - take  # type: ignore[index]
                self._leased[slot] -= take
            self.stale += n - take

    def reap(self, now: float) -> int:
        """Drop the leases of processes that are gone (every `REAP_EVERY_S` at the most; `now` monotonic
        seconds) and forget their connections; how many processes."""
        if now - self._reaped_at < REAP_EVERY_S:
            return 0
        self._reaped_at = now
        gone = [proc for proc in self._procs if start_ticks(proc[0]) != proc[1]]
        for proc in gone:
            for (slot, _), n in self._procs.pop(proc).items():
                self._leased[slot] -= n
        if gone:
            dead = set(gone)
            for identity in [i for i, proc in self._who.items() if proc in dead]:
                del self._who[identity]
            self.reaped += len(gone)
        return len(gone)

    def stats(self) -> dict[str, Any]:
        return {"enabled": True, "slots": self.slots, "slot_bytes": self.slot_bytes,
                "free": sum(1 for s in range(self.slots) if not self._alive[s] and not self._leased[s]),
                "most_used": self.most, "blocks": self.blocks, "heap": dict(self.heap), "batches": self.batches,
                "leases": sum(self._leased), "stale_releases": self.stale, "reaped": self.reaped,
                "refused": dict(self.refused)}

    def close(self) -> None:
        """Remove the name (no client maps it any more) and hand out no more blocks; the map itself closes once
        no block views it (the producers may finish a call after this)."""
        with self._lock:
            self._closed = True
            self._turns = None
        try:
            self._map.close()
        except BufferError:  # (a block still alive: the map closes with it)
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # (removed already: a `sweep` by a daemon that took this pid)
            pass


def make(endpoint: str, replicas: int, slot_bytes: int) -> tuple[Arena | None, str | None]:
    """The daemon's arena for `replicas` producers whose calls' blocks take at most `slot_bytes`, or None and why
    (not an ipc:// endpoint, no /dev/shm, no room there: logged once)."""
    if not endpoint.startswith("ipc://") or not os.path.isdir(SHM_DIR) or not hasattr(os, "posix_fallocate"):
        return None, "not_ipc_or_no_shm"
    try:
        st = os.statvfs(SHM_DIR)
        slots = slots_for(replicas, slot_bytes, st.f_bavail * st.f_frsize)
        if not slots:
            log.warning(f"no shared-memory arena for the producers' blocks ({SHM_DIR} has {st.f_bavail * st.f_frsize} "
                        "bytes free); batches are copied to clients")
            return None, "no_space"
        return Arena(slots, slot_bytes), None
    except OSError as exc:
        log.warning(f"no shared-memory arena for the producers' blocks ({exc}); batches are copied to clients")
        return None, "no_space" if exc.errno == errno.ENOSPC else "os_error"


_addressof = ctypes.addressof
_char_at = ctypes.c_char.from_buffer
