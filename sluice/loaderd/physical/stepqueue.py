"""The bounded step queue of one replica, and what it holds.

A `StepEntry` is what the daemon serves for one (replica, step): the
micro-batches (or a terminal error) and the data state after the step. The
`StepQueue` holds the entries a producer made ahead of the consumer, bounded by
bytes and by steps; the producer blocks at the bound.

Holdings: a micro-batch counts as received by a client identity when it was
sent to it, or when that identity is known to hold it already (`holders`: the
identity's last (step, micro) of this generation's stream). A peer that
RESTOREs the state after step n holds every micro-batch up to step n; when a
peer further behind makes the replica go back, what the others received
before that reset is kept as holdings, so steps they will never ask for again
are still released (docs/protocol.md, "Daemon restarts").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from sluice.datastate import state_json
from sluice.errors import WireError
from sluice.wire import errorcodes

# The copy threshold of the socket that sends a step's micro-batches (the daemon's ROUTER): frames below this many
# bytes are copied into libzmq's buffers even when sent with copy=False. A zero-copy frame costs a Frame object, a
# registration with pyzmq's garbage-collector thread and, once libzmq is done with it, that thread's GIL time to
# release it: more than copying, up to about 512 KiB. Daemon CPU per micro-batch, copied against zero-copy
# (bench/steady.py; docs/performance.md): 8 x 2048 int32 arrays (64 KiB frames) 0.665 against 0.787 ms; 32 x 2048
# (256 KiB) 1.18 against 1.35 ms; 64 x 2048 (512 KiB, copied with a 1 MiB threshold) 1.98 against 2.10 ms, but the
# IO loop's own share, which holds the GIL, rose from 0.24 to 0.36 ms: frames this large stay zero-copy.
COPY_BELOW = 512 << 10

MAX_HOLDERS = 1024  # client identities whose holdings a replica remembers (peers are at most 1024)


@dataclass
class StepEntry:
    """What the daemon serves for one (replica, step): micro-batches or a terminal error.

    `samples` (each micro-batch's sample IDs, in order of first appearance) may be given as a `LazySamples`:
    it is then made on first read of `samples` (most steps are served without their sample IDs, which a client
    asks for with its GET), and reads the same."""

    step: int
    micros: list[dict[str, np.ndarray]]
    samples: list[list[str]]  # (a property: `_samples` below)
    state: dict[str, Any] | None  # DataState.subset(lanes).state_dict() after this step (a property: `_state`)
    nbytes: int
    created: float
    error: tuple[str, str, dict[str, Any]] | None = None  # (code, message, extra body fields)
    delivered: list[set[bytes]] = field(default_factory=list)
    # Pre-encoded header parts (encoding.json_bytes), so the IO thread never re-encodes
    # them per message: the state once per step, made by the producer (every step's
    # last micro-batch carries it); a micro-batch's sample IDs once, when a client
    # first asks for them (most never do: `samples_json`).
    state_json: bytes | None = None
    _samples_json: dict[int, bytes] = field(default_factory=dict)
    # Per micro-batch: (source index, tokens) of each source in it (padding left out), counted when it is sent
    # (sluice_source_served_tokens_total); None where the producer did not count them.
    source_tokens: list[tuple[tuple[int, int], ...]] | None = None

    def encode_json(self) -> StepEntry:
        """Fill `state_json` (call where the entry is made, off the IO thread): `encoding.json_bytes(state)`'s bytes
        (a `LazyState`'s own, as the kernel wrote them)."""
        raw = self.__dict__["_state"]
        if type(raw) is LazyState:
            self.state_json = raw.json
        elif raw is not None:
            self.state_json = state_json(raw)
        return self

    def state_later(self) -> dict[str, Any] | LazyState | None:
        """`state` as held: a `LazyState` not decoded yet stays so (the IO thread notes it; metrics decode the
        last one at housekeeping)."""
        return self.__dict__["_state"]

    def samples_json(self, micro: int) -> bytes:
        """The JSON of micro-batch `micro`'s sample IDs, encoded on first use and kept with the entry."""
        got = self._samples_json.get(micro)
        if got is None:
            from sluice.wire.encoding import json_bytes

            got = self._samples_json[micro] = json_bytes(self.samples[micro])
        return got

    def released(self, peers: int, holders: dict[bytes, tuple[int, int]]) -> bool:
        if self.error is not None:
            return False
        for micro, got in enumerate(self.delivered):
            if len(got) >= peers:
                continue
            held = sum(1 for who, last in holders.items() if who not in got and (self.step, micro) <= last)
            if len(got) + held < peers:
                return False
        return True


class LazyState:
    """A step's data state as JSON (`datastate.state_json`'s bytes, written by the fast path's kernel), decoded
    into its dict when first asked for (`value`; `StepEntry.state`): most states only travel as these bytes."""

    __slots__ = ("json", "_value")

    def __init__(self, json: bytes) -> None:
        self.json, self._value = json, None

    def value(self) -> dict[str, Any]:
        if self._value is None:
            from sluice.wire.decoding import json_value

            self._value = json_value(self.json)
        return self._value


class LazySamples:
    """A step's sample IDs made when first read (`StepEntry.samples`): `make()` returns them. The producer's
    fast path gives one (formatting the IDs of every step was ~1/10 of its CPU a step); `make` reads only what
    is no longer written (a finished call's arrays), so the IO thread may call it."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], list[list[str]]]) -> None:
        self.make = make


def _get_samples(entry: StepEntry) -> list[list[str]]:
    got = entry.__dict__["_samples"]
    if type(got) is LazySamples:
        got = entry.__dict__["_samples"] = got.make()
    return got


def _set_samples(entry: StepEntry, value: list[list[str]] | LazySamples) -> None:
    entry.__dict__["_samples"] = value


def _get_state(entry: StepEntry) -> dict[str, Any] | None:
    got = entry.__dict__["_state"]
    if type(got) is LazyState:
        got = entry.__dict__["_state"] = got.value()
    return got


def _set_state(entry: StepEntry, value: dict[str, Any] | LazyState | None) -> None:
    entry.__dict__["_state"] = value


# (set after the dataclass is made: its __init__ assigns `samples` and `state` through the properties, repr and ==
# read them)
StepEntry.samples = property(_get_samples, _set_samples, doc="Each micro-batch's sample IDs (made on first read)")  # type: ignore[assignment]
StepEntry.state = property(_get_state, _set_state, doc="The data state after the step (a `LazyState` decoded on first read)")  # type: ignore[assignment]


NEVER = 2**63  # `StepQueue.waiting_for` of a producer that waits for a reset, not for room


class Figures(NamedTuple):
    """A queue's figures read together (`StepQueue.figures`)."""

    steps: int  # entries held
    nbytes: int
    oldest_created: float | None  # monotonic time the oldest held entry was made; None when empty
    floor: int  # lowest step not yet released


class StepQueue:
    """Assembled steps of one replica, bounded in bytes and in steps (thread-safe).

    Policy at the high watermark: the producer blocks (`wait_room`) until the
    IO thread releases entries or a reset happens. A single entry larger than
    the byte bound is still admitted when the queue is empty, so a too-small
    bound slows the daemon down instead of deadlocking it.
    """

    def __init__(self, max_bytes: int, max_steps: int) -> None:
        self.max_bytes = max_bytes
        self.max_steps = max_steps
        self.entries: OrderedDict[int, StepEntry] = OrderedDict()
        self.terminal: StepEntry | None = None  # the error entry the stream stops at, once put
        # The step a producer thread waits for room for (`room_for`), NEVER while it has nothing to make
        # (a terminal entry put), None while none waits: a release wakes it only when that room exists.
        self.waiting_for: int | None = None
        self.nbytes = 0
        self.step_nbytes = 0  # the last step's bytes (`steps_in_bytes`), 0 before the first
        self.floor = 0  # lowest step not yet released (the consumer position)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        # identity -> last (step, micro) it holds of this generation's stream; bounded, oldest dropped
        self.holders: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.holders_generation = -1  # the generation of the RESTOREs the holdings came from

    def room_for(self, step: int) -> bool:
        if not self.entries:
            return True
        return self.nbytes < self.max_bytes and step < self.floor + self.max_steps

    def put(self, entry: StepEntry) -> None:
        self.entries[entry.step] = entry
        self.nbytes += entry.nbytes
        if entry.error is not None:
            self.terminal = entry
        else:
            self.step_nbytes = entry.nbytes

    def steps_in_bytes(self) -> int:
        """How many steps of the last one's size (`step_nbytes`) the byte bound still has room for, at least 1:
        what a producer's next call may make (steps differ little in size: their rows have one shape). Any
        number while the queue is empty or has held no step yet."""
        if not self.entries or not self.step_nbytes:
            return NEVER
        return max(1, (self.max_bytes - self.nbytes) // self.step_nbytes)

    def release_upto(self, peers: int) -> int:
        """Drop leading entries that every peer has received; returns how many were dropped."""
        n = 0
        while self.entries:
            step, entry = next(iter(self.entries.items()))
            if not entry.released(peers, self.holders):
                break
            del self.entries[step]
            self.nbytes -= entry.nbytes
            self.floor = step + 1
            n += 1
        # Wake the producer only when it waits and can go on: before, every delivery also woke a producer parked
        # at the stream's end (or still over the byte bound), a GIL handoff per micro-batch to find it must wait
        # on. `waiting_for` is None only while no producer waits on `cond` (pipeline.py sets it, under the lock,
        # before each wait and clears it after its last), so a notify then wakes nobody: 1-2 us of the IO
        # thread per released step, skipped.
        if n and self.waiting_for is not None and self.room_for(self.waiting_for):
            self.cond.notify_all()
        return n

    def hold(self, identity: bytes, last: tuple[int, int]) -> None:
        """Note that `identity` holds every micro-batch up to (step, micro) `last` (under `cond`, reentrant)."""
        with self.cond:
            self.holders[identity] = max(last, self.holders.pop(identity, last))
            while len(self.holders) > MAX_HOLDERS:
                self.holders.popitem(last=False)

    def release(self, peers: int, holder: tuple[bytes, tuple[int, int]] | None = None) -> int:
        """Under the lock: note `holder` (identity, last (step, micro) it holds: `hold`), if given, then drop the
        leading entries every one of `peers` has (`release_upto`); how many were dropped."""
        with self.cond:
            if holder is not None:
                self.hold(*holder)
            return self.release_upto(peers)

    def keep_holdings(self, generation: int) -> None:
        """Before a reset by a RESTORE of `generation` (under `cond`, reentrant).

        Holdings of another generation are forgotten (its clients are fenced or
        gone: counting them would release steps nobody received); in the same
        generation, what each identity was sent from the entries about to be
        dropped becomes a holding.
        """
        with self.cond:
            if generation != self.holders_generation:
                self.holders.clear()
                self.holders_generation = generation
                return
            for entry in self.entries.values():
                for micro, got in enumerate(entry.delivered):
                    for identity in got:
                        self.hold(identity, (entry.step, micro))

    def answer(self, step: int, micro: int, replica: int, *, ahead: int, peers: int,
               send: Callable[[StepEntry], bytes | None]) -> bool:
        """Answer a GET of (`step`, `micro`), all under the queue's lock; False: `step` is not decided yet (the
        GET waits).

        Decided: its entry, or the terminal entry the stream stops at before
        it (later steps share its error), goes to `send`, which replies (a batch
        or the error) and returns the identity that received a micro-batch it
        consumes (None: nothing was delivered, or an observer's copy). That
        micro-batch then counts as received by it and the entries every peer
        has are released; True. A step already released, or
        `ahead` steps or more past the floor, raises WireError (OUT_OF_RANGE,
        TOO_FAR_AHEAD) naming it and `replica`.
        """
        with self.lock:  # (the lock of `cond`: `with self.cond` is the same lock behind two Python calls more)
            entry = self.entries.get(step)
            if entry is None:
                if step < self.floor:
                    raise WireError(errorcodes.E_OUT_OF_RANGE, f"step {step} of replica {replica} was served and "
                                    f"released (oldest held step is {self.floor}); RESTORE to go back")
                if step >= self.floor + ahead:
                    raise WireError(errorcodes.E_TOO_FAR_AHEAD, f"step {step} is more than {ahead} steps ahead of the "
                                    f"oldest held step {self.floor}")
                last = next(reversed(self.entries.values()), None)
                if last is None or last.error is None or step <= last.step:
                    return False
                entry = last  # the stream stops at a terminal step; later steps share its error
            got = send(entry)
            if got is not None:
                self.delivered(entry, micro, got, peers)
            return True

    def delivered(self, entry: StepEntry, micro: int, identity: bytes, peers: int) -> int:
        """Micro-batch `micro` of `entry`, sent to `identity` (by `answer`'s `send`, or after it: a joined reply),
        counts as received by it; the entries every peer has are released: how many."""
        with self.lock:
            entry.delivered[micro].add(identity)
            return self.release_upto(peers)

    def undecided(self, step: int, ahead: int) -> bool:
        """True when a GET of `step` plainly still waits (within the floor's window, no entry, no terminal).

        Read without the lock (the IO thread's look at each parked GET, most of which still wait while the
        producer catches up): a step or terminal entry the producer puts after this look is announced after
        it, and the GET offered again then (`answer` decides under the lock)."""
        return self.floor <= step < self.floor + ahead and step not in self.entries and self.terminal is None

    def figures(self) -> Figures:
        """Entries held, their bytes, the oldest's creation time, the floor: read together."""
        with self.cond:
            first = next(iter(self.entries.values()), None)
            return Figures(len(self.entries), self.nbytes, first.created if first else None, self.floor)

    def end_with(self, entry: StepEntry) -> bool:
        """Put terminal `entry` unless the stream already ends at one; True if it was put."""
        with self.cond:
            last = next(reversed(self.entries.values()), None)
            if last is not None and last.error is not None:
                return False
            self.put(entry)
            return True

    def clear(self, floor: int) -> None:
        self.entries.clear()
        self.terminal = None
        self.nbytes = 0
        self.floor = floor
        self.cond.notify_all()
