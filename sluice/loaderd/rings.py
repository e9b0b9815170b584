"""The daemon's rings: BATCH arrays for clients on its host through shared memory (sluice/wire/ring.py).

One ring per connection that asked for one in HELLO, only on an ipc://
endpoint (every client of it is on this host): a file under /dev/shm, 0600,
named ``sluice-ring-<daemon pid>-<random>``, its pages allocated when made
(a full tmpfs is refused then, never a SIGBUS on a later write). The client
maps it and removes the name at once; the daemon removes it too when it
closes the ring (names left by a daemon killed before its client mapped them
are removed by the next daemon's `sweep`).

A ring asked for with ``"lease": true`` (every client of this version) is
written only in slots its client released (`Ring.release`, from a GET's
``release``): the client's arrays view the slots; with every slot held the
BATCH goes as frames (STATS ``rings.full``).

Bounds: `MAX_RINGS` rings, the least recently used closed to make room (its
client, if still there, gets frames again: a GET asks for the ring only
while the daemon holds one for it); each ``slots x wire.ring.slot_bytes``
(16 x 256 KiB for `[8, 2048]` micro-batches). A ring whose client has sent
nothing for as long as its HELLO `peers` claim lives (twice `--request-ttl`:
the client is gone, or back under another connection) is closed at the next
housekeeping (`expire`), so departed clients do not hold shared memory until
32 others come. A client that was only quiet (a long evaluation, a checkpoint
save) gets a new ring with its next GET that asks for one: the daemon sends a
RING message with the offer just before that BATCH (`revive`; the last
`MAX_RINGS` expired connections are remembered for it).
Where no ring can be made the reply says why in STATS (`rings.refused`) and
the client reads frames, as any client does.
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sluice.errors import WireError
from sluice.wire import errorcodes
from sluice.wire import ring as wire_ring

log = logging.getLogger("sluice.loaderd")

__all__ = ["MAX_RINGS", "Ring", "Rings", "asked", "sweep"]

MAX_RINGS = 32
SHM_DIR = "/dev/shm"
PREFIX = "sluice-ring-"


class Ring:
    """`slots` slots of `slot_bytes` in a new file at `path` (OSError if it cannot be made in full). `lease`: the
    client reads its arrays in place, so a slot is written only once the client released it (`release`);
    else the slots are written in turn (the client copies each out before its next GET: wire/ring.py)."""

    def __init__(self, path: str, slots: int, slot_bytes: int, lease: bool = False) -> None:
        self.path, self.slots, self.slot_bytes, self.lease = path, slots, slot_bytes, lease
        self._free = collections.deque(range(slots))  # (lease) slots the client released, oldest first
        self._held: dict[int, int] = {}  # (lease) slot -> the turn the client holds it for
        self.full = 0  # (lease) batches sent as frames: every slot held
        self.stale = 0  # (lease) releases of a slot not held for that turn (ignored)
        self.id = secrets.token_bytes(8)  # in every reference: a reply of another connection is told apart
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.posix_fallocate(fd, 0, slots * slot_bytes)
            self._map = mmap.mmap(fd, slots * slot_bytes)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self._turns = np.ndarray((slots,), dtype="<u8", buffer=self._map, strides=(slot_bytes,))  # each slot's head
        self._mem = memoryview(self._map)
        self._next = 0
        self.batches = 0
        self.seen = 0.0  # monotonic seconds of its client's last request (`Rings.seen`)

    def put(self, bufs: list[Any]) -> bytes | None:
        """Write `bufs` (a BATCH's array frames) back to back into the next slot; its reference frame, or None
        when they do not fit a slot (the caller sends them as frames)."""
        try:  # (one memcpy each below, under the GIL: no hand-off to the producer and back)
            views = [memoryview(b).cast("B") for b in bufs]
        except TypeError:  # a buffer that is not C-contiguous: sent as frames
            return None
        total = sum(v.nbytes for v in views)
        if total > self.slot_bytes - wire_ring.HEAD:
            return None
        turn = self._next
        if self.lease:
            if not self._free:  # every slot still held by the client's arrays: frames, never a held slot
                self.full += 1
                return None
            slot = self._free.popleft()
            self._held[slot] = turn
        else:
            slot = turn % self.slots
        self._next += 1
        head = self._turns[slot:slot + 1]
        head[0] = wire_ring.WRITING  # (the client's check before and after its copy sees either)
        mem, off = self._mem, slot * self.slot_bytes + wire_ring.HEAD
        for v in views:
            mem[off:off + v.nbytes] = v
            off += v.nbytes
        head[0] = turn
        self.batches += 1
        return wire_ring.ref(self.id, slot, total, turn)

    def release(self, pairs: list[Any]) -> None:
        """The client no longer reads the slots of `pairs` (``[slot, turn]`` each, validated by the caller): each
        one it holds for that turn may be written again; others are counted (`stale`) and ignored."""
        for slot, turn in pairs:
            if self._held.get(slot) == turn:
                del self._held[slot]
                self._free.append(slot)
            else:
                self.stale += 1

    def close(self) -> None:
        self._mem.release()
        self._turns = None  # (the map closes once no view holds it)
        try:
            self._map.close()
        except BufferError:
            pass
        _unlink(self.path)


class Rings:
    """The daemon's rings by connection identity (the IO thread's only: no lock); `enabled` false where the
    endpoint is not ipc:// or the host has no /dev/shm."""

    def __init__(self, endpoint: str, slot_bytes: int,
                 announce: Callable[[bytes, Any, dict[str, Any]], Any] | None = None) -> None:
        """`announce(identity, request, offer)` sends a revived ring's offer (the RING message) before the BATCH
        that uses it (`frames`); None: no ring is revived."""
        self.announce = announce
        self.enabled = endpoint.startswith("ipc://") and os.path.isdir(SHM_DIR) and hasattr(os, "posix_fallocate")
        self.slot_bytes = slot_bytes
        self._rings: collections.OrderedDict[bytes, Ring] = collections.OrderedDict()
        self.refused: dict[str, int] = {}
        self.closed_batches = 0  # batches of rings closed since (and their `full`, `stale` counts)
        self.closed_full = self.closed_stale = 0
        self.evicted = 0  # rings closed to make room for another
        self.expired = 0  # rings closed because their client fell silent (`expire`)
        self.revived = 0  # rings made again for such a client when it asked again (`revive`)
        # (identity -> what it asked for) of the last MAX_RINGS rings expired: a ring is offered again only to
        # these, so a connection whose ring was evicted to make room never evicts another in turn
        self._quiet: collections.OrderedDict[bytes, dict[str, Any]] = collections.OrderedDict()

    def offer(self, identity: bytes, asked: Any, now: float) -> dict[str, Any] | None:
        """A ring for `identity`, which asked in HELLO (`asked`: ``{"slots": n}``, validated by the caller) at
        `now` (monotonic seconds), as the HELLO_OK body's ``ring``; None (counted by reason) where none is
        made."""
        if not self.enabled:
            self._refuse("not_ipc_or_no_shm")
            return None
        self._quiet.pop(identity, None)
        old = self._rings.pop(identity, None)
        if old is not None:
            self._close(old)
        while len(self._rings) >= MAX_RINGS:
            self._close(self._rings.popitem(last=False)[1])
            self.evicted += 1
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            ring = Ring(path, int(asked["slots"]), self.slot_bytes, lease=asked.get("lease") is True)
        except OSError as exc:
            why = "no_space" if exc.errno == errno.ENOSPC else "os_error"
            if why not in self.refused:  # (once a reason: a client reconnecting would repeat it)
                log.warning(f"no shared-memory ring for a client ({exc}); it reads BATCH frames")
            self._refuse(why)
            return None
        ring.seen = now
        self._rings[identity] = ring
        offer = {"path": path, "slots": ring.slots, "slot_bytes": ring.slot_bytes, "id": ring.id.hex()}
        return {**offer, "lease": True} if ring.lease else offer

    def frames(self, identity: bytes, frames: list[Any], request: Any = None) -> list[Any]:
        """A BATCH's `frames` (header, array frames) for `identity`, which asked for its ring in `request` (a GET,
        handed to `announce`): the header and a reference frame, the arrays written into its ring's next slot;
        `frames` as they are where it holds no ring (closed to make room) or they do not fit a slot. A ring
        that expired while its client was quiet is made again first (`revive`, offered through `announce`)."""
        ring = self._rings.get(identity)
        if ring is None:
            offer = self.revive(identity, time.monotonic()) if self._quiet and self.announce is not None else None
            if offer is None:
                return frames
            self.announce(identity, request, offer)
            ring = self._rings[identity]
        self._rings.move_to_end(identity)
        ref = ring.put(frames[1:])
        return frames if ref is None else [frames[0], ref]

    def seen(self, identity: bytes, now: float, body: dict[str, Any]) -> None:
        """A request from `identity` at `now` (monotonic seconds): its ring, if it holds one, is in use; the slots
        its `body` releases (``release``: ``[[slot, turn], ...]``, at most the ring's slots) may be written again.
        WireError(MALFORMED) for a ``release`` of another form."""
        ring = self._rings.get(identity)
        if ring is not None:
            ring.seen = now
        pairs = body.get("release")
        if pairs is not None:
            if not (type(pairs) is list and len(pairs) <= wire_ring.MAX_SLOTS and all(
                    type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int for p in pairs)):
                raise WireError(errorcodes.E_MALFORMED, f"release must be a list of at most {wire_ring.MAX_SLOTS} "
                                                        f"[slot, turn] integer pairs, got {pairs!r:.200}")
            if ring is not None and ring.lease:
                ring.release(pairs)

    def expire(self, now: float, silent_s: float) -> int:
        """Close the rings whose client sent nothing for more than `silent_s` seconds before `now`; how many."""
        gone = [identity for identity, ring in self._rings.items() if now - ring.seen > silent_s]
        for identity in gone:
            ring = self._rings.pop(identity)
            self._close(ring)
            self._quiet[identity] = {"slots": ring.slots, "lease": ring.lease}
            while len(self._quiet) > MAX_RINGS:
                self._quiet.popitem(last=False)
        self.expired += len(gone)
        return len(gone)

    def revive(self, identity: bytes, now: float) -> dict[str, Any] | None:
        """A new ring for `identity` if its last one expired (`expire`) and it asks again at `now`: the offer to
        send it in a RING message before its BATCH (as `offer` makes it; None where none is made or owed)."""
        asked_then = self._quiet.pop(identity, None) if self._quiet else None
        if asked_then is None:
            return None
        got = self.offer(identity, asked_then, now)
        if got is not None:
            self.revived += 1
        return got

    def stats(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "open": len(self._rings), "max": MAX_RINGS,
                "batches": self.closed_batches + sum(r.batches for r in self._rings.values()),
                "evicted": self.evicted, "expired": self.expired, "revived": self.revived,
                "full": self.closed_full + sum(r.full for r in self._rings.values()),
                "stale_releases": self.closed_stale + sum(r.stale for r in self._rings.values()),
                "refused": dict(self.refused)}

    def close_all(self) -> None:
        self._quiet.clear()
        while self._rings:
            self._close(self._rings.popitem()[1])

    def _close(self, ring: Ring) -> None:
        self.closed_batches += ring.batches
        self.closed_full += ring.full
        self.closed_stale += ring.stale
        ring.close()

    def _refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1


def asked(body: dict[str, Any]) -> dict[str, Any] | None:
    """A HELLO body's ``ring`` (None: not asked); WireError(MALFORMED) unless it is ``{"slots": n}`` with n in
    [2, `wire.ring.MAX_SLOTS`], and optionally ``"lease": true`` (the client reads its arrays in place)."""
    got = body.get("ring")
    if got is not None and not (type(got) is dict and set(got) in ({"slots"}, {"slots", "lease"})
                                and type(got["slots"]) is int and 2 <= got["slots"] <= wire_ring.MAX_SLOTS
                                and got.get("lease", True) is True):
        raise WireError(errorcodes.E_MALFORMED, f"HELLO ring must be {{\"slots\": n}} with n in "
                                                f"[2, {wire_ring.MAX_SLOTS}] and optionally \"lease\": true, got "
                                                f"{got!r}")
    return got


def sweep() -> int:
    """Remove the ring files of daemons that are gone (killed before their clients mapped them): names
    ``sluice-ring-<pid>-*`` this user owns whose pid no longer runs. Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
