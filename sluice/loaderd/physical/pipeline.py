"""The thread producer of one replica (a `producer.Producer`).

One `ReplicaPipeline` per replica the daemon serves. Its producer thread runs
`StepMaker.produce_step` (the logical plane) step after step for the
replica's lanes, cuts the result into micro-batches and parks them in a
`StepQueue` (stepqueue.py)::

    Plan.upcoming --prefetch--> DocSource workers (read, decode, tokenize)
                                     |  per-object futures, bounded LRU
    Plan.step(state, docs, lanes) <--+  (the docs callback blocks on its object)
         |  micro-batches + state after the step
         v
    StepQueue: step -> StepEntry   bounded by bytes AND by steps ahead of the
         |                         oldest unreleased step (prefetch lead);
         v                         the producer blocks at the bound
    server (IO thread) answers GET(step, micro) from the queue

Determinism: the queue holds exactly what `Plan.step` returned for consecutive
steps from the restored state; the workers only make the `docs` callback fast,
so timing, cache hits and worker order never change a byte.

Steps at once: after its first step (from the start or a RESTORE, made alone
so the waiting client gets it soonest) the producer computes up to
`STEPS_AT_ONCE` steps per call (`StepMaker.produce_run`, the same entries one
at a time would give; one step while an object is being filled), never past
the queue's step lead. A delivery wakes a producer waiting at the lead
bound only when it made room (`StepQueue.waiting_for`), never one parked at a
terminal step. The queue's byte bound is checked before each call, so
it can be passed by at most STEPS_AT_ONCE - 1 steps (a few hundred KiB at the
usual sizes). The steps of one call may share one block of rows, freed when
the last of them is released.

Release policy: an entry is released when each of its micro-batches has been
sent to `peers` distinct client identities (several ranks of one replica get the
same bytes, produced once). A RESTORE (`reset`) drops everything and restarts
the producer from the given state; results computed under the old state are
discarded by comparing a reset counter (`epoch`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

from sluice.loaderd.logical import DataState, Plan
from sluice.loaderd.physical.jitload import START_AFTER_STEPS
from sluice.loaderd.physical.docsource import DocSource
from sluice.loaderd.physical.producer import STEPS_AT_ONCE, StepMaker
from sluice.loaderd.physical.stepqueue import NEVER, StepEntry, StepQueue

__all__ = ["ReplicaPipeline", "StepEntry", "StepQueue"]

_yield = getattr(os, "sched_yield", lambda: None)  # POSIX; elsewhere nothing to give away


class ReplicaPipeline:
    """Producer thread of one replica: Plan.step -> micro-batches -> StepQueue."""

    def __init__(
        self,
        *,
        plan: Plan,
        replica: int,
        replicas: int,
        docs: DocSource,
        state: DataState,
        max_bytes: int,
        lead_steps: int,
        notify: Callable[[int], None],
        metrics: Any = None,
    ) -> None:
        self.maker = StepMaker(plan, docs, replica=replica, replicas=replicas, metrics=metrics)
        self.replica = replica
        self.lanes = self.maker.lanes
        self.micro_per_step = self.maker.micro_per_step
        self.queue = StepQueue(max_bytes, lead_steps)
        self.state = state.subset(self.lanes)
        self.queue.floor = self.state.step + 1
        self.epoch = 0
        self.peers = 1
        self.produced_steps = 0
        self._notify = notify
        self._stop = False
        self._parked = False  # a terminal entry (end, exhausted, object error) was produced
        self._fresh = True  # no step produced since the start or the last RESTORE
        self._thread = threading.Thread(target=self._run, name=f"loaderd-replica-{replica}", daemon=True)

    @property
    def steps_socket(self) -> zmq.Socket | None:
        return None  # steps are put in the queue directly; the IO thread is woken by `notify`

    def receive(self) -> bool:
        return False

    def exit_code(self) -> int | None:
        return None  # a thread cannot die without taking the daemon along; bugs become terminal entries

    @property
    def pid(self) -> int | None:
        return None

    def tend(self) -> None:
        """Nothing to retry: the IO thread talks to this producer through the queue only."""

    # -- control (called from the IO thread) --------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the producer thread, waiting at most `timeout` s; True once it ended (or never started).

        A thread computing a step ends when the step does: the daemon
        interrupts its document source first (`Server.close`), so a step
        waiting for a fill ends at once."""
        with self.queue.cond:
            self._stop = True
            self.queue.cond.notify_all()
        if self._thread.ident is not None:  # never started when bind() failed
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def reset(self, state: DataState) -> None:
        """Drop everything prefetched and resume after `state` (already validated)."""
        if self._thread.ident is not None:  # the old position's objects may stop (DocSource.restored)
            self.maker.docs.restored(self._thread.ident)
        with self.queue.cond:
            self.epoch += 1
            self.state = state.subset(self.lanes)
            self._parked = False
            self._fresh = True
            self.queue.clear(self.state.step + 1)

    @property
    def next_step(self) -> int:
        return self.state.step + 1

    def after_release(self) -> None:
        """Hook for the IO thread after deliveries (the process producer reports its floor here)."""

    # -- producer ------------------------------------------------------------
    def _run(self) -> None:
        q = self.queue
        while True:
            with q.cond:
                while not self._stop and (self._parked or not q.room_for(self.state.step + 1)):
                    # What a delivery must make room for to wake it (NEVER while parked at a terminal step:
                    # each delivery woke it, a GIL handoff per micro-batch, to find it had nothing to make).
                    # Room for one step, not for a multi-step call: waiting for 4 made the time-to-batch tail
                    # 0.8 ms worse (docs/performance.md).
                    q.waiting_for = NEVER if self._parked else self.state.step + 1
                    q.cond.wait(0.5)
                q.waiting_for = None
                if self._stop:
                    return
                epoch, state = self.epoch, self.state
                # The first step after a start or a RESTORE alone (the client waits for it); then up to
                # STEPS_AT_ONCE in one call, never past the queue's step lead.
                n = 1 if self._fresh else max(1, min(STEPS_AT_ONCE, q.floor + q.max_steps - (state.step + 1)))
            made, after = self.maker.produce_run(state, n)
            # Give the core away once per call (1-3 ms of packing): a thread of the serving path (the IO
            # thread, zmq's IO threads, a client's) woken onto this core waits otherwise until this thread's
            # slice ends, which was the time-to-batch tail (docs/loaderd.md, "Time to batch"). Returns at
            # once when nothing waits; priority and share are unchanged.
            _yield()
            with q.cond:
                if epoch != self.epoch:
                    continue  # a RESTORE arrived while we computed: discard
                self._fresh = False
                for entry in made:
                    q.put(entry)
                    if entry.error is not None:  # (a terminal entry comes alone: `after` is None)
                        self._parked = True
                        break
                    self.produced_steps += 1
                else:
                    self.state = after
            self._notify(self.replica)
            if self.maker.jit is not None and self.produced_steps >= START_AFTER_STEPS:
                # The fused path's kernel loads in the background once the stream is steady (the start and
                # a short run never pay for numba: physical/jitload.py); does nothing after the first call.
                self.maker.jit.start()
