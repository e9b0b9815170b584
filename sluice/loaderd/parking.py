"""Parked GETs and peer claims: the daemon's per-replica bookkeeping of who waits.

A GET whose step is not assembled yet is parked (bounded: `max_pending` per
replica; beyond it the GET is refused OVERLOADED). It is answered when the
producer announces the step, or, after `ttl_s`, answered ERROR(EXPIRED)
naming step and replica: a parked request is never dropped silently, so a
live client always learns that it must ask again (a vanished one does not
care; the ERROR goes nowhere).

Peer claims (HELLO ``peers``): a step is released when `peers` distinct
clients received it. The effective `peers` of a replica is the largest claim
among clients heard from within `ttl_s` (a request of any kind refreshes a
client), so a claim of a client that went away stops holding the replica
after at most one TTL, and the caller re-runs the release. Claims are kept in
a bounded table (`max_claims`, oldest dropped); a client whose claim lapsed
renews it with its next request.

Peer restores (`restore_peer`): peers of one replica that RESTORE different
states of one generation (after a daemon restart each restores the state of
its own last completed step, and one may be a step ahead) share one stream:
the earliest state wins, and what the others already hold counts as received
(`StepQueue.holders`), so no peer is refused a step and none stalls the release.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sluice.errors import WireError
from sluice.wire import errorcodes, protocol


@dataclass(frozen=True)
class Parked:
    """A GET waiting for its step: who asked, what, and since when (monotonic seconds)."""

    identity: bytes
    header: protocol.Header
    arrived: float


class Parking:
    """Parked GETs of every served replica (used by the IO thread only)."""

    def __init__(self, replicas: Iterable[int], max_pending: int) -> None:
        self.max_pending = max_pending
        self._pending: dict[int, deque[Parked]] = {r: deque() for r in replicas}

    def count(self, replica: int) -> int:
        return len(self._pending[replica])

    def park(self, item: Parked) -> None:
        """Park `item`; WireError(OVERLOADED) at the bound (the policy at the limit: refuse)."""
        pend = self._pending[item.header.replica]
        if len(pend) >= self.max_pending:
            raise WireError(errorcodes.E_OVERLOADED, f"{len(pend)} GETs already pending for replica "
                                                     f"{item.header.replica}")
        pend.append(item)

    def offer(self, replica: int, queue: Any, ahead: int, generation: int, serve: Callable[[Parked], bool],
              fence: Callable[[Parked], None]) -> None:
        """Offer the parked GETs of `replica` again, oldest first; keep those still waiting.

        One of a generation older than `generation` goes to `fence` and is
        dropped; one whose step `queue` (the replica's StepQueue) has plainly
        not decided is kept, looked at without its lock (`StepQueue.undecided`'s
        test, in line: no call per GET that still waits, as most do at each
        announcement, asked `credits` ahead); any other goes to `serve`, and is
        kept if it returns False (not decided after all, under the lock).
        """
        pend = self._pending[replica]
        if not pend:
            return
        kept = []
        for item in list(pend):
            h = item.header
            if h.generation < generation:
                fence(item)
                continue
            step, floor = h.step, queue.floor  # (read per GET: serving one may release a step)
            if (floor <= step < floor + ahead and step not in queue.entries and queue.terminal is None) \
                    or not serve(item):
                kept.append(item)
        if len(kept) != len(pend):  # (an offer that answered none leaves them as they were)
            self._pending[replica] = deque(kept)

    def expire(self, replica: int, now: float, ttl_s: float) -> list[Parked]:
        """Remove and return the GETs of `replica` parked longer than `ttl_s` (oldest first)."""
        pend = self._pending[replica]
        if not pend or now - pend[0].arrived <= ttl_s:
            return []
        old = [i for i in pend if now - i.arrived > ttl_s]
        self._pending[replica] = deque(i for i in pend if now - i.arrived <= ttl_s)
        return old

    def drain(self) -> list[Parked]:
        """Remove and return every parked GET (shutdown)."""
        out = [i for pend in self._pending.values() for i in pend]
        for pend in self._pending.values():
            pend.clear()
        return out


class PeerClaims:
    """HELLO `peers` claims per (replica, client identity), forgotten after `ttl_s` of silence."""

    def __init__(self, ttl_s: float, max_claims: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_claims = max_claims
        self._claims: OrderedDict[tuple[int, bytes], tuple[int, float]] = OrderedDict()

    def claim(self, replica: int, identity: bytes, peers: int, now: float) -> None:
        key = (replica, identity)
        self._claims.pop(key, None)
        self._claims[key] = (peers, now)
        while len(self._claims) > self.max_claims:
            self._claims.popitem(last=False)

    def seen(self, replica: int, identity: bytes, now: float) -> None:
        """A request from `identity`: its claim (if any) is live again."""
        key = (replica, identity)
        old = self._claims.get(key)
        if old is not None:
            self._claims[key] = (old[0], now)
            self._claims.move_to_end(key)

    def effective(self, replica: int, now: float) -> int:
        """The largest live claim for `replica` (1 when nobody claims more)."""
        live = [p for (r, _), (p, t) in self._claims.items() if r == replica and now - t <= self.ttl_s]
        return max(live, default=1)


def apply_claims(claims: PeerClaims, replica: int, p: Any, now: float) -> None:
    """Set producer `p`'s `peers` from the live claims; when they drop, the release re-runs.

    So a claim of a client that went away stops holding steps (`p` is the
    replica's producer, a `ReplicaPipeline`: its queue releases under its own lock).
    """
    peers = claims.effective(replica, now)
    if peers != p.peers:  # (`peers` changes on the IO thread only, which calls this)
        p.peers = peers
        p.queue.release(peers)


def restore_peer(p: Any, identity: bytes, step: int, state: Any, generation: int) -> None:
    """Apply an accepted RESTORE of `p`'s replica by `identity` (its state is after `step`).

    `state` (from `StateGate.restore`) resets the producer, None leaves it as
    it is (the gate returns None only when a RESTORE of this generation was
    applied before). Before a reset, what peers of this generation were sent
    becomes their holdings (`StepQueue.keep_holdings`; those of an older
    generation are forgotten). Then `identity` holds every step up to `step`,
    and the release runs again, since the holding may complete a step.
    """
    if state is not None:
        p.queue.keep_holdings(generation)
        p.reset(state)
    p.queue.release(p.peers, (identity, (step, p.micro_per_step - 1)))
