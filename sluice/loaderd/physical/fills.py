"""The fills of `DocSource` (docsource.py): an object's tokens mapped from the node cache, or made in order.

A token shard is fetched and mapped; a text object's tokens are looked up
in the node cache and mapped on a hit, else tokenized chunk by chunk (here or
in a fill worker process: `_remote`) and published; the raw object's pin is
fetched once per entry for the fill and the demand task (`_raw_pin`, which
makes or loads its line index). What was mapped is verified first
(`_open_verified`): changed bytes are quarantined and fetched again, at most
`_VERIFY_TRIES` times. The module docstring of docsource.py has the bounds.

`Fills` is one part of `DocSource` (a mixin: no state of its own); the state
it uses (`manifest`, `cache`, `encoder`, `_lock`, `_procs`, `served`, the
counters) is made by `DocSource.__init__`.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.errors import (ChunkDamaged, ObjectReadError, SluiceError, SourceReadError, TokenizerWorkerError)
from sluice.loaderd.physical.demand import FillEncoder, FillPace
from sluice.loaderd.physical.entry import ENTRY_COST
from sluice.loaderd.physical.entry import Entry as _Entry
from sluice.loaderd.physical.fillprocs import read_count, worker_fill

_VERIFY_TRIES = 3  # a map whose verified bytes changed again at once: fetched again at most this often

log = logging.getLogger("sluice.loaderd")


class Fills:
    """`DocSource`'s fills: map or make an entry's tokens, and the raw object's pin they share."""

    def _fill(self, key: tuple[int, int], entry: _Entry) -> None:
        from sluice.manifest import token_shard

        s, o = key
        src = self.manifest.sources[s]
        obj = src.objects[o]
        where = self._where(key)
        if src.format != "tokens":
            self._fill_text(s, o, entry, where)
            return
        for _ in range(_VERIFY_TRIES):
            try:
                pin = self.cache.fetch(obj, self.manifest.resolve(obj.location))
            except SluiceError as exc:
                raise ObjectReadError(f"{where}: {exc}", obj.location) from exc
            shard = self._open_verified(token_shard, key, pin, obj, where)
            if shard is not None:
                break
        else:
            raise ObjectReadError(f"{where}: its cached bytes changed after each of {_VERIFY_TRIES} fills",
                                  obj.location)
        if self._metrics is not None:
            self._metrics.read_bytes.inc(obj.size)
        entry.publish(shard, pin)

    def _fill_text(self, s: int, o: int, entry: _Entry, where: str) -> None:
        from sluice.manifest import token_shard
        from sluice.tokenize.tokcache import fill_tokens, lookup_tokens

        obj = self.manifest.sources[s].objects[o]
        try:
            for _ in range(_VERIFY_TRIES):  # (a damaged copy is quarantined: the next lookup finds none)
                pin = lookup_tokens(self.cache, self.manifest, s, o, self.encoder)
                if pin is None:
                    load_soon = getattr(self.encoder, "load_soon", None)  # a DeferredEncoder: parse it meanwhile
                    if load_soon is not None:
                        load_soon()
                    break
                shard = self._open_verified(token_shard, (s, o), pin, obj, where)
                if shard is not None:
                    with self._lock:
                        self.cached_objects += 1
                    entry.publish(shard, pin)
                    return
            remote = self._remote(s, o, entry) if self._procs is not None else None
            if remote is not None and entry.demand is not None:
                # The raw fill here, once, for the demand task (with its line index): the worker
                # process then finds the raw object cached instead of racing us to fill it.
                self._raw_pin(entry, (s, o), obj)
            # Documents the demand path made are written as they are, not tokenized again (demand.py).
            enc = FillEncoder(self.encoder, entry) if entry.demand is not None and remote is None else self.encoder
            pace = FillPace(getattr(self.encoder, "backend", "hf"))
            got = fill_tokens(self.cache, self.manifest, s, o, enc, on_start=entry.start,
                              on_chunk=entry.grow, chunk_bytes=self.chunk_bytes,
                              cancelled=lambda: (self._stop_stale((s, o), entry) or self._between_chunks(pace)
                                                 or self._stop_stale((s, o), entry)),
                              tokenize=remote, raw=self._raw_pin(entry, (s, o), obj) if remote is None else None,
                              memory_bytes=self.budget_bytes)
        except ChunkDamaged as exc:  # the raw object changed after verification while it was tokenized
            raw = entry.raw
            if raw is not None and raw.kind == "raw":
                self.served.report((s, o), raw, exc)
            with entry.cond:
                entry.stopping = True  # its readers ask again: a new entry fetches the object anew
            raise ObjectReadError(f"{where}: {exc}" if where not in str(exc) else str(exc), obj.location) from exc
        except ObjectReadError:
            raise
        except SluiceError as exc:
            raise ObjectReadError(str(exc) if where in str(exc) else f"{where}: {exc}", obj.location) from exc
        self._count(got.stats)
        if isinstance(enc, FillEncoder) and enc.reused:
            with self._lock:
                self.fill_reused_docs += enc.reused
            if self._metrics is not None:
                self._metrics.fill_reused_docs.inc(enc.reused)
        if got.pin is None:  # made but not kept: serve the spool file or memory, charged to our budget
            self._note(got.held, (s, o), got.note)
            entry.keep_partial(obj.records, ENTRY_COST + got.stats.tokens * 4)
            return
        if got.stats is None:
            with self._lock:
                self.cached_objects += 1  # another process made them while we waited for its lock
        shard = self._open_verified(token_shard, (s, o), got.pin, obj, where)
        if shard is None:
            raise ObjectReadError(f"{where}: its tokens changed in the node cache as soon as they were made",
                                  obj.location)
        entry.publish(shard, got.pin)

    def _open_verified(self, token_shard: Any, key: tuple[int, int], pin: Any, obj: Any, where: str) -> Any:
        """The pinned shard mapped after its chunks were verified (a no-op when the cache's verify-on-read just
        did), or None when they no longer match: then it is quarantined and the pin closed."""
        try:
            pin.guard().ensure()
        except ChunkDamaged as exc:
            self.served.report(key, pin, exc)
            pin.close()
            return None
        except BaseException:
            pin.close()
            raise
        return _open(token_shard, pin, obj.records, where, obj.location)

    def _remote(self, s: int, o: int, entry: _Entry) -> Any:
        """A `fill_tokens(tokenize=...)` body that tokenizes in a worker process.

        The worker writes the shard at the cache's temporary path and, after
        each chunk, the number of documents written into `<tmp>.ready`; this
        thread polls that count (every 5 ms) and serves the documents from the
        file meanwhile, so a document waits for its chunk, not for the object.
        A `<tmp>.cancel` file asks the worker to stop (DocSource closing).
        A worker that dies is replaced (fillprocs.py) and the object tried
        again, once, if none of its documents was read yet (a rewrite of a
        file being read could change what was served); otherwise the fill
        fails with TokenizerWorkerError naming the object.
        """
        from concurrent.futures import wait
        from concurrent.futures.process import BrokenProcessPool

        from sluice.manifest import token_shard
        from sluice.tokenize.encoder import TRANSFORM

        obj = self.manifest.sources[s].objects[o]

        def run(tmp: Any) -> tuple[Any, Any]:
            ready_path, cancel_path = f"{tmp}.ready", f"{tmp}.cancel"
            got: dict[str, Any] = {"reader": None, "seen": 0}  # the partial shard once opened, documents seen
            try:
                for attempt in (1, 2):
                    ex, fut = self._procs.submit(worker_fill, s, o, str(tmp), ready_path, cancel_path)
                    follow(fut, tmp, ready_path, cancel_path, got)
                    if not isinstance(fut.exception(), BrokenProcessPool):
                        break
                    self._procs.replace(ex)
                    if got["reader"] is not None or attempt == 2:
                        raise TokenizerWorkerError(
                            f"a fill worker process died (killed or crashed) while tokenizing source "
                            f"{self.manifest.sources[s].name!r} object {obj.location} ({obj.digest}); "
                            f"{got['seen']} of its {obj.records} documents were written; tried {attempt} "
                            f"time(s)") from fut.exception()
                    _unlink(str(tmp))  # the dead worker's start of it (no reader has it open): written anew
                outcome = fut.result()
            finally:
                for path in (ready_path, cancel_path):
                    _unlink(path)
            if outcome[0] == "error":
                raise ObjectReadError(outcome[1], outcome[2])
            entry.grow(obj.records)
            return got["reader"], outcome[1]

        def follow(fut: Any, tmp: Any, ready_path: str, cancel_path: str, got: dict[str, Any]) -> None:
            """Poll the worker's count (every 5 ms) until `fut` is done; open the partial shard at its first chunk."""
            while True:
                done = bool(wait([fut], timeout=0.005).done)
                if self._closing.is_set() or self._stop_stale((s, o), entry):
                    open(cancel_path, "wb").close()
                count = read_count(ready_path)
                finished_ok = done and fut.exception() is None and fut.result()[0] == "ok"
                if count > got["seen"] or (finished_ok and got["reader"] is None):  # an empty object has no chunk
                    if got["reader"] is None:
                        got["reader"] = token_shard.open_partial(tmp, obj.records, tokenizer=self.encoder.digest,
                                                                 vocab_size=self.encoder.vocab_size, raw=obj.digest,
                                                                 transform=TRANSFORM)
                        entry.start(got["reader"])
                    got["seen"] = max(got["seen"], count)
                    entry.grow(got["seen"])
                if done:
                    return

        return run

    def _raw_pin(self, entry: _Entry, key: tuple[int, int], obj: Any) -> Any:
        """The raw object's pin, fetched once per entry for its fill and its demand task (a second
        fetch would hash a cached object again under verify_on_read); the entry closes it when settled.
        For a plain jsonl object to be located out of order, its line index comes from the fill (then
        stored in the node cache) or, on a hit, from the node cache (lineindexes.py)."""
        made = None
        with entry.raw_lock:
            if entry.raw is None:
                indexer = self._line_indexer(entry, obj)
                try:
                    pin = self.cache.fetch(obj, self.manifest.resolve(obj.location),
                                           observe=None if indexer is None else indexer.feed)
                finally:
                    if indexer is not None:
                        indexer.close()  # (its thread; `finish` below uses what it indexed)
                if indexer is not None:  # the fill returned: its bytes matched obj.digest
                    try:
                        made = indexer.finish(obj.digest, obj.size)  # None on a hit: no fill seen
                        self.line_indexes.keep(made)
                        if made is None and self.line_indexes.get(obj.digest) is None and \
                                self.line_indexes.load(obj, str(pin.path)) is None:
                            # cached without one (`sluice cache warm`, an older version): the locator
                            # counts now; the next daemon loads the one made here, off the serving path
                            self.line_indexes.build_later(obj, str(pin.path))
                    except BaseException:
                        pin.close()
                        raise
                try:  # verified before anything reads it: the demand task tokenizes it in place, and a
                    # step's check (served.py) then finds it unchanged instead of verifying it first
                    pin.guard().ensure()  # (a no-op after verify-on-read; the fill's tokenizer reuses it)
                except ChunkDamaged as exc:  # quarantined: the next fetch fills it anew
                    self.served.report(key, pin, exc)
                    pin.close()
                    raise
                except BaseException:
                    pin.close()
                    raise
                with entry.cond:
                    if entry.done or entry.closed:  # settled meanwhile: nobody else would close it
                        pin.close()
                        raise SluiceError(f"object {obj.location}: its entry was settled while fetching it")
                    entry.raw = pin
            raw = entry.raw
        if made is not None:  # (outside the raw lock: the demand task can locate meanwhile)
            self.line_indexes.store(made)
        return raw

    def _line_indexer(self, entry: _Entry, obj: Any) -> Any:
        """A (staged) line indexer for the raw fill of a plain jsonl object whose records may be located out of
        order (its tokens are not cached), else None: the demand task then counts no line again."""
        from sluice.tokenize.lineindex import StagedIndexer

        demand = entry.demand
        if demand is None or obj.compression != "none" or self.manifest.sources[demand.key[0]].format != "jsonl":
            return None
        return StagedIndexer()

    def _note(self, kind: str, key: tuple[int, int], message: str) -> None:
        """Count a fall-back of object `key` ("memory" / "spool": tokens not kept by the node cache;
        "out_of_order": its out-of-order reading stopped) and log the object's first one of each kind."""
        with self._lock:
            first = (kind, key) not in self._noted
            self._noted.add((kind, key))
            if kind != "out_of_order":
                self.not_kept[kind] += 1
        m = self._metrics
        if m is not None:
            (m.out_of_order_stopped if kind == "out_of_order" else m.tokens_not_kept[kind]).inc()
        if first:
            log.warning("%s", message, extra={"object": self.manifest.sources[key[0]].objects[key[1]].location,
                                              "fallback": kind})

    def _count(self, stats: Any) -> None:
        if stats is None:
            return
        with self._lock:
            self.tokenized_objects += 1
        m = self._metrics
        if m is not None:
            m.read_bytes.inc(stats.raw_bytes)
            m.decode_seconds.inc(stats.decode_seconds)
            m.tokenize_seconds.inc(stats.tokenize_seconds)
            m.decoded_docs.inc(stats.documents)
            m.tokens.inc(stats.tokens)


def _open(token_shard: Any, pin: Any, records: int, where: str, location: str) -> Any:
    """Map a pinned shard and check its document count; closes the pin on failure."""
    try:
        shard = token_shard.open_shard(pin.path, fd=pin.guard().fileno())  # the verified inode, not the path's
        if shard.n_docs != records:
            raise SourceReadError(f"{where}: shard holds {shard.n_docs} documents, manifest says {records}")
        return shard
    except SluiceError as exc:
        pin.close()
        raise ObjectReadError(f"{where}: {exc}" if where not in str(exc) else str(exc), location) from exc
    except BaseException:
        pin.close()
        raise


def _unlink(path: str) -> None:
    import os

    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
