"""The `DocTokens` callback of the logical plane: cache fetch + decode + tokenize.

The unit of work is one object (a jsonl/parquet/tar file or a `.sltok` shard):
a worker fetches it through the node cache (digest-verified), decodes all its
texts and tokenizes them in one `encode_batch` call, and the result lands in a
bounded LRU of decoded objects keyed by (source, object index). The packer
asks for one document at a time (`__call__(ref)`); it blocks only if the
object is not decoded yet.

    prefetch(refs)  ->  one work item per distinct object, tagged (lane, seq) by
                        the order the plan will need them; submitted to the pool
    __call__(ref)   ->  LRU hit, or wait for the in-flight future, or decode now

Bounds and policies:

* Decoded objects: at most `budget_bytes` of token arrays. Least recently used
  objects are dropped when a new one is published; an object that is dropped
  and needed again is decoded again (slower, never different).
* In-flight work: at most `max_inflight` objects; further prefetch requests are
  ignored (the packer will ask again when it needs them).
* Pre-tokenized shards are memory-mapped; the node cache pin is held while the
  shard is in the LRU, so the cache cannot evict bytes we are reading.

Workers are threads: `tokenizers` releases the GIL in `encode_batch` and
parallelises internally, zstd/pyarrow decode release it too; docs/loaderd.md
has the measurement behind this choice.

Errors: a corrupt or missing object (after the cache's retries and quarantine)
raises `ObjectReadError`, which names the object, its source and the digest;
the pipeline turns it into an ERROR(OBJECT) reply naming the step too.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from sluice.errors import SluiceError, SourceReadError

_SHARD_COST = 64 << 10  # bytes charged per memory-mapped shard (its pages live in the page cache)


class ObjectReadError(SourceReadError):
    """An object could not be read/decoded; `object_location` names it for the wire ERROR."""

    def __init__(self, message: str, object_location: str) -> None:
        super().__init__(message)
        self.object_location = object_location


class _Decoded:
    __slots__ = ("docs", "shard", "pin", "nbytes")

    def __init__(self, docs: list[np.ndarray] | None, shard: Any, pin: Any, nbytes: int) -> None:
        self.docs = docs
        self.shard = shard
        self.pin = pin
        self.nbytes = nbytes

    def doc(self, record: int) -> np.ndarray:
        if self.shard is not None:
            return self.shard.doc(record)
        assert self.docs is not None
        return self.docs[record]

    def close(self) -> None:
        if self.pin is not None:
            self.pin.close()
            self.pin = None


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
    ) -> None:
        self.manifest = manifest
        self.cache = cache
        self.encoder = encoder
        self.budget_bytes = budget_bytes
        self.max_inflight = max_inflight
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loaderd-worker")
        # worker_kind "process": decode+tokenize of text objects runs in `workers`
        # processes (the GIL-held part, JSON/parquet decoding, then runs in parallel);
        # the threads above only wait for them. Pre-tokenized shards stay in-process.
        self._procs: Any = None
        if worker_kind == "process" and any(src.format != "tokens" for src in manifest.sources):
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            self._procs = ProcessPoolExecutor(
                max_workers=workers, mp_context=ctx, initializer=_proc_init,
                initargs=(manifest, str(cache.root), cache.budget_bytes, cache.verify_on_read))
        elif worker_kind not in ("thread", "process"):
            raise SluiceError(f"loaderd: worker kind {worker_kind!r} is not 'thread' or 'process'")
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, int], _Decoded] = OrderedDict()
        self._inflight: dict[tuple[int, int], Future[_Decoded]] = {}
        self.nbytes = 0
        self.calls = 0  # documents handed to the packer (for the prefetch estimate)
        self.hits = 0
        self.misses = 0
        needs_tokenizer = any(s.format != "tokens" for s in manifest.sources)
        if needs_tokenizer and encoder is None:
            raise SluiceError(f"manifest {manifest.name!r}: text sources need a tokenizer, none was loaded")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._procs is not None:
            self._procs.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for entry in self._lru.values():
                entry.close()
            self._lru.clear()
            self.nbytes = 0

    # -- the DocTokens callback ---------------------------------------------
    def __call__(self, ref: Any) -> np.ndarray:
        self.calls += 1
        if self._metrics is not None:  # realized share per source (documents handed to the packers)
            self._metrics.source_docs[ref.source].inc()
        return self._object(ref.source, ref.obj).doc(ref.record)

    def prefetch(self, refs: list[Any]) -> None:
        """Start decoding the objects of `refs` (in need order), within the in-flight bound."""
        seen: set[tuple[int, int]] = set()
        for ref in refs:
            key = (ref.source, ref.obj)
            if key in seen:
                continue
            seen.add(key)
            with self._lock:
                if key in self._lru or key in self._inflight:
                    continue
                if len(self._inflight) >= self.max_inflight:
                    return
                self._inflight[key] = self._pool.submit(self._work, key)

    # -- internals -------------------------------------------------------------
    def _object(self, source: int, obj: int) -> _Decoded:
        key = (source, obj)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                return entry
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = self._pool.submit(self._work, key)
            self.misses += 1
        return fut.result()

    def _work(self, key: tuple[int, int]) -> _Decoded:
        try:
            entry = self._decode(*key)
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            if self._metrics is not None:
                self._metrics.docs_inflight.set(len(self._inflight))
            self._lru[key] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.budget_bytes and len(self._lru) > 1:
                _, old = self._lru.popitem(last=False)
                self.nbytes -= old.nbytes
                old.close()  # the packer may still hold views of a shard: the mmap stays valid
            if self._metrics is not None:
                self._metrics.docs_cache_bytes.set(self.nbytes)
        return entry

    def _decode(self, s: int, o: int) -> _Decoded:
        from sluice.manifest import token_shard

        src = self.manifest.sources[s]
        obj = src.objects[o]
        where = f"source {src.name!r} object {obj.location} ({obj.digest})"
        m = self._metrics
        if src.format != "tokens":
            if self._procs is not None:
                outcome = self._procs.submit(_proc_decode, s, o).result()
            else:
                outcome = decode_texts(self.manifest, self.cache, self.encoder, s, o)
            if outcome[0] == "error":
                raise ObjectReadError(outcome[1], outcome[2])
            _, docs, t_decode, t_tokenize = outcome
            if m is not None:
                m.read_bytes.inc(obj.size)
                m.decode_seconds.inc(t_decode)
                m.tokenize_seconds.inc(t_tokenize)
                m.decoded_docs.inc(len(docs))
                m.tokens.inc(sum(d.size for d in docs))
            return _Decoded(docs, None, None, sum(d.nbytes for d in docs) + 96 * len(docs))
        try:
            pin = self.cache.fetch(obj, self.manifest.resolve(obj.location))
        except SluiceError as exc:
            raise ObjectReadError(f"{where}: {exc}", obj.location) from exc
        try:
            shard = token_shard.open_shard(pin.path)
            if shard.n_docs != obj.records:
                raise SourceReadError(f"{where}: shard holds {shard.n_docs} documents, manifest says {obj.records}")
        except SluiceError as exc:
            pin.close()
            raise ObjectReadError(f"{where}: {exc}" if where not in str(exc) else str(exc), obj.location) from exc
        except BaseException:
            pin.close()
            raise
        if m is not None:
            m.read_bytes.inc(obj.size)
        return _Decoded(None, shard, pin, _SHARD_COST)


def decode_texts(manifest: Any, cache: Any, encoder: Any, s: int, o: int) -> tuple[Any, ...]:
    """Fetch, decode and tokenize one text object.

    Returns ``("ok", docs, decode_seconds, tokenize_seconds)`` or
    ``("error", message, object_location)`` (plain values, so the outcome
    crosses a process boundary without pickling exception objects).
    """
    from sluice.manifest import formats

    src = manifest.sources[s]
    obj = src.objects[o]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    try:
        pin = cache.fetch(obj, manifest.resolve(obj.location))
    except SluiceError as exc:
        return ("error", f"{where}: {exc}", obj.location)
    try:
        t0 = time.perf_counter()
        texts = formats.read_texts(pin.path, src.format, obj.compression, src.text_field, where)
        t1 = time.perf_counter()
        if len(texts) != obj.records:
            return ("error", f"{where}: decoded {len(texts)} records, manifest says {obj.records}", obj.location)
        docs = encoder.encode_batch(texts)
        return ("ok", docs, t1 - t0, time.perf_counter() - t1)
    except SluiceError as exc:
        return ("error", str(exc) if where in str(exc) else f"{where}: {exc}", obj.location)
    finally:
        pin.close()  # decoded arrays are ours; the cache may evict the bytes now


# Worker-process state (worker_kind="process"): set once per process by _proc_init.
_PROC: tuple[Any, Any, Any] | None = None


def _proc_init(manifest: Any, cache_root: str, budget: int, verify: bool) -> None:
    global _PROC
    from sluice.cache import NodeCache
    from sluice.tokenize import encoder_for_manifest

    _PROC = (manifest, NodeCache(cache_root, budget, verify_on_read=verify, collect=False),
             encoder_for_manifest(manifest))


def _proc_decode(s: int, o: int) -> tuple[Any, ...]:
    assert _PROC is not None, "bug in sluice: worker process not initialised"
    manifest, cache, encoder = _PROC
    return decode_texts(manifest, cache, encoder, s, o)
