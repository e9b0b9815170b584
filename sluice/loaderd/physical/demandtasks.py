"""The demand path of `DocSource` (docsource.py): records beyond an object's fill, tokenized out of order.

A record asked for (by a packer, or announced by a prefetch) beyond its
object's fill is made by a demand task: one batch at a time per object, the
objects taking turns on the demand threads (`_serve_demand`); the records are
read alone by the object's locator, or in a demand worker process
(demandpool.py), and encoded together (`_make`). Between its chunks a fill
gives way to the demand tasks (`_between_chunks`: until none ran for
`_QUIET_S`, at most `demand.YIELD_S`, paced by `demand.FillPace`). The
out-of-order state of one object is demand.py's `Demand`; the bounds are in
the module docstring of docsource.py.

`DemandTasks` is one part of `DocSource` (a mixin: no state of its own); the
state it uses (`_demands`, `_busy`, `_demanding`, `_quiet_since`, `_dpool`,
the counters, ...) is made by `DocSource.__init__`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sluice.errors import CacheError, CacheWriteError, ChunkDamaged, InternalError, ObjectReadError, SluiceError
from sluice.loaderd.physical.demand import YIELD_S, Demand, FillPace
from sluice.loaderd.physical.entry import Entry as _Entry
from sluice.tokenize.records import supports as locatable

_QUIET_S = 0.1  # a fill resumes once no demand task ran for this long


class DemandTasks:
    """`DocSource`'s demand path: start and feed the demand tasks, and the fill's pause for them."""

    def _new_demand(self, key: tuple[int, int]) -> Demand | None:
        """Out-of-order state for a text object whose tokens the node cache does not hold yet."""
        from sluice.tokenize.tokcache import lookup_tokens

        src = self.manifest.sources[key[0]]
        if src.format == "tokens" or not locatable(src.format) or self.encoder is None:
            return None
        try:
            pin = lookup_tokens(self.cache, self.manifest, key[0], key[1], self.encoder)
        except SluiceError:  # the fill meets it again and reports it
            pin = None
        if pin is not None:  # cached: the worker maps them in a moment, nothing to make
            pin.close()
            return None
        if self._dpool_workers and self._dpool is None:
            self._start_pool()
        # (a fill in a worker process never reads the spill back: no spilling then)
        return Demand(key, spill_dir=None if self._procs is not None else str(self.cache.root / "tmp"))

    def start_demand_pool(self, timeout: float = 30.0) -> bool:
        """Start the demand path's worker processes now and wait (at most `timeout` s) until they
        can take batches; False when there are none (demand_workers=0, or no locatable source)."""
        if not self._dpool_workers or self.encoder is None or \
                not any(locatable(src.format) for src in self.manifest.sources):
            return False
        self._start_pool()
        with self._dpool_lock:
            dpool = self._dpool
        if dpool is None:
            return False
        dpool.pids(timeout)
        return True

    def _start_pool(self) -> None:
        """Start the demand path's worker processes (now: they load the tokenizer while the raw
        object is fetched); `tokenizers`/tiktoken threads per worker: the cores shared out."""
        from sluice.loaderd.physical.demandpool import DemandPool

        with self._dpool_lock:  # (not self._lock: starting processes takes a while)
            if self._dpool is None and not self._closing.is_set():
                n = self._dpool_workers
                self._dpool = DemandPool(self.manifest, n, str(self.cache.root / "tmp"),
                                         threads=self._threads_each(n))

    def tokenizer_stats(self) -> dict[str, Any] | None:
        """STATS `tokenizer`: the backend serving (and the one the manifest recorded), the encoder threads of
        this process and of each demand worker process; None when no source needs a tokenizer."""
        from sluice.loaderd.physical.assemble import docs_threads

        enc = self.encoder
        if enc is None:
            return None
        ident = getattr(enc, "identity", None)
        n = self._dpool_workers
        return {"backend": enc.backend, "recorded": getattr(ident, "recorded", enc.backend),
                "threads": docs_threads(self.tokenizer_threads), "demand_workers": n,
                "demand_worker_threads": self._threads_each(n) if n else 0}

    def _threads_each(self, processes: int) -> int:
        """Encoder threads for each of `processes` worker processes: the budget (`tokenizer_threads`, else
        the CPUs this process may run on) shared out, at least 1 each."""
        from sluice.tokenize.threads import available_cpus

        total = self.tokenizer_threads if self.tokenizer_threads is not None else available_cpus()
        return max(1, total // max(1, processes))

    def _ask(self, entry: _Entry) -> None:
        """Under `entry.cond`: make sure a demand task will look at the entry's records."""
        demand = entry.demand
        if demand is None or demand.busy or self._closing.is_set():
            return
        demand.busy = True
        with self._busy:
            self._demanding += 1
        try:
            self._demands.submit(self._serve_demand, entry)
        except RuntimeError:  # shut down meanwhile (closing)
            demand.busy = False
            self._task_done()

    def _waited(self) -> None:
        """Under an entry's lock: a packer waits for the demand task to make its record."""
        with self._waited_lock:
            self.demand_waited_docs += 1
        if self._metrics is not None:
            self._metrics.demand_waited_docs.inc()

    def _task_done(self) -> None:
        with self._busy:
            self._demanding -= 1
            if not self._demanding:
                self._quiet_since = time.monotonic()
            self._busy.notify_all()

    def _between_chunks(self, pace: FillPace | None = None) -> bool:
        """The fill's pause between chunks: it gives way to demand tasks (what the packers need
        comes first) and goes on once none ran for `_QUIET_S`, or after `demand.YIELD_S` at most, so a fill
        always advances. The fill's tokens serve the next epoch, restart and daemon; the demand's serve
        the steps now. With the fill's `pace` (demand.FillPace): no pause while its chunks take under
        `demand.FREE_CHUNK_S`, else at most `demand.YIELD_CHUNKS` chunks' time. True: stop (closing)."""
        now = time.monotonic()
        if pace is None:
            return self._pause(now, YIELD_S)
        bound = pace.lap(now)
        try:
            return self._closing.is_set() if bound <= 0 else self._pause(now, bound)
        finally:
            pace.mark = time.monotonic()  # (the next chunk's time starts after the pause)

    def _pause(self, now: float, longest: float) -> bool:
        """`_between_chunks`'s wait for the demand tasks, from `now`, at most `longest` s; True: stop (closing)."""
        deadline = now + longest
        with self._busy:
            while not self._closing.is_set() and now < deadline:
                quiet = self._quiet_since + _QUIET_S - now
                if not self._demanding and quiet <= 0:
                    break
                self._busy.wait(min(deadline - now, quiet if not self._demanding else deadline - now))
                now = time.monotonic()
        return self._closing.is_set()

    def _serve_demand(self, entry: _Entry) -> None:
        """Tokenize one batch of the entry's wanted or announced records, then queue the entry's
        next turn (behind the other objects' turns: objects take turns on the demand threads)
        until none is left."""
        demand = entry.demand
        assert demand is not None
        src = self.manifest.sources[demand.key[0]]
        obj = src.objects[demand.key[1]]
        where = self._where(demand.key)
        try:
            with entry.cond:
                todo = [] if (entry.done or entry.closed or self._closing.is_set()) else demand.take(entry.ready)
                if not todo:
                    demand.busy = False
                    if entry.done or entry.closed:
                        demand.close_locator()
                        if self._dpool is not None:
                            self._dpool.forget(demand.key)
                    self._task_done()
                    return
            try:
                arrays = self._make(entry, todo, obj, src, where)
            except CacheError as exc:
                refused = isinstance(exc, CacheWriteError)
                if (demand.locator is not None or demand.served) and not refused:
                    raise
                # The raw object cannot stay pinned beside the others (cache budget), or the cache's
                # disk refused the locator's spool (a full disk): this object's records wait for its
                # in-order fill, as they would without us (what was served was the same bytes).
                if refused:
                    self._note("out_of_order", demand.key, f"{where}: out-of-order reading stopped, its records "
                               f"wait for the in-order fill: {exc}")
                with entry.cond:
                    entry.demand = None
                    demand.busy = False
                    demand.release()
                    entry.cond.notify_all()
                self._task_done()
                return
            late = spilled = dropped = 0
            with entry.cond:
                if not entry.done:
                    late, spilled, dropped = demand.park(todo, arrays, entry.ready)
                entry.cond.notify_all()
            with self._lock:
                self.demanded_docs += len(todo)
                self.demand_late_docs += late
                self.spilled_docs += spilled
                self.side_dropped_docs += dropped
            if self._metrics is not None:
                self._metrics.demanded_docs.inc(len(todo))
            try:
                self._demands.submit(self._serve_demand, entry)  # the next turn (still busy)
            except RuntimeError:  # shut down meanwhile (closing)
                with entry.cond:
                    demand.busy = False
                self._task_done()
        except BaseException as exc:
            if isinstance(exc, ObjectReadError):
                error: BaseException = exc
            elif isinstance(exc, SluiceError):
                error = ObjectReadError(str(exc) if where in str(exc) else f"{where}: {exc}", obj.location)
            else:
                error = InternalError(f"{where}: {exc!r} while tokenizing records out of order")
            with entry.cond:
                demand.busy = False
            self._task_done()
            if isinstance(exc, ChunkDamaged):  # the raw object, damaged in the cache, is quarantined (`_raw_pin`):
                self.drop_entry(demand.key, entry)  # as the fill does, its readers ask again and a new entry
            else:  # fetches it anew (failing the entry, as before, ended the step when this task saw it first)
                entry.fail(error)
            with entry.cond:
                demand.close_locator()
            if self._dpool is not None:
                self._dpool.forget(demand.key)
            if not isinstance(exc, Exception):
                raise

    def _make(self, entry: _Entry, todo: list[int], obj: Any, src: Any, where: str) -> list[np.ndarray]:
        """Tokens of records `todo` of the entry's object (opening its locator on first use)."""
        from sluice.tokenize.records import RecordLocator

        demand = entry.demand
        assert demand is not None
        # Read and encoded in the object's worker process (demandpool.py), once the workers have started
        # (until then here: the cold first batch does not wait for a process to load the tokenizer).
        if self._dpool is not None and self._dpool.ready():
            raw_path = str(self._raw_pin(entry, demand.key, obj).path)  # (its fill made the line index, if any)
            tokens: list[np.ndarray] = self._dpool.tokens(demand.key, raw_path, todo,
                                                          index=self.line_indexes.get(obj.digest), digest=obj.digest)
            return tokens
        if demand.locator is None:
            path = self._raw_pin(entry, demand.key, obj).path
            demand.locator = RecordLocator(path, src.format, obj.compression, src.text_field, where,
                                           spool_dir=str(self.cache.root / "tmp"),
                                           index=self.line_indexes.get(obj.digest), digest=obj.digest)
            if demand.locator.used_index:
                with self._lock:
                    self.indexed_objects += 1
        arrays: list[np.ndarray] = self.encoder.encode_batch(demand.locator.texts(todo))
        return arrays
