"""The entry table of `DocSource` (docsource.py): one entry per object in use, least recently used first.

An entry is made when its object is first needed (`_entry`: at most
`max_inflight` in progress for a prefetch) and filled by a worker (`_work`);
finished entries are charged to `budget_bytes` and dropped least recently
used first past it or past `_MAX_ENTRIES` (`_evict`). `mapped` hands the
fast path the memory-mapped shards of finished entries (starting, and
waiting for, those whose tokens are a map away), `mapped_entries`
the served-bytes scrubber its pinned ones; `drop_entry` removes an entry
whose object was found damaged. The entry's own state machine is entry.py.

`EntryTable` is one part of `DocSource` (a mixin: no state of its own); the
state it uses (`_lock`, `_lru`, `_running`, `nbytes`, `_changes`,
`_all_done`, `_pool`, `_closing`, `manifest`, `encoder`, the counters) is made
by `DocSource.__init__`.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from sluice.errors import InternalError, SluiceError, Stopping
from sluice.loaderd.physical.entry import Entry as _Entry
from sluice.tokenize.records import supports as locatable

_MAX_ENTRIES = 512  # each entry holds a descriptor (its pin): stay well below the usual 1024-file limit


class EntryTable:
    """`DocSource`'s entries by (source, object): make, find, charge, evict and drop them."""

    @property
    def filling(self) -> bool:
        """True while some object is being fetched, decoded or tokenized (a document may have to wait)."""
        with self._lock:
            return bool(self._running)

    @property
    def making(self) -> bool:
        """True while some object's tokens are being made from text (decoded and tokenized: its documents come
        as they are made, one step may wait long for them); objects only fetched or mapped do not count."""
        with self._lock:
            running = [(key, self._lru.get(key)) for key in self._running]
        return any(entry is None or not self._map_away(key[0], entry) for key, entry in running)

    def _map_away(self, source: int, entry: _Entry) -> bool:
        """Whether an entry's tokens are a fetch or a map away (a token-format object, or a jsonl or parquet
        object whose tokens the cache holds: it got no demand task), not made from text."""
        fmt = self.manifest.sources[source].format
        if fmt == "tokens":
            return True
        # (other text formats cannot tell without an index lookup: counted as made from text)
        return self.encoder is not None and locatable(fmt) and entry.demand is None

    def mapped(self, source: int, objs: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray, int]] | None:
        """Per object of `objs` (of `source`): its shard's (offsets, tokens, records), so that record r is
        ``tokens[offsets[r]:offsets[r + 1]]`` for ``r < records``, exactly what `__call__` returns for it;
        or None, and the caller asks one document at a time.

        The fast path's read (the producer thread). An object not mapped yet whose tokens are a map or a
        fetch away (held by the node cache, or a token-format object) is started and waited for, as
        `__call__` would start it and wait for its first document: no document of it can be read before
        it is mapped, so the per-document path would wait just as long (and the call's steps would leave
        the fast path: the first steps of every run did). None where some object's tokens are being made
        from text (its records are read out of order as they come: the per-document path), where one
        failed, was dropped or is kept unmapped, or while the source closes. Counts no documents: the fast
        path slices the documents it uses and `count`s them.
        """
        got = self.mapped_now(source, objs)
        if got is not None:
            return got
        for o in set(objs):
            # (bounded, as a prefetch starts objects: not counted as a hit or miss, none past `max_inflight`;
            # the walk maps the objects of the draws it locates, some past the call's steps)
            entry = self._entry((source, o), bounded=True)
            if entry is None or not self._map_away(source, entry) or not entry.wait_final():
                return None
        return self.mapped_now(source, objs)

    def mapped_now(self, source: int, objs: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray, int]] | None:
        """`mapped`, for objects mapped now only: never waits and starts nothing (the IO thread's
        `doc_length`). One lock per call, not per document."""
        shards: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        reads = self._reads.entries
        with self._lock:
            for o in set(objs):
                entry = self._lru.get((source, o))
                shard = None if entry is None else entry.shard
                if shard is None or getattr(shard, "offsets", None) is None:
                    return None  # not mapped yet (or not a plain shard)
                self._lru.move_to_end((source, o))
                reads[(source, o)] = entry
                shards[o] = (shard.offsets, shard.tokens, len(shard.offsets) - 1)
        return shards

    def mapped_entries(self) -> list[tuple[tuple[int, int], _Entry]]:
        """The finished entries that hold a pinned cached object, by (source, object), least recently used first."""
        with self._lock:
            return [(k, e) for k, e in self._lru.items() if e.done and e.pin is not None]

    def drop_entry(self, key: tuple[int, int], entry: _Entry) -> None:
        """Drop an entry whose object was found damaged: its fill stops, its readers ask again (a new entry
        fills the object anew), and nothing is served from it any more."""
        with entry.cond:
            entry.stopping = True  # a fill in progress stops at its next chunk
        with self._lock:
            if self._lru.get(key) is entry:
                del self._lru[key]
                self._changes += 1
                if key not in self._running:
                    self.nbytes -= entry.nbytes
        entry.close()

    def all_done(self) -> bool:
        """True when every object of every source has a done entry (tokens mapped, nothing to make) and the
        calling thread has neither announced records to drop nor a RESTORE's sweep pending: then any
        announcement would be settled, and the producer need not compute one (a corpus whose tokens are
        all in the node cache and fit the entry bound). One lock and no Python per object while the
        entries do not change; after a change, one pass over them."""
        me = threading.get_ident()
        with self._lock:
            if me in self._restoring or me in self._ahead or self._running or len(self._lru) != self._objects:
                return False
            changes, done = self._all_done
            if changes != self._changes:
                done = all(e.done for e in self._lru.values())
                self._all_done = (self._changes, done)
            return done

    def wait_filled(self, timeout: float) -> bool:
        """Wait until no object is being filled (its tokens are in the node cache, or it failed);
        False if some still are after `timeout` seconds. For a short run (`sluice plan`, tests)
        that should leave the tokens it started in the cache before `close` stops the fills."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._running:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _entry(self, key: tuple[int, int], *, bounded: bool) -> _Entry | None:
        """The object's entry, started now if absent (`bounded`: not past `max_inflight`, else None)."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                if not bounded:
                    self.hits += 1
                return entry
        demand = self._new_demand(key)  # (an index lookup: outside the lock)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:  # made by another thread meanwhile
                self._lru.move_to_end(key)
                if not bounded:
                    self.hits += 1
                return entry
            if self._closing.is_set():  # (checked under the lock `interrupt` sets it under)
                if bounded:
                    return None
                raise Stopping(f"loaderd: stopping; source {key[0]} object {key[1]} not started")
            if bounded and len(self._running) >= self.max_inflight:
                return None
            entry = self._lru[key] = _Entry(demand, self._ask, self._waited, where=self._where(key))
            self._changes += 1
            self._running.add(key)
            if not bounded:
                self.misses += 1
            if self._metrics is not None:
                self._metrics.docs_inflight.set(len(self._running))
        try:
            self._pool.submit(self._work, key, entry)
        except RuntimeError:  # the pool was shut down since the check above: the daemon stops
            entry.fail(Stopping(f"loaderd: stopping; source {key[0]} object {key[1]} not started"))
            with self._lock:
                self._running.discard(key)
        return entry

    def _where(self, key: tuple[int, int]) -> str:
        """Object `key` as errors and log lines name it: its source, location and digest."""
        src = self.manifest.sources[key[0]]
        obj = src.objects[key[1]]
        return f"source {src.name!r} object {obj.location} ({obj.digest})"

    def _work(self, key: tuple[int, int], entry: _Entry) -> None:
        try:
            self._fill(key, entry)
        except BaseException as exc:
            entry.fail(exc if isinstance(exc, SluiceError) else InternalError(f"{exc!r} while filling an object"))
            with self._lock:
                if self._lru.get(key) is entry:  # the next request tries again
                    del self._lru[key]
                    self._changes += 1
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._lock:
                if self._lru.get(key) in (entry, None):  # (not a new entry's: a stopped stale fill left it)
                    self._running.discard(key)
                self._changes += 1
                if self._lru.get(key) is entry:
                    self.nbytes += entry.nbytes
                self._evict()
                if self._metrics is not None:
                    self._metrics.docs_inflight.set(len(self._running))
                    self._metrics.docs_cache_bytes.set(self.nbytes)

    def _evict(self) -> None:
        """Under the lock: drop least recently used finished entries past the budget."""
        if self.nbytes <= self.budget_bytes and len(self._lru) <= _MAX_ENTRIES:
            return
        for key in list(self._lru)[:-1]:  # never the newest
            if self.nbytes <= self.budget_bytes and len(self._lru) <= _MAX_ENTRIES:
                break
            old = self._lru[key]
            if key in self._running:
                continue
            del self._lru[key]
            self._changes += 1
            self.nbytes -= old.nbytes
            old.close()
