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

The loop itself is `steploop.StepLoop`; this class is its sink: the queue,
under its lock.

Steps at once: after its first step (from the start or a RESTORE, made alone
so the waiting client gets it soonest) the producer computes up to
`STEPS_AT_ONCE` steps per call (`StepMaker.produce_run`, the same entries
one at a time would give; one step while an object is being filled), never
past the queue's step lead nor more than fit `CALL_BYTES` at the last step's
size (`steps_a_call`); once it found the queue at that lead, it waits
for room for a whole call (`wait`). A delivery wakes a producer waiting at
the lead bound only when it made room (`StepQueue.waiting_for`), never one
parked at a terminal step. The queue's byte bound is checked before each
call, and a call makes no more steps than fit under it at the last step's
size, so it is passed by about one step at most (steps of one run differ
only in their cu_seqlens). The steps of one call may share one block of
rows, freed when the last of them is released.

Release policy: an entry is released when each of its micro-batches has been
sent to `peers` distinct client identities (several ranks of one replica get the
same bytes, produced once). A RESTORE (`reset`) drops everything and restarts
the producer from the given state; results computed under the old state are
discarded by comparing a reset counter (`epoch`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sluice.loaderd.logical import DataState, Plan
from sluice.loaderd.physical.docsource import DocSource
from sluice.loaderd.physical.producer import StepMaker, steps_a_call, terminal
from sluice.loaderd.physical.stepqueue import NEVER, StepEntry, StepQueue
from sluice.loaderd.physical.steploop import StepLoop
from sluice.wire import errorcodes

__all__ = ["ReplicaPipeline", "StepEntry", "StepQueue"]

WAIT_S = 0.5  # a producer waiting for room wakes at least this often (and makes what fits, if anything)

log = logging.getLogger("sluice.loaderd")


class ReplicaPipeline:
    """The producer of one replica, as the server's IO thread sees it: a thread running the `StepLoop`
    (steploop.py) with the `StepQueue` as its sink.

    `queue` holds the produced steps (the IO thread answers GETs from it and
    releases them: `StepQueue.answer`); `peers` is set by HELLO;
    `produced_steps` counts steps produced since start; `failed` says why its thread stopped (None: it did
    not), and the stream then ends there (`_run`).
    """

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
        maker = StepMaker(plan, docs, replica=replica, replicas=replicas, metrics=metrics)
        self.replica = replica
        self.lanes = maker.lanes
        self.micro_per_step = maker.micro_per_step
        self.queue = StepQueue(max_bytes, lead_steps)
        self.loop = StepLoop(maker, self, state.subset(self.lanes))
        self.queue.floor = self.loop.state.step + 1
        self.peers = 1
        self._notify = notify
        self._stop = False
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"loaderd-replica-{replica}", daemon=True)

    @property
    def produced_steps(self) -> int:
        return self.loop.produced

    @property
    def thread(self) -> threading.Thread:
        """The producer thread (its `native_id` once started: `gilcpu.GilCpu` keeps it on the IO loop's CPU)."""
        return self._thread

    # -- control (called from the IO thread) --------------------------------
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """The producer thread: the loop. A bug that escapes it (every step's own failure is the step's terminal
        entry already: `StepMaker`) ends the replica's stream with an INTERNAL error at the next step, logged
        with its traceback, so a GET waiting for it is answered at once rather than after the client's
        `max_wait_s` (15 minutes by default), and a RESTORE ends there again (`reset`)."""
        try:
            self.loop.run()
        except BaseException as exc:  # noqa: BLE001 - whatever stopped the thread is told to the clients
            log.error("the producer of replica %d stopped", self.replica, exc_info=True)
            with self.queue.cond:
                self.failed = f"the producer of replica {self.replica} stopped: bug in sluice: {exc!r:.300}"
                self._end_failed()
            self._notify(self.replica)

    def _end_failed(self) -> None:
        """(Under the queue's lock.) End the stream with `failed` at the step after the last one held or made."""
        q = self.queue
        last = next(reversed(q.entries), None)
        step = max(self.loop.state.step + 1, q.floor, -1 if last is None else last + 1)
        q.end_with(terminal(step, errorcodes.E_INTERNAL, f"step {step}: {self.failed}"))

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
        # (the old position's objects may stop: the producer thread says so before its first call for `state`)
        with self.queue.cond:
            self.loop.restart(state.subset(self.lanes), self.loop.epoch + 1)
            self.queue.clear(self.loop.state.step + 1)
            if self.failed is not None:  # (no thread makes steps any more: the restored stream ends at once)
                self._end_failed()

    @property
    def next_step(self) -> int:
        return self.loop.state.step + 1

    # -- the loop's sink (steploop.StepSink; called from the producer thread) ------
    def wait(self, loop: StepLoop) -> tuple[int, DataState, int] | None:
        q = self.queue
        with q.cond:
            # A producer that finds the queue at its lead bound (its consumer is slower: a trainer) waits for room
            # for a whole call (`refill` steps), not for one step: woken once a call instead of at every release,
            # each wake-up starting cold after the CPUs idled. At a trainer's pace that cut the producer's CPU a
            # micro-batch by a third (bench/steady.py --sleep-ms 5, docs/performance.md); the queue then still
            # holds half the lead, and a busy consumer keeps it under the bound (no wait, as before).
            # A consumer that pauses (a checkpoint, an evaluation) still finds the whole lead made: when no whole
            # call's room came within a wait (`WAIT_S`), the producer makes what fits.
            first = loop.state.step + 1
            refill = min(max(1, q.max_steps // 2), steps_a_call(q.step_nbytes))
            last = first if loop.fresh or q.room_for(first) else first - 1 + refill
            while not self._stop and (loop.parked or not q.room_for(last)):
                # What a delivery must make room for to wake it (NEVER while parked at a terminal step:
                # each delivery woke it, a GIL handoff per micro-batch, to find it had nothing to make).
                q.waiting_for = NEVER if loop.parked else last
                if not q.cond.wait(WAIT_S) and not loop.parked and q.room_for(first):
                    break
            q.waiting_for = None
            if self._stop:
                return None
            # (the byte bound too: a call of STEPS_AT_ONCE large steps went up to that many steps past it; and a
            # call's block stays within CALL_BYTES)
            return loop.epoch, loop.state, min(q.floor + q.max_steps - (loop.state.step + 1), q.steps_in_bytes(),
                                               steps_a_call(q.step_nbytes))

    def accept(self, epoch: int) -> _Accepting:
        return _Accepting(self.queue.cond, lambda: epoch == self.loop.epoch)

    def put(self, entry: StepEntry) -> None:
        self.queue.put(entry)

    def sent(self) -> None:
        self._notify(self.replica)


class _Accepting:
    """The queue's lock held while a call's entries go in; entered: whether they still count (same epoch)."""

    __slots__ = ("_cond", "_current")

    def __init__(self, cond: threading.Condition, current: Callable[[], bool]) -> None:
        self._cond, self._current = cond, current

    def __enter__(self) -> bool:
        self._cond.acquire()
        return self._current()

    def __exit__(self, *exc: object) -> None:
        self._cond.release()
