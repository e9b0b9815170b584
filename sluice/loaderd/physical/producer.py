"""The one step function of a replica's producer: `StepMaker`, run by `steploop.StepLoop` (pipeline.py).

    state after step k-1 --StepMaker.produce_step--> StepEntry(step k: micro-batches | terminal error), state after k

`StepMaker` holds its documents by `DocSource`'s methods (no probing of attributes): a stand-in (tests,
benches) provides them all (tests/logical_helpers.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from sluice import batcharrays
from sluice.errors import EndOfStream, ExhaustedError, ObjectReadError, SluiceError, Stopping
from sluice.loaderd.logical import DataState, Plan
from sluice.loaderd.logical.fast import STATE, fast_steps
from sluice.loaderd.logical.jit import Blocks
from sluice.loaderd.logical.fused import FusedSteps, StateTexts
from sluice.loaderd.logical.upcoming import upcoming_columns
from sluice.loaderd.metrics import ERROR, FILLING
from sluice.loaderd.physical.docsource import DocSource
from sluice.loaderd.physical.giveway import give_way
from sluice.loaderd.physical.sourcecount import Counts, SourceCounts
from sluice.loaderd.physical.stepqueue import LazySamples, LazyState, StepEntry
from sluice.wire import errorcodes

log = logging.getLogger("sluice.loaderd")

PREFETCH_STEPS = 4  # steps of documents announced ahead (bounded: DocSource keeps only the last announcement)
SETTLED_HORIZON = 4  # how many times as far an announcement looks once every object it named was done (mapped)
# Steps a thread producer computes in one call once it runs ahead (`StepMaker.produce_steps`): the
# per-lane and per-assembly costs are paid once for them, and a call that starts cold (a producer woken after its
# consumer let the CPUs idle) pays its cold start once for them. Bounded by the queue's step lead.
STEPS_AT_ONCE = 16
# ... and by the bytes of a call's block of rows: a call of large steps writes a block past the caches before the
# IO thread copies it out. With 8 [8, 2048] micro-batches a step, calls of 16 steps (25 MB) took 0.163 ms of the
# daemon's CPU a micro-batch, calls within 8 MiB (5 steps) 0.145; calls of 2 (3.1 MB) cost more than of 4, their
# fixed cost shared by fewer micro-batches (bench/steady.py --micro-per-step 8 --base TREE, bench/results/README.md
# "Stop 39"). A step of one micro-batch still makes 16 a call (3 MiB).
CALL_BYTES = 8 << 20


def steps_a_call(step_bytes: int, most: int = STEPS_AT_ONCE) -> int:
    """Steps one call makes at most where each step's rows are `step_bytes` (0: not known yet): `most`
    (`STEPS_AT_ONCE`), within `CALL_BYTES`, at least 1 (a replica's producer reads the size off its queue,
    `StepQueue.step_nbytes`: the last step's)."""
    return max(1, min(most, CALL_BYTES // max(step_bytes, 1)))


# A step whose cached files changed while it was copied is made again (after their chunks were verified again,
# and damaged objects quarantined and dropped); past this many tries it ends the replica's stream with an error.
VERIFY_TRIES = 4


class StepMaker:
    """Computes one replica's steps: `produce_step(state)` -> (StepEntry, state after).

    Owns the prefetch estimate (documents per step and lane, a moving average)
    so the DocSource workers decode the objects of the next step while this one
    is packed.
    """

    def __init__(self, plan: Plan, docs: DocSource, *, replica: int, replicas: int, metrics: Any = None) -> None:
        self.plan = plan
        self.docs = docs
        self.replica = replica
        self.replicas = replicas
        self.lanes = list(plan.lanes_of(replicas, replica))
        self.micro_per_step = (plan.spec.global_batch // replicas) // plan.spec.micro_batch
        self._metrics = metrics
        self._decodes = any(src.format != "tokens" for src in plan.manifest.sources)
        self.docs_per_step = 1.0
        self.source_counts = SourceCounts(plan.sample_keys)  # each micro-batch's tokens per source
        # the fused path's compiled kernel (physical/jitload.py): loaded in the background when jitstart.StartRule
        # says (steploop.py), picked up at the next call; None: the fast path in Python only
        self.jit = docs.jit
        # where the call's blocks are made (`jit.Kernel.assemble`'s `alloc`): the daemon's arena (loaderd/arena.py,
        # set by the server once its endpoint is bound), else the heap
        self.blocks: Any = None

    # The last announcement's steps (first, last) when it found every object it named done (mapped, nothing
    # to make): until the position nears its end, and while nothing is filling, there is nothing to announce.
    _settled: tuple[int, int] | None = None

    def _prefetch(self, state: DataState, steps: int = PREFETCH_STEPS) -> None:
        """Announce about the next `steps` steps' documents (per lane and source) to the workers:
        their objects start, and records far beyond an object's fill are tokenized out of order.

        Skipped when every source is pre-tokenized: a shard opens in microseconds
        (memory map), and computing upcoming refs would cost more than it saves;
        likewise while every object of the corpus is done (`DocSource.all_done`:
        tokens cached and mapped, no RESTORE sweep pending).
        Once an announcement found every object it named done (`DocSource.prefetch`
        returns True: tokens in the node cache, mapped), the next one first tries
        a window `SETTLED_HORIZON` times as far, taken only if every object of it
        is done too (it starts nothing: on the fly the fills stay as near as
        before); then none is made until the position comes within `steps` of
        that window's end, or some object is filling (a RESTORE's stale fill,
        another replica's object). So an object of the next `steps` steps still
        starts before it is needed, and a RESTORE's stale work is still dropped
        while there is any.
        """
        if not self._decodes or self.docs.all_done():  # every object's tokens mapped
            return
        at, settled = state.step, self._settled
        if settled is not None:
            if settled[0] <= at and at + steps <= settled[1] and not self.docs.filling:
                return
            far = steps * SETTLED_HORIZON
            wide = upcoming_columns(self.plan, state, self.lanes, (int(self.docs_per_step) + 2) * far)
            if self.docs.prefetch(wide, only_if_settled=True) is True:
                self._settled = (at, at + far)
                return
        # Need order: every lane's next document, then every lane's one after (a step takes from all lanes),
        # as arrays (logical/upcoming.py): no Python per document.
        done = self.docs.prefetch(upcoming_columns(self.plan, state, self.lanes, (int(self.docs_per_step) + 2) * steps))
        self._settled = (at, at + steps) if done is True else None

    def produce_step(self, state: DataState) -> tuple[StepEntry, DataState | None]:
        """Step `state.step + 1` of this replica: its micro-batches and the state after it.

        Never raises for data problems: end of stream, a `fail` source, an
        unreadable object and bugs become a terminal StepEntry (error code,
        message naming the step), with None as the state. Its documents are
        copied from verified bytes: a step whose cached files changed while it
        was made is made again (`DocSource.check_reads`).
        """
        for attempt in range(VERIFY_TRIES):
            if attempt:  # (a file that changes for a moment, e.g. an object settling, is given time: 1, 4, 16 ms)
                time.sleep(0.001 * 4 ** (attempt - 1))
            self.docs.begin_reads()
            made = self._produce_step_once(state)
            if self.docs.check_reads():
                if self._metrics is not None and made[0].error is None:  # (once a step, not once a try)
                    self._metrics.steps.inc()
                    self._metrics.steps_by_path["plan"].inc()
                return made
        step = state.step + 1
        return terminal(step, errorcodes.E_OBJECT, f"step {step}: cached objects it reads kept changing after they "
                        f"were verified ({VERIFY_TRIES} tries); see the daemon's log for the objects"), None

    def _produce_step_once(self, state: DataState) -> tuple[StepEntry, DataState | None]:
        step = state.step + 1
        t0 = time.perf_counter()
        before = self.docs.calls
        try:
            self._prefetch(state)
            batch, new_state = self.plan.step(state, self.docs, self.lanes)
            mbs = self.plan.replica_micro_batches(batch, self.replicas, self.replica)
        except EndOfStream as exc:
            return terminal(step, errorcodes.E_END, f"step {step}: end of stream ({exc})"), None
        except ExhaustedError as exc:
            return terminal(step, errorcodes.E_EXHAUSTED, f"step {step}: {exc}"), None
        except Stopping as exc:  # the daemon stops (SIGTERM): no object is at fault, nobody waits for this
            return terminal(step, errorcodes.E_SHUTTING_DOWN, f"step {step}: {exc}"), None
        except SluiceError as exc:
            obj = exc.object_location if isinstance(exc, ObjectReadError) else None
            log.error("step failed", extra={"step": step, "replica": self.replica, "error": str(exc)})
            if self._metrics is not None:
                self._metrics.object_errors.inc()
            return terminal(step, errorcodes.E_OBJECT, f"step {step}: {exc}", object=obj), None
        except Exception as exc:  # a bug: report it to the client instead of dying silently
            log.exception("internal error producing step %d", step)
            return terminal(step, errorcodes.E_INTERNAL, f"step {step}: bug in sluice: {exc!r}"), None
        n_docs = self.docs.calls - before
        self.docs_per_step = 0.8 * self.docs_per_step + 0.2 * max(1.0, n_docs / max(1, len(self.lanes)))
        return self._entry(step, mbs, new_state, t0), new_state

    def produce_steps(self, state: DataState, n: int) -> list[tuple[StepEntry, DataState | None]]:
        """Up to `n` consecutive steps after `state`, each as `produce_step` makes it (at least one).

        The fast path (`fast.fast_steps`: every lane and step of the call at
        once, the entries cut from its block) computes them; where it stands
        aside, or raises (logged, counted as ``error``), one step is made by
        `produce_step` (`Plan.step`: its terminal entry where the stream ends or
        fails there), the reason counted. One step while some object is still
        being filled: then a step may wait for its documents, and a call of
        several would hold a RESTORE back for all of their waits (measured: on
        the fly, restore on a running daemon 0.075-0.155 s against
        0.018-0.051 s with one step per call).
        """
        entries, states = self._produce(state, n, every=True)
        return list(zip(entries, states))

    def produce_run(self, state: DataState, n: int) -> tuple[list[StepEntry], DataState | None]:
        """`produce_steps`' entries, with only the state after the last of them (None: the one entry is a
        terminal error): what a producer loop keeps. The fast path then makes one `DataState` a call instead
        of one a step (each step's entry carries its state as JSON already)."""
        entries, states = self._produce(state, n, every=False)
        return entries, states[-1]

    def _produce(self, state: DataState, n: int, every: bool) -> tuple[list[StepEntry], list[DataState | None]]:
        """The entries of `produce_steps` and the states after them (all of them where `every`, else at least
        the last). A terminal entry comes alone.

        Counts the steps each path served (`Metrics.steps_by_path`) and, where
        the fast path did not serve them, why (`Metrics.fallbacks`: the reason
        `fast_steps` gave, or the producer's own: objects being made from text,
        a call that raised), once a call. Objects only fetched or mapped do not
        send a call to `Plan.step`: the fast path waits for those it reads
        (`DocSource.mapped`), as `Plan.step` would."""
        if n < 1 or self.docs.making:
            return self._single(state, STATE if n < 1 else FILLING)
        t0 = time.perf_counter()
        before = self.docs.calls
        for _ in range(VERIFY_TRIES):  # made again while a cached file it read changed meanwhile (check_reads)
            self.docs.begin_reads()
            try:
                self._prefetch(state, n - 1 + PREFETCH_STEPS)  # as far past the call's last step as one step looks
                kernel = self._kernel()
                fast = fast_steps(self.plan, state, self.docs, self.lanes, n, kernel)
                if isinstance(fast, str):
                    return self._single(state, fast)
                entries = []
                for j in range(len(fast.state_dicts)):
                    give_way()  # (a call's entries are ~0.2 ms of Python: giveway.py)
                    entries.append(self._fused_entry(fast, j, t0))
            except Exception:  # a bug: said once in the log with its traceback; the step is made by Plan.step
                log.exception("fast path failed at step %d (replica %d); this step is made by Plan.step",
                              state.step + 1, self.replica)
                return self._single(state, ERROR)
            if self.docs.check_reads():
                self._count_docs(before, len(entries), "fused-kernel")
                return entries, fast.states if every else [fast.state(len(entries) - 1)]
        return self._single(state, ERROR)

    def _kernel(self) -> Any:
        """The compiled kernel for this call, or None. A loader (`jitload.KernelLoader`) whose load of the module
        compiled ahead of time is in flight (started after the run's first call) is waited for a few ms: else
        this call's step would be `Plan.step`'s too. A stand-in's face (tests, benches) is read as it is."""
        jit = self.jit
        if jit is None:
            return None
        arriving = getattr(jit, "arriving", None)
        kernel = jit.kernel if arriving is None else arriving()
        return kernel if kernel is None or self.blocks is None else Blocks(kernel, self.blocks)

    def _single(self, state: DataState, reason: str) -> tuple[list[StepEntry], list[DataState | None]]:
        """One step by `produce_step` (counted there, path ``plan``), the fast path having stood aside for
        `reason` (counted here unless the step ended the stream)."""
        entry, after = self.produce_step(state)
        if self._metrics is not None and entry.error is None:
            self._fallback(reason, 1)
        return [entry], [after]

    def _fallback(self, reason: str, steps: int) -> None:
        fallbacks = self._metrics.fallbacks
        child = fallbacks.get(reason)
        if child is None:  # (a reason not bound at start: bound now, once)
            child = fallbacks[reason] = self._metrics.fallback_family.labels(*self._metrics.label_values, reason)
        child.inc(steps)

    def _count_docs(self, before: int, steps: int, path: str) -> None:
        """Update the documents-per-step estimate (prefetch) from the documents handed out since `before`, and
        count the `steps` made in the metrics, by `path`; once a call."""
        if self._metrics is not None:
            self._metrics.steps.inc(steps)
            self._metrics.steps_by_path[path].inc(steps)
        n_docs = self.docs.calls - before
        per = max(1.0, n_docs / max(1, len(self.lanes) * steps))
        self.docs_per_step = 0.8 * self.docs_per_step + 0.2 * per

    def _fused_entry(self, fused: FusedSteps, j: int, t0: float) -> StepEntry:
        """`_entry` of step j of a `fused_steps` call: the replica's micro-batches are row ranges of the step's
        block (the lanes are this replica's, in order), their cu_seqlens, pieces and tokens per source from the
        kernel's arrays (concat's made for every micro-batch of the call at once: `FusedSteps.unit`; best-fit's
        from its rows: `BinRows.micro_owners`, `row_tokens`), their sample IDs only when read (`StepEntry.samples`:
        formatting them was ~1/10 of a step), the derived arrays (sluice/batcharrays.py) from the rows' segments."""
        block, bins = fused.block[j], fused.packed
        rows = block.shape[1]
        per = min(self.plan.spec.micro_batch, rows)  # (the run spec makes micro_batch divide the replica's rows)
        micros: list[dict[str, np.ndarray]] = []
        owned, counted, nbytes = [], [], block.nbytes
        for r0 in range(0, rows, per):
            r1 = r0 + per
            if bins is None:
                cu, owners, tokens = fused.unit((j * rows + r0) // per, per * fused.L)
            else:
                cu, owners = bins.micro_owners(j, r0, r1)
                tokens = fused.row_tokens[j * rows + r0:j * rows + r1].sum(axis=0).tolist()  # type: ignore[index]
            micros.append(batcharrays.packer_micro(block if per == rows else block[:, r0:r1], cu))
            owned.append(owners)
            counted.append(self.source_counts.of_tokens(tokens))
            nbytes += cu.nbytes
            if batcharrays.DERIVED:
                nbytes += batcharrays.complete(micros[-1], fused.segments(j, r0, r1))
        sids = fused.sample_ids if bins is None else bins.sample_ids
        samples = LazySamples(lambda: [_first_seen(sids(), o) for o in owned])
        # (the fused states hold exactly this replica's lanes: their state dict is the entry's)
        return self._finish(fused.first + j, micros, samples, nbytes, _state_of(fused, j), t0, counted)

    def _entry(self, step: int, mbs: list[Any], new_state: DataState, t0: float) -> StepEntry:
        micros, samples, nbytes = [], [], 0
        for mb in mbs:
            arrays = {k: np.ascontiguousarray(v, dtype=batcharrays.BY_NAME[k].dtype) for k, v in mb.arrays().items()}
            nbytes += sum(a.nbytes for a in arrays.values()) + batcharrays.complete(arrays, mb.segments)
            micros.append(arrays)
            samples.append(list(mb.samples))
        counted = [self.source_counts.of_segments(mb.segments) for mb in mbs]
        return self._finish(step, micros, samples, nbytes, new_state.subset(self.lanes).state_dict(), t0, counted)

    def _finish(self, step: int, micros: list[dict[str, np.ndarray]], samples: list[list[str]] | LazySamples,
                nbytes: int, state: dict[str, Any] | LazyState, t0: float, counted: list[Counts]) -> StepEntry:
        """The StepEntry of a computed step, its state JSON encoded (the caller counts it in the metrics);
        `counted`: each micro-batch's tokens per source (`SourceCounts`)."""
        entry = StepEntry(
            step=step,
            micros=micros,
            samples=samples,
            state=state,
            nbytes=nbytes,
            created=time.monotonic(),
            delivered=[set() for _ in micros],
            source_tokens=counted,
        ).encode_json()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step produced", extra={"step": step, "replica": self.replica,
                                              "seconds": round(time.perf_counter() - t0, 6)})
        return entry


def _state_of(fused: FusedSteps, j: int) -> dict[str, Any] | LazyState:
    """Step j's data state for its entry: the kernel's JSON as it is (`LazyState`: decoded only where read),
    else the dict a `FusedSteps` holds (one made with plain dicts)."""
    states = fused.state_dicts
    return LazyState(states.texts[j]) if type(states) is StateTexts else states[j]


def _first_seen(sids: list[str | None], owners: np.ndarray) -> list[str]:
    """The sample IDs of pieces owned by `owners` (entries, in order), each once, in order of first appearance."""
    return list(dict.fromkeys([sids[o] for o in dict.fromkeys(owners.tolist())]))  # type: ignore[misc]


def terminal(step: int, code: str, message: str, **extra: Any) -> StepEntry:
    """A StepEntry that ends the replica's stream at `step` with an error (extra: body fields, None dropped)."""
    return StepEntry(step=step, micros=[], samples=[], state=None, nbytes=0, created=time.monotonic(),
                     error=(code, message, {k: v for k, v in extra.items() if v is not None}))
