"""The `DocTokens` callback of the logical plane: tokens from the node cache, or tokenized in chunks.

The unit of work is one object (a jsonl/parquet/tar file or a `.sltok`
shard); the unit of *availability* is a chunk of it. For a text object a
worker first asks the node cache for the object's tokens (a derived object,
`sluice.tokenize.tokcache`): on a hit it memory-maps them and no tokenizer
runs. On a miss it streams the raw object in bounded chunks (about 1 MiB of
decoded input each), encodes each chunk and appends it to the token shard the
cache will publish; a document is served as soon as its chunk is written,
read back from that file. When the object is done the cache publishes the
shard (digest recorded, counted in the cache budget, shared by every process
on the node) and the entry switches to the memory map. So a restart, a new
epoch or a second daemon on the node never tokenizes that object again.

    prefetch(refs)  ->  one work item per distinct object, in need order,
                        at most `max_inflight` objects in progress
    __call__(ref)   ->  the object's entry; waits only until *its chunk* is written

Bounds and policies:

* Memory per object in progress: one chunk of texts and its encodings
  (`chunk_bytes` of decoded input, measured ~40 bytes of peak RSS per input
  byte with `tokenizers`), whatever the object's size or compression ratio;
  a single document larger than a chunk is encoded whole.
* Entries: every finished entry is charged `_ENTRY_COST` (a map and a
  descriptor; the tokens live in the page cache), an entry whose tokens the
  node cache could not keep (budget, disk) is charged its file size: its
  unlinked spool file is held on disk. Least recently used finished entries
  are dropped past `budget_bytes` or `_MAX_ENTRIES` entries; an object dropped and needed again is read
  from the cache (or tokenized again), never different.
* Pins: an entry holds its cache pin, so the cache cannot evict bytes we map.

Workers are threads: `tokenizers` releases the GIL in `encode_batch` and
parallelises internally, zstd/pyarrow decode release it too; docs/loaderd.md
has the measurement behind this choice. With `worker_kind="process"` a
worker process tokenizes and writes the shard; the thread holds the cache's
fill lock, serves chunks as the worker reports them (`_remote`) and publishes.

Errors: a corrupt or missing object (after the cache's retries and quarantine)
raises `ObjectReadError`, which names the object, its source and the digest;
the pipeline turns it into an ERROR(OBJECT) reply naming the step too.

Why over 450 lines: an entry's life (prefetch, chunk-by-chunk availability,
the worker process hand-off, publish and the switch to the map, budget and
eviction) is one state machine guarded by one lock; its parts are private to
each other, and the tokenizing itself already lives in sluice.tokenize.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sluice.errors import InternalError, ObjectReadError, SluiceError, SourceReadError
from sluice.tokenize.tokcache import CHUNK_BYTES

_ENTRY_COST = 64 << 10  # bytes charged per mapped entry (its pages live in the page cache)
_MAX_ENTRIES = 512  # each entry holds a descriptor (its pin): stay well below the usual 1024-file limit


class _Evicted(Exception):
    """Internal: an entry whose spool file was closed by eviction; the caller asks again."""


class _Entry:
    """One object's tokens as the packer sees them: growing chunk by chunk, then mapped.

    States: pending (nothing readable) -> growing (`partial` reads documents
    [0, ready)) -> done (`shard` mapped, or `partial` complete when the cache
    did not keep the tokens) | failed (`error`). Transitions come from the one
    worker that owns the object; readers wait on `cond`.
    """

    __slots__ = ("cond", "ready", "shard", "partial", "pin", "error", "done", "nbytes")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready = 0
        self.shard: Any = None
        self.partial: Any = None
        self.pin: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.nbytes = _ENTRY_COST

    def doc(self, record: int) -> np.ndarray:
        shard = self.shard
        if shard is not None:
            return shard.doc(record)
        with self.cond:
            # Bounded by the worker: it writes the next chunk, publishes, or fails
            # (the cache's fill-lock timeout bounds a wait on another process).
            while self.shard is None:
                if self.error is not None:
                    raise self.error
                if record < self.ready:
                    if self.partial is None:  # dropped from the LRU after the caller got this entry
                        raise _Evicted()
                    return self.partial.doc(record)  # under the lock: `partial` cannot close meanwhile
                if self.done:
                    raise InternalError(f"record {record} beyond a finished object of {self.ready}")
                self.cond.wait()
            shard = self.shard
        return shard.doc(record)

    # -- transitions (the owning worker) --------------------------------------
    def start(self, reader: Any) -> None:
        with self.cond:
            self.partial = reader

    def grow(self, ready: int) -> None:
        with self.cond:
            self.ready = ready
            self.cond.notify_all()

    def publish(self, shard: Any, pin: Any) -> None:
        with self.cond:
            self.shard, self.pin, self.done = shard, pin, True
            if self.partial is not None:
                self.partial.close()
                self.partial = None
            self.cond.notify_all()

    def keep_partial(self, ready: int, nbytes: int) -> None:
        with self.cond:
            self.ready, self.done, self.nbytes = ready, True, nbytes
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error, self.done = error, True
            if self.partial is not None:
                self.partial.close()
                self.partial = None
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            if self.pin is not None:
                self.pin.close()  # the packer may still hold views of the map: it stays valid
                self.pin = None
            if self.partial is not None:
                self.partial.close()
                self.partial = None


class DocSource:
    """Thread-safe `DocTokens` implementation over a NodeCache and an Encoder."""

    def __init__(
        self,
        manifest: Any,
        cache: Any,
        encoder: Any | None,
        *,
        budget_bytes: int = 256 << 20,
        workers: int = 2,
        max_inflight: int = 8,
        metrics: Any = None,
        worker_kind: str = "thread",
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.manifest = manifest
        self.cache = cache
        self.encoder = encoder
        self.budget_bytes = budget_bytes
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loaderd-worker")
        # worker_kind "process": tokenizing text objects (and their GIL-held
        # JSON/parquet decoding) runs in `workers` processes that fill the node
        # cache; the threads above wait for them and map the result.
        self._procs: Any = None
        if worker_kind == "process" and any(src.format != "tokens" for src in manifest.sources):
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            self._procs = ProcessPoolExecutor(
                max_workers=workers, mp_context=ctx, initializer=_proc_init,
                initargs=(manifest, str(cache.root), cache.budget_bytes, cache.verify_on_read, chunk_bytes,
                          getattr(cache, "allowed_roots", None)))  # every miss checked in the workers too
        elif worker_kind not in ("thread", "process"):
            raise SluiceError(f"loaderd: worker kind {worker_kind!r} is not 'thread' or 'process'")
        self._closing = threading.Event()  # a fill in progress stops at its next chunk
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._running: set[tuple[int, int]] = set()
        self.nbytes = 0
        self.calls = 0  # documents handed to the packer (for the prefetch estimate)
        self.hits = 0
        self.misses = 0
        self.tokenized_objects = 0  # objects this DocSource tokenized (0 when the node cache had them all)
        self.cached_objects = 0  # text objects whose tokens came from the node cache
        needs_tokenizer = any(s.format != "tokens" for s in manifest.sources)
        if needs_tokenizer and encoder is None:
            raise SluiceError(f"manifest {manifest.name!r}: text sources need a tokenizer, none was loaded")

    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._procs is not None:
            self._procs.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for entry in self._lru.values():
                if not entry.done:  # its work was cancelled before it started
                    entry.fail(SluiceError("loaderd: document source closed"))
                entry.close()
            self._lru.clear()
            self.nbytes = 0

    # -- the DocTokens callback ---------------------------------------------
    def __call__(self, ref: Any) -> np.ndarray:
        self.calls += 1
        if self._metrics is not None:  # realized share per source (documents handed to the packers)
            self._metrics.source_docs[ref.source].inc()
        while True:
            entry = self._entry((ref.source, ref.obj), bounded=False)
            assert entry is not None
            try:
                return entry.doc(ref.record)
            except _Evicted:
                continue  # a new entry maps (or makes) the tokens again

    def prefetch(self, refs: list[Any]) -> None:
        """Start the objects of `refs` (in need order), within the in-flight bound."""
        seen: set[tuple[int, int]] = set()
        for ref in refs:
            key = (ref.source, ref.obj)
            if key in seen:
                continue
            seen.add(key)
            if self._entry(key, bounded=True) is None:
                return

    # -- internals -------------------------------------------------------------
    def _entry(self, key: tuple[int, int], *, bounded: bool) -> _Entry | None:
        """The object's entry, started now if absent (`bounded`: not past `max_inflight`, else None)."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                if not bounded:
                    self.hits += 1
                return entry
            if bounded and len(self._running) >= self.max_inflight:
                return None
            entry = self._lru[key] = _Entry()
            self._running.add(key)
            if not bounded:
                self.misses += 1
            if self._metrics is not None:
                self._metrics.docs_inflight.set(len(self._running))
        self._pool.submit(self._work, key, entry)
        return entry

    def _work(self, key: tuple[int, int], entry: _Entry) -> None:
        try:
            self._fill(key, entry)
        except BaseException as exc:
            entry.fail(exc if isinstance(exc, SluiceError) else InternalError(f"{exc!r} while filling an object"))
            with self._lock:
                if self._lru.get(key) is entry:  # the next request tries again
                    del self._lru[key]
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._lock:
                self._running.discard(key)
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
            self.nbytes -= old.nbytes
            old.close()

    def _fill(self, key: tuple[int, int], entry: _Entry) -> None:
        from sluice.manifest import token_shard

        s, o = key
        src = self.manifest.sources[s]
        obj = src.objects[o]
        where = f"source {src.name!r} object {obj.location} ({obj.digest})"
        if src.format != "tokens":
            self._fill_text(s, o, entry, where)
            return
        try:
            pin = self.cache.fetch(obj, self.manifest.resolve(obj.location))
        except SluiceError as exc:
            raise ObjectReadError(f"{where}: {exc}", obj.location) from exc
        shard = _open(token_shard, pin, obj.records, where, obj.location)
        if self._metrics is not None:
            self._metrics.read_bytes.inc(obj.size)
        entry.publish(shard, pin)

    def _fill_text(self, s: int, o: int, entry: _Entry, where: str) -> None:
        from sluice.manifest import token_shard
        from sluice.tokenize.tokcache import fill_tokens, lookup_tokens

        obj = self.manifest.sources[s].objects[o]
        try:
            pin = lookup_tokens(self.cache, self.manifest, s, o, self.encoder)
            if pin is not None:
                with self._lock:
                    self.cached_objects += 1
                entry.publish(_open(token_shard, pin, obj.records, where, obj.location), pin)
                return
            remote = self._remote(s, o, entry) if self._procs is not None else None
            got = fill_tokens(self.cache, self.manifest, s, o, self.encoder, on_start=entry.start,
                              on_chunk=entry.grow, chunk_bytes=self.chunk_bytes, cancelled=self._closing.is_set,
                              tokenize=remote)
        except ObjectReadError:
            raise
        except SluiceError as exc:
            raise ObjectReadError(str(exc) if where in str(exc) else f"{where}: {exc}", obj.location) from exc
        self._count(got.stats)
        if got.pin is None:  # made but not kept: serve the spool file, charged to our budget
            entry.keep_partial(obj.records, _ENTRY_COST + got.stats.tokens * 4)
            return
        if got.stats is None:
            with self._lock:
                self.cached_objects += 1  # another process made them while we waited for its lock
        entry.publish(_open(token_shard, got.pin, obj.records, where, obj.location), got.pin)

    def _remote(self, s: int, o: int, entry: _Entry) -> Any:
        """A `fill_tokens(tokenize=...)` body that tokenizes in a worker process.

        The worker writes the shard at the cache's temporary path and, after
        each chunk, the number of documents written into `<tmp>.ready`; this
        thread polls that count (every 5 ms) and serves the documents from the
        file meanwhile, so a document waits for its chunk, not for the object.
        A `<tmp>.cancel` file asks the worker to stop (DocSource closing).
        """
        from concurrent.futures import wait

        from sluice.manifest import token_shard
        from sluice.tokenize.pretokenize import TRANSFORM

        obj = self.manifest.sources[s].objects[o]

        def run(tmp: Any) -> tuple[Any, Any]:
            ready_path, cancel_path = f"{tmp}.ready", f"{tmp}.cancel"
            fut = self._procs.submit(_proc_tokenize, s, o, str(tmp), ready_path, cancel_path)
            reader: Any = None
            seen = 0
            try:
                while True:
                    done = bool(wait([fut], timeout=0.005).done)
                    if self._closing.is_set():
                        open(cancel_path, "wb").close()
                    count = _read_count(ready_path)
                    finished_ok = done and fut.exception() is None and fut.result()[0] == "ok"
                    if count > seen or (finished_ok and reader is None):  # an empty object has no chunk
                        if reader is None:
                            reader = token_shard.open_partial(tmp, obj.records, tokenizer=self.encoder.digest,
                                                              vocab_size=self.encoder.vocab_size, raw=obj.digest,
                                                              transform=TRANSFORM)
                            entry.start(reader)
                        seen = max(seen, count)
                        entry.grow(seen)
                    if done:
                        break
                outcome = fut.result()
            finally:
                for path in (ready_path, cancel_path):
                    _unlink(path)
            if outcome[0] == "error":
                raise ObjectReadError(outcome[1], outcome[2])
            entry.grow(obj.records)
            return reader, outcome[1]

        return run

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
        shard = token_shard.open_shard(pin.path)
        if shard.n_docs != records:
            raise SourceReadError(f"{where}: shard holds {shard.n_docs} documents, manifest says {records}")
        return shard
    except SluiceError as exc:
        pin.close()
        raise ObjectReadError(f"{where}: {exc}" if where not in str(exc) else str(exc), location) from exc
    except BaseException:
        pin.close()
        raise


# Worker-process state (worker_kind="process"): set once per process by _proc_init.
_PROC: tuple[Any, Any, Any, int] | None = None


def _proc_init(manifest: Any, cache_root: str, budget: int, verify: bool, chunk_bytes: int, roots: Any = None) -> None:
    global _PROC
    from sluice.cache import NodeCache
    from sluice.tokenize import encoder_for_manifest

    _PROC = (manifest, NodeCache(cache_root, budget, verify_on_read=verify, collect=False, allowed_roots=roots),
             encoder_for_manifest(manifest), chunk_bytes)


def _proc_tokenize(s: int, o: int, tmp: str, ready_path: str, cancel_path: str) -> tuple[Any, ...]:
    """Write the object's token shard at `tmp` in this worker process, counting documents in `ready_path`.

    Returns ``("ok", FillStats)`` or ``("error", message, object_location)``
    (plain values: no exception objects cross the process boundary).
    """
    import os
    import struct
    from pathlib import Path

    from sluice.tokenize.tokcache import tokenize_into

    assert _PROC is not None, "bug in sluice: worker process not initialised"
    manifest, cache, encoder, chunk_bytes = _PROC
    src = manifest.sources[s]
    obj = src.objects[o]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    fd = os.open(ready_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        reader, stats = tokenize_into(Path(tmp), manifest, cache, encoder, s, o, chunk_bytes=chunk_bytes,
                                      on_chunk=lambda n: os.pwrite(fd, struct.pack("<Q", n), 0),
                                      cancelled=lambda: os.path.exists(cancel_path))
        reader.close()
    except SluiceError as exc:
        return ("error", str(exc) if where in str(exc) else f"{where}: {exc}", obj.location)
    finally:
        os.close(fd)
    return ("ok", stats)


def _read_count(path: str) -> int:
    """The document count a worker wrote at `path` (0 if none yet; an 8-byte write is never seen torn)."""
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read(8)
    except OSError:
        return 0
    return struct.unpack("<Q", data)[0] if len(data) == 8 else 0


def _unlink(path: str) -> None:
    import os

    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
