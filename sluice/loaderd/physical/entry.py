"""One object's tokens as the packer sees them: growing chunk by chunk, then mapped (docsource.py).

An `Entry` is the state machine of one object in a `DocSource`: the worker
that owns the object moves it (start -> grow -> publish | keep_partial |
fail), readers wait on its condition in `doc(record)`. A record far beyond
the fill's position is asked of the demand task instead (demand.py), which parks its tokens in
`demand.side`; which path made a document never changes its bytes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from sluice.errors import InternalError
from sluice.loaderd.physical.demand import Demand
from sluice.waits import wait_saying

ENTRY_COST = 64 << 10  # bytes charged per mapped entry (its pages live in the page cache)
# A reader that hears nothing from the object's worker for this long says so (a warning naming the object),
# again each time its wait doubles: a fetch or a fill that hangs is named, never waited for in silence.
SAY_AFTER_S = 30.0

log = logging.getLogger("sluice.loaderd")


class Evicted(Exception):
    """Internal: an entry whose spool file was closed by eviction; the caller asks again."""


class Entry:
    """One object's tokens as the packer sees them: growing chunk by chunk, then mapped.

    States: pending (nothing readable) -> growing (`partial` reads documents
    [0, ready)) -> done (`shard` mapped, or `partial` complete when the cache
    did not keep the tokens) | failed (`error`). Transitions come from the one
    worker that owns the object; readers wait on `cond`.
    """

    __slots__ = ("cond", "ready", "shard", "partial", "pin", "error", "done", "nbytes", "demand", "ask", "closed",
                 "raw", "raw_lock", "waiting", "stale", "stopping", "waited", "next_partial", "where")

    def __init__(self, demand: Demand | None = None, ask: Any = None, waited: Any = None, where: str = "") -> None:
        self.cond = threading.Condition()
        self.where = where  # the object, as a long wait's warning names it
        self.demand = demand  # out-of-order tokenizing of records far beyond the fill (demand.py), or None
        self.ask = ask  # ask(entry): schedule the demand task (DocSource._ask)
        # waited(): a reader waits for the demand task to make its record (neither written by the fill
        # nor made ahead from an announcement); called under `cond`, so it takes no lock of the DocSource's
        self.waited = waited
        self.closed = False
        self.raw: Any = None  # the raw object's cache pin, shared by the fill and the demand task
        self.raw_lock = threading.Lock()  # one fetch per entry
        self.ready = 0
        self.shard: Any = None
        self.partial: Any = None
        # A second writer's reader (the fill started again from record 0: tokcache.fill_tokens after a
        # full disk), waiting until that writer has passed `ready`; then it replaces `partial`.
        self.next_partial: Any = None
        self.pin: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.nbytes = ENTRY_COST
        # After a RESTORE (DocSource.restored): `stale` = no prefetch window holds the object and no
        # reader waits (its fill may stop at its next chunk); a reader clears it. `stopping` = the fill
        # is stopping: readers ask again (Evicted) and get a new entry. `waiting`: readers in `cond.wait`.
        self.waiting = 0
        self.stale = False
        self.stopping = False

    def doc(self, record: int) -> np.ndarray:
        shard = self.shard
        if shard is not None:
            return shard.doc(record)
        counted = False  # (this record's wait for the demand task, counted once)
        with self.cond:
            self.stale = False  # needed after all
            # Bounded by the worker: it writes the next chunk, publishes, or fails
            # (the cache's fill-lock timeout bounds a wait on another process);
            # a record far beyond the fill is made by the demand task instead.
            while self.shard is None:
                if self.stopping:  # its fill stops (stale after a RESTORE): a new entry makes it
                    raise Evicted()
                if self.error is not None:
                    raise self.error
                if record < self.ready:
                    if self.partial is None:  # dropped from the LRU after the caller got this entry
                        raise Evicted()
                    return self.partial.doc(record)  # under the lock: `partial` cannot close meanwhile
                if self.done:
                    raise InternalError(f"record {record} beyond a finished object of {self.ready}")
                if self.closed:
                    raise Evicted()
                demand = self.demand
                if demand is None:
                    self._wait(f"record {record}")
                    continue
                got = demand.get(record)
                if got is not None:
                    return got
                # Even a record just past the fill: the fill gives way to demand batches
                # (demandtasks._between_chunks), so waiting for it could take long.
                demand.wanted.add(record)
                if not counted and self.waited is not None:
                    counted = True
                    self.waited()
                self.ask(self)
                self._wait(f"record {record} (asked out of order)")
            shard = self.shard
        return shard.doc(record)

    def wait_final(self) -> bool:
        """Wait until the entry is final (mapped, kept unmapped, failed), closed or stopping, as `doc` waits
        for a record (bounded by the worker); True when its shard is mapped."""
        with self.cond:
            self.stale = False  # needed after all
            while not (self.done or self.closed or self.stopping):
                self._wait("the end of its fill")
            return self.shard is not None and not self.closed

    def _wait(self, what: str) -> None:
        """Under the lock: wait for the worker (`what`: what the reader waits for), counted (a waited-for object
        is never stale). Every transition notifies; a wait that hears nothing for `SAY_AFTER_S` is logged, and
        again each time it doubles, naming the object and how far its fill got."""
        self.waiting += 1
        try:
            wait_saying(self.cond.wait, lambda s: log.warning(
                f"loaderd: a step has waited {s:.1f} s for {what} of {self.where or 'an object'} with no word from "
                f"its worker ({self.ready} records ready); still waiting"), SAY_AFTER_S)
        finally:
            self.waiting -= 1

    # -- transitions (the owning worker) --------------------------------------
    def start(self, reader: Any) -> None:
        """The fill's reader. A second one (the fill writes the object again from record 0) serves
        only once its writer has passed what the first one serves (`grow`): until then the first
        one, whose documents stay readable, keeps serving."""
        with self.cond:
            if self.partial is None or self.ready == 0:
                if self.partial is not None:
                    self.partial.close()
                self.partial = reader
                return
            if self.next_partial is not None:
                self.next_partial.close()
            self.next_partial = reader

    def grow(self, ready: int) -> None:
        with self.cond:
            if self.next_partial is not None:
                if ready < self.ready:  # the second writer has not caught up: nothing new to serve
                    return
                if self.partial is not None:
                    self.partial.close()  # (under the lock: no reader is inside it)
                self.partial, self.next_partial = self.next_partial, None
            self.ready = ready
            if self.demand is not None:
                self.demand.passed(ready)
            self.cond.notify_all()

    def publish(self, shard: Any, pin: Any) -> None:
        with self.cond:
            if self.error is not None:  # the demand task found the object bad first
                pin.close()
                return
            self.shard, self.pin, self.done = shard, pin, True
            self._settle(close_partial=True)

    def keep_partial(self, ready: int, nbytes: int) -> None:
        with self.cond:
            if self.next_partial is not None:  # its writer finished: it holds every document
                if self.partial is not None:
                    self.partial.close()
                self.partial, self.next_partial = self.next_partial, None
            self.ready, self.done, self.nbytes = ready, True, nbytes
            self._settle(close_partial=False)

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.done = True
            self._settle(close_partial=True)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            if self.pin is not None:
                self.pin.close()  # the packer may still hold views of the map: it stays valid
                self.pin = None
            self._settle(close_partial=True)

    def _settle(self, *, close_partial: bool) -> None:
        """Under the lock: the entry is final (or closed): drop the spool reader (unless it serves
        the object), the out-of-order state, and wake the readers."""
        if close_partial and self.partial is not None:
            self.partial.close()
            self.partial = None
        if self.next_partial is not None:
            self.next_partial.close()
            self.next_partial = None
        if self.demand is not None:
            self.demand.release()
        if self.raw is not None:  # readers hold their own descriptors of the file
            self.raw.close()
            self.raw = None
        self.cond.notify_all()
