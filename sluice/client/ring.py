"""The client's end of a daemon's ring: BATCH arrays read from shared memory (sluice/wire/ring.py).

Nothing in the daemon's offer is taken on trust: the path must be a ring
file name under /dev/shm, the file a regular one of this user at least as
large as the offer says, and every reference a slot and a size inside it,
whose turn is the reference's when read.

Leased slots (the default, where the daemon agrees: ``"lease": true`` in
its offer): a BATCH's arrays are views of their slot, no copy; the slot is
the client's until the last of them (and of the tensors made from them) is
gone, then released (`weakref.finalize`) and named in the next GET's
``release``, and only then written again by the daemon. A trainer that keeps
every batch runs the daemon out of free slots: its further batches come as
frames (STATS ``rings.full``), never in a slot it holds. Without a lease the
client copies each slot out before its next GET (a turn checked before and
after the copy), as the daemon writes the slots in turn.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import stat
import weakref
from typing import Any

import numpy as np

from sluice.client import arena as client_arena
from sluice.errors import ProtocolError
from sluice.wire import ring as wire_ring

__all__ = ["ClientRing", "ask", "hello_fields", "released", "resolve", "take_offer", "take_offers"]

log = logging.getLogger("sluice.client")

_PREFIX = "/dev/shm/sluice-ring-"
_MAX_SLOT_BYTES = 1 << 30


# Slots beyond the credits: the batches a trainer may hold (their tensors alive) while every credit is in flight
# before further ones come as frames (`rings.full`). Not 2 x credits past 8 credits: each slot is a micro-batch of
# /dev/shm (256 KiB at [8, 2048]), and a container's /dev/shm is often 64 MiB for every rank of the node.
HELD_SLOTS = 8


def ask(endpoint: str, credits: int) -> dict[str, int] | None:
    """The HELLO's ``ring`` for a client of `endpoint` with `credits` GETs in flight: twice the credits'
    slots, at most `HELD_SLOTS` more than the credits (wire/ring.py says why more than `credits`), leased
    (module docstring); None off an ipc:// endpoint or past `MAX_SLOTS`."""
    slots = min(2 * credits, credits + HELD_SLOTS)
    if not endpoint.startswith("ipc://") or slots > wire_ring.MAX_SLOTS:
        return None
    return {"slots": slots, "lease": True}


def hello_fields(client: Any) -> dict[str, Any]:
    """A HELLO body's ``ring`` (`ask`) where `client` (its endpoint, credits and `ring` option) wants one and
    may ask, and its ``arena`` (client/arena.py, `hello_field`); else nothing."""
    asked = ask(client.endpoint, client.credits) if client.ring else None
    return {**({"ring": asked} if asked else {}), **client_arena.hello_field(client.endpoint, client.ring)}


class ClientRing:
    """A ring the daemon offered in HELLO_OK or RING (`offer`: path, slots, slot_bytes, id, lease), mapped
    (read-write where leased, else read-only); its name removed once mapped. OSError where it cannot be
    opened (another user's daemon), ProtocolError where the offer is not a ring's."""

    def __init__(self, offer: Any, asked_slots: int) -> None:
        if not (type(offer) is dict and set(offer) - {"lease"} == {"path", "slots", "slot_bytes", "id"}
                and offer.get("lease", True) is True
                and type(offer["id"]) is str and len(offer["id"]) == 16 and wire_ring.is_hex(offer["id"])
                and type(offer["path"]) is str and offer["path"].startswith(_PREFIX)
                and "/" not in offer["path"][len(_PREFIX):]
                and type(offer["slots"]) is int and offer["slots"] == asked_slots
                and type(offer["slot_bytes"]) is int and wire_ring.HEAD < offer["slot_bytes"] <= _MAX_SLOT_BYTES
                and offer["slot_bytes"] % 8 == 0):
            raise ProtocolError(f"the ring offered (HELLO_OK or RING) must be the ring asked for ({asked_slots} "
                                f"slots, a file {_PREFIX}*), got {offer!r}")
        self.slots, self.slot_bytes, self.id = offer["slots"], offer["slot_bytes"], bytes.fromhex(offer["id"])
        # Leased: arrays viewing the slots, writable as torch wants (a trainer writing into its batch writes
        # into a slot it holds; the daemon never reads the slots). Else read-only: every slot is copied out.
        self.lease = offer.get("lease") is True
        self.released: collections.deque[tuple[int, int]] = collections.deque()  # (slot, turn) not yet told
        size = self.slots * self.slot_bytes
        fd = os.open(offer["path"], (os.O_RDWR if self.lease else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < size:
                raise ProtocolError(f"ring file {offer['path']} is not a ring of this user of {size} bytes")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if self.lease else 0))
        finally:
            os.close(fd)
        try:
            os.unlink(offer["path"])  # mapped: nothing else needs the name (the daemon's unlink then finds none)
        except OSError:
            pass
        self._mem = memoryview(self._map)
        self._turns = np.ndarray((self.slots,), dtype="<u8", buffer=self._map, strides=(self.slot_bytes,))

    def take(self, slot: int, nbytes: int, turn: int) -> Any:
        """The `nbytes` of arrays in `slot`, written at `turn` (a reference's three fields): leased, a uint8
        array viewing them, the slot released once it and every view of it are gone; else a copy. ProtocolError
        for a reference outside the ring or a slot not of that turn (before and after a copy)."""
        if not (slot < self.slots and nbytes <= self.slot_bytes - wire_ring.HEAD):
            raise ProtocolError(f"loaderd sent a ring reference outside its ring: slot {slot} of {self.slots}, "
                                f"{nbytes} bytes of {self.slot_bytes - wire_ring.HEAD}")
        before = int(self._turns[slot])
        at = slot * self.slot_bytes + wire_ring.HEAD
        if self.lease:
            if before != turn:
                raise ProtocolError(f"ring slot {slot} holds turn {before}, the reply names turn {turn} (a bug in "
                                    "sluice; report it)")
            view = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=at)
            weakref.finalize(view, self.released.append, (slot, turn))
            return view
        out = bytearray(self._mem[at:at + nbytes])  # (one memcpy under the GIL; writable, as torch wants)
        after = int(self._turns[slot])
        if not before == after == turn:
            raise ProtocolError(f"ring slot {slot} held turn {before} then {after} while read for turn {turn}: "
                                "written again before it was read (a bug in sluice; report it)")
        return out

    def release_field(self) -> bytes:
        """The next GET's ``release`` member (``,"release":[[slot,turn],...]``, JSON as `encoding` writes it), the
        slots released since the last call (b"" when none): at most `slots` pairs a GET, the rest the next."""
        done = self.released
        if not done:
            return b""
        pairs = []
        for _ in range(min(len(done), self.slots)):  # (popleft: a finalizer may append meanwhile, in any thread)
            pairs.append(done.popleft())
        return b',"release":[' + b",".join(b"[%d,%d]" % p for p in pairs) + b"]"

    def close(self) -> None:
        self._mem.release()
        self._turns = None
        try:
            self._map.close()
        except BufferError:  # (an array still viewing it: released with it)
            pass


def take_offer(old: ClientRing | None, offer: Any, client: Any) -> ClientRing | None:
    """The ring a HELLO_OK offers (None: none) for `client`'s new connection, or a RING message for the same
    connection, in place of `old` (closed): mapped if it asked for one (`hello_fields`); a ring that cannot be
    opened (another user's daemon) leaves the connection on frames."""
    released(old)
    asked = hello_fields(client).get("ring")
    if offer is None or asked is None:
        return None
    try:
        return ClientRing(offer, asked["slots"])
    except OSError as exc:
        log.info(f"loaderd at {client.endpoint} offered a ring this client cannot open ({exc}); reading frames")
        return None


def resolve(held: ClientRing | None, frames: list[Any] | None,
            arena: client_arena.ClientArena | None = None) -> list[list[Any]] | None:
    """The replies in `frames` as received (None: none), each with a reference to `held`'s slot replaced by the
    slot's arrays (one packed frame: `ClientRing.take`, a leased view or a copy taken now, before the caller's
    next GET) and a reference to `arena` (a `client.arena.ClientArena`) by its array frames (`take`): the
    message itself, or the replies a joined message holds (docs/protocol.md, "Joined replies": 2 to
    `MAX_JOINED` pairs of a header and a reference). A reference to another ring or arena (a reply to a request
    of an earlier connection or daemon, sent again since: stale) is dropped; None when nothing is left.
    ProtocolError for a message that joins more than `MAX_JOINED` replies, or a frame among them that is no
    reference."""
    if frames is None:
        return None
    n = len(frames)
    if n < 2 or n % 2:
        return [frames]
    out = []
    for i in range(0, n, 2):
        frame = _bytes_of(frames[i + 1])
        at = wire_ring.parse_ref(frame)
        if at is not None:
            if held is not None and at[0] == held.id:
                out.append([frames[i], held.take(*at[1:])])
        elif (got := wire_ring.parse_arena_ref(frame) if arena is not None else None) is not None:
            if got[0] == arena.id:  # type: ignore[union-attr]
                out.append([frames[i], *arena.take(got[1], got[2], got[3], frame, got[4])])  # type: ignore[union-attr]
        elif i == 0:
            return [frames]  # (frames as sent: a reply of any other kind, or arrays in neither)
        else:
            raise ProtocolError(f"loaderd joined ring replies in one message whose frame {i + 1} is no ring "
                                "reference")
        if i == 0 and n > 2 * wire_ring.MAX_JOINED:
            raise ProtocolError(f"loaderd joined {n // 2} ring replies in one message; at most "
                                f"{wire_ring.MAX_JOINED}")
    return out or None


def _bytes_of(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def released(*held: ClientRing | client_arena.ClientArena | None) -> None:
    """Close each of `held` (a ring, an arena; None: nothing); returns None, what the holder keeps."""
    for h in held:
        if h is not None:
            h.close()


def take_offers(ring: ClientRing | None, arena: client_arena.ClientArena | None, info: dict[str, Any],
                client: Any) -> tuple[ClientRing | None, client_arena.ClientArena | None]:
    """The ring and the arena a HELLO_OK body `info` offers (popped from it), in place of `ring` and `arena`
    (`take_offer`, `client_arena.take_offer`)."""
    return (take_offer(ring, info.pop("ring", None), client),
            client_arena.take_offer(arena, info.pop("arena", None), client.endpoint))
