"""Per-replica producer and its bounded step queue.

One `ReplicaPipeline` per replica the daemon serves. Its producer thread runs
the pure logical plane (`Plan.step`) step after step for the replica's lanes,
cuts the result into micro-batches and parks them in a `StepQueue`::

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

Release policy: an entry is released when each of its micro-batches has been
sent to `peers` distinct client identities (several ranks of one replica get the
same bytes, produced once). A RESTORE (`reset`) drops everything and restarts
the producer from the given state; results computed under the old state are
discarded by comparing a reset counter (`epoch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice import wire
from sluice.errors import EndOfStream, ExhaustedError, SluiceError

log = logging.getLogger("sluice.loaderd")


@dataclass
class StepEntry:
    """What the daemon serves for one (replica, step): micro-batches or a terminal error."""

    step: int
    micros: list[dict[str, np.ndarray]]
    samples: list[list[str]]
    state: dict[str, Any] | None  # DataState.subset(lanes).state_dict() after this step
    nbytes: int
    created: float
    error: tuple[str, str, dict[str, Any]] | None = None  # (code, message, extra body fields)
    delivered: list[set[bytes]] = field(default_factory=list)

    def released(self, peers: int) -> bool:
        return self.error is None and all(len(d) >= peers for d in self.delivered)


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
        self.nbytes = 0
        self.floor = 0  # lowest step not yet released (the consumer position)
        self.cond = threading.Condition()

    def room_for(self, step: int) -> bool:
        if not self.entries:
            return True
        return self.nbytes < self.max_bytes and step < self.floor + self.max_steps

    def put(self, entry: StepEntry) -> None:
        self.entries[entry.step] = entry
        self.nbytes += entry.nbytes

    def release_upto(self, peers: int) -> int:
        """Drop leading entries that every peer has received; returns how many were dropped."""
        n = 0
        while self.entries:
            step, entry = next(iter(self.entries.items()))
            if not entry.released(peers):
                break
            del self.entries[step]
            self.nbytes -= entry.nbytes
            self.floor = step + 1
            n += 1
        if n:
            self.cond.notify_all()
        return n

    def clear(self, floor: int) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.floor = floor
        self.cond.notify_all()


class ReplicaPipeline:
    """Producer thread of one replica: Plan.step -> micro-batches -> StepQueue."""

    def __init__(
        self,
        *,
        plan: Any,
        replica: int,
        replicas: int,
        docs: Any,
        state: Any,
        max_bytes: int,
        lead_steps: int,
        notify: Callable[[int], None],
        metrics: Any = None,
    ) -> None:
        self.plan = plan
        self.replica = replica
        self.replicas = replicas
        self.lanes = list(plan.lanes_of(replicas, replica))
        self.micro_per_step = (plan.spec.global_batch // replicas) // plan.spec.micro_batch
        self.docs = docs
        self.queue = StepQueue(max_bytes, lead_steps)
        self.state = state.subset(self.lanes)
        self.queue.floor = self.state.step + 1
        self.epoch = 0
        self.peers = 1
        self._notify = notify
        self._metrics = metrics
        self._stop = False
        self._parked = False  # a terminal entry (end, exhausted, object error) was produced
        self._thread = threading.Thread(target=self._run, name=f"loaderd-replica-{replica}", daemon=True)
        self.produced_steps = 0
        self._decodes = any(src.format != "tokens" for src in plan.manifest.sources)
        self.docs_per_step = 1.0

    # -- control (called from the IO thread) --------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self.queue.cond:
            self._stop = True
            self.queue.cond.notify_all()
        if self._thread.ident is not None:  # never started when bind() failed
            self._thread.join(timeout)

    def reset(self, state: Any) -> None:
        """Drop everything prefetched and resume after `state` (already validated)."""
        with self.queue.cond:
            self.epoch += 1
            self.state = state.subset(self.lanes)
            self._parked = False
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
                    q.cond.wait(0.5)
                if self._stop:
                    return
                epoch, state = self.epoch, self.state
            entry, new_state = self._produce(state)
            with q.cond:
                if epoch != self.epoch:
                    continue  # a RESTORE arrived while we computed: discard
                q.put(entry)
                if entry.error is None:
                    self.state = new_state
                    self.produced_steps += 1
                else:
                    self._parked = True
            self._notify(self.replica)

    def _prefetch(self, state: Any) -> None:
        """Queue the objects of about the next step's documents (per lane and source) for the workers.

        Skipped when every source is pre-tokenized: a shard opens in microseconds
        (memory map), and computing upcoming refs would cost more than it saves.
        """
        if not self._decodes:
            return
        want = int(self.docs_per_step) + 2
        refs = []
        for lane in self.lanes:
            refs.extend(self.plan.upcoming(state, lane, want))
        self.docs.prefetch(refs)

    def _produce(self, state: Any) -> tuple[StepEntry, Any]:
        step = state.step + 1
        t0 = time.perf_counter()
        before = self.docs.calls
        try:
            self._prefetch(state)
            batch, new_state = self.plan.step(state, self.docs, self.lanes)
            mbs = self.plan.replica_micro_batches(batch, self.replicas, self.replica)
        except EndOfStream as exc:
            return self._terminal(step, wire.E_END, f"step {step}: end of stream ({exc})"), None
        except ExhaustedError as exc:
            return self._terminal(step, wire.E_EXHAUSTED, f"step {step}: {exc}"), None
        except SluiceError as exc:
            obj = getattr(exc, "object_location", None)
            log.error("step failed", extra={"step": step, "replica": self.replica, "error": str(exc)})
            if self._metrics is not None:
                self._metrics.object_errors.inc()
            return self._terminal(step, wire.E_OBJECT, f"step {step}: {exc}", object=obj), None
        except Exception as exc:  # a bug: report it to the client instead of dying silently
            log.exception("internal error producing step %d", step)
            return self._terminal(step, wire.E_INTERNAL, f"step {step}: bug in sluice: {exc!r}"), None
        n_docs = self.docs.calls - before
        self.docs_per_step = 0.8 * self.docs_per_step + 0.2 * max(1.0, n_docs / max(1, len(self.lanes)))
        micros, samples, nbytes = [], [], 0
        for mb in mbs:
            arrays = {k: np.ascontiguousarray(v, dtype="<i4") for k, v in mb.arrays().items()}
            nbytes += sum(a.nbytes for a in arrays.values())
            micros.append(arrays)
            samples.append(list(mb.samples))
        entry = StepEntry(
            step=step,
            micros=micros,
            samples=samples,
            state=new_state.subset(self.lanes).state_dict(),
            nbytes=nbytes,
            created=time.monotonic(),
            delivered=[set() for _ in micros],
        )
        if self._metrics is not None:
            self._metrics.steps.inc()
        log.debug("step produced", extra={"step": step, "replica": self.replica,
                                          "seconds": round(time.perf_counter() - t0, 6)})
        return entry, new_state

    def _terminal(self, step: int, code: str, message: str, **extra: Any) -> StepEntry:
        return StepEntry(step=step, micros=[], samples=[], state=None, nbytes=0, created=time.monotonic(),
                         error=(code, message, {k: v for k, v in extra.items() if v is not None}))
