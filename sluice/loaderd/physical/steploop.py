"""The producer loop of one replica: `StepMaker` steps handed to a sink (the thread producer's `StepQueue`).

`StepLoop.run` makes a replica's steps with `StepMaker.produce_run` and hands
them to a `StepSink` (pipeline.py: the queue, under its lock; the tests: a
recording sink)::

    sink.wait(loop) -- room for the next step? (the step lead, the byte bound; parked: a RESTORE) --+
         |  (epoch, state, steps of room)                                                        |
         v                                                                                       |
    maker.produce_run(state, n) -> entries, state after    n: 1 after a start or RESTORE, then   |
         |                                                    up to STEPS_AT_ONCE, never past   |
         v                                                    the step lead                      |
    sink.accept(epoch): sink.put(entry) for each, sink.sent() ------------------------------------+

A RESTORE reaches the loop through `restart` (called by the IO thread under
the queue's lock): the first step after a start or a RESTORE is made alone (a
client waits for it), a terminal entry parks the loop until the next RESTORE,
and the steps computed under a superseded state are dropped.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from typing import Protocol

from sluice.loaderd.logical import DataState
from sluice.loaderd.physical.giveway import yield_now
from sluice.loaderd.physical.jitstart import StartRule
from sluice.loaderd.physical.producer import STEPS_AT_ONCE, StepMaker
from sluice.loaderd.physical.stepqueue import StepEntry

__all__ = ["StepLoop", "StepSink"]


class StepSink(Protocol):
    """Where a `StepLoop`'s steps go, and what it waits for."""

    def wait(self, loop: StepLoop) -> tuple[int, DataState, int] | None:
        """Block until the loop may make the step after `loop.state` (room at the step lead and the byte
        bound, not parked); then (`loop.epoch`, `loop.state`, how many steps the lead leaves room for), read
        together. None: stop (the daemon said so, or it is gone)."""

    def accept(self, epoch: int) -> AbstractContextManager[bool]:
        """Around the hand-over of one call's entries: True when they still count (no RESTORE since `epoch`
        was read); the thread sink holds its queue's lock for the whole of it."""

    def put(self, entry: StepEntry) -> None:
        """Hand one entry over (inside `accept`)."""

    def sent(self) -> None:
        """After a call's entries were handed over: wake the reader."""


class StepLoop:
    """One replica's producer loop: `StepMaker` steps after `state`, handed to a `StepSink`.

    `state`, `epoch`, `parked` and `fresh` change only in `run` and in
    `restart`; the thread producer calls `restart` under its queue's lock, as
    its sink reads them (`StepSink.wait`, `accept`).
    """

    def __init__(self, maker: StepMaker, sink: StepSink, state: DataState | None) -> None:
        self.maker = maker
        self.sink = sink
        self.state = state
        self.epoch = 0
        self.parked = False  # a terminal entry (end, exhausted, object error) was handed over
        self.fresh = True  # no step made since the start or the last RESTORE
        self.produced = 0  # steps handed over
        self.idle_s = 0.0  # seconds waited for room (not parked): the consumer is slower
        # when the fused path's kernel starts loading (physical/jitstart.py); None: no kernel, or started
        self.kernel_rule = None if maker.jit is None else StartRule(maker.plan.spec.max_steps)
        self.kernel_asked: tuple[int, str] | None = None  # (steps handed over, why) when the load was asked for
        self.kernel_held: int | None = None  # the first step after which the rule was due but tokens were being made
        self._swept = 0  # the epoch whose position the document source has been told of (`DocSource.restored`)

    def restart(self, state: DataState, epoch: int) -> None:
        """Go on after `state` (a RESTORE of `epoch`): not parked, the next step made alone."""
        self.state, self.epoch, self.parked, self.fresh = state, epoch, False, True

    def run(self) -> None:
        """Make and hand over steps until the sink says stop."""
        sink = self.sink
        while True:
            parked, t0 = self.parked, time.perf_counter()
            got = sink.wait(self)
            if not parked:
                self.idle_s += time.perf_counter() - t0
            if got is None:
                return
            epoch, state, room = got
            # The first step after a start or a RESTORE alone (the client waits for it); then up to
            # STEPS_AT_ONCE in one call, never past the step lead.
            n = 1 if self.fresh else max(1, min(STEPS_AT_ONCE, room))
            if epoch != self._swept:
                # A RESTORE: the objects the old position left may stop, at this thread's next announcement
                # (`DocSource.restored`). Told here, before the first call for the new state, so that no call
                # still making an old step (its state read before the RESTORE) announces the old position
                # after it and takes the sweep with the old window.
                self._swept = epoch
                self.maker.docs.restored(threading.get_ident())
            made, after = self.maker.produce_run(state, n)
            # Give the core away after each call, as within it (giveway.py: before each kernel call and
            # between entries): a thread of the serving path (the IO thread, zmq's IO threads, a client's)
            # woken onto this core waits otherwise until this thread's slice ends, which was the
            # time-to-batch tail (docs/loaderd.md, "Time to batch"). Returns at once when nothing waits.
            yield_now()
            self._hand_over(epoch, made, after)
            if self.kernel_rule is not None:
                self._start_kernel()

    def _start_kernel(self) -> None:
        """Start the kernel's background load when `kernel_rule` says so (after a call: never on the start path,
        the first batch or a RESTORE's step; physical/jitstart.py). Not while some object's tokens are being
        made from text: every step is then `Plan.step`'s (`StepMaker._produce`, reason ``filling``), so the load
        would cost its GIL time and memory for nothing; the rule is asked again once they are made, and the
        log line says from which step it was held back."""
        step = None if self.state is None else self.state.step
        ready = getattr(self.maker.jit, "ready", None)
        why = self.kernel_rule.due(self.produced, self.idle_s, step, ready is not None and ready())
        if why is None:
            return
        if self.maker.docs.making:
            if self.kernel_held is None:
                self.kernel_held = -1 if step is None else step
            return
        held = "" if self.kernel_held is None else f"; held back after step {self.kernel_held} while tokens were made"
        self.kernel_rule, self.kernel_asked = None, (self.produced, why)
        self.maker.jit.start(f"{why}; after step {step}{held}")

    def _hand_over(self, epoch: int, made: list[StepEntry], after: DataState | None) -> None:
        """Give one call's entries to the sink (none where a RESTORE came while they were computed)."""
        with self.sink.accept(epoch) as current:
            if not current:
                return  # a RESTORE arrived while we computed: discard
            self.fresh = False
            for entry in made:
                self.sink.put(entry)
                if entry.error is not None:  # (a terminal entry comes alone: `after` is None)
                    self.parked = True
                    break
                self.produced += 1
            else:
                self.state = after
        self.sink.sent()
