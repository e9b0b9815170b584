"""The node cache: content-addressed, digest-verified fills on an LMDB index.

Folder layout under `root` (docs/cache.md has the full contract)::

    index/               LMDB environment (see sluice/cache/index.py)
    objects/ab/<key>     published bytes; <key> = 64 hex of the cache key
    tmp/<key>.<pid>.<n>.part    fills in progress (debris if their filler died)
    locks/<key>.lock     fill locks (flock, exclusive), die with their holder
    quarantine/<key>.<ns>.bad   bytes that did not match, plus a .json note

Life of a fetch::

    fetch(obj) -> index hit? -- yes --> pin (shared flock on the file) --> CachedObject
                     | no
                     v
              fill lock (flock locks/<key>.lock; waiters poll) -> hit now? -> pin
                     | still a miss
                     v
              reserve obj.size in the budget (evict LRU, skip pinned)
                     v
              stream source -> tmp file, BLAKE3 while writing
                     | digest+size ok                   | mismatch / read error
                     v                                  v
              pin tmp, rename into objects/,      quarantine bytes, backoff + jitter,
              index entry (one LMDB txn)          retry; after the last try raise

Crash safety: the index entry is written only after the rename, and an object
file is unlinked only after its entry is gone, so a kill -9 at any moment leaves
at worst an unindexed file or a temporary file, both collected at start
(`collect_debris`). Nothing in the index points at missing or unverified bytes.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import mmap
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import blake3

from sluice.cache.index import COUNTERS, Index, IndexRecord
from sluice.cache.locks import PinResult, is_locked, lock_file, pin_file, remove_lock_file, try_exclusive
from sluice.errors import CacheError, DigestMismatch, ManifestError, SourceReadError
from sluice.manifest.canonical import canonical_bytes, digest_id
from sluice.manifest.model import ObjectRecord
from sluice.manifest.storage import S3Options, is_s3, open_input

DERIVED_KIND = "sluice.derived/1"
_DIGEST_RE = re.compile(r"b3:[0-9a-f]{64}")
_FLUSH_TOUCHES = 4096  # pending last-use updates that force a flush
_FLUSH_SECONDS = 1.0  # at most this long between flushes while hits arrive
_BUSY_SPINS = 2000  # x 1 ms: how long a reader waits for an evictor to finish

TmpOpener = Callable[[str], IO[bytes]]


def _default_open_tmp(path: str) -> IO[bytes]:
    return open(path, "xb", buffering=0)


@dataclass(frozen=True)
class CacheStats:
    """Counters of one NodeCache (this process), or cumulative over all processes.

    Counters only grow; `objects` and `bytes` are the index's current totals.
    A daemon's metrics exporter maps these fields to Prometheus series
    (`fill_seconds` -> `..._fill_seconds_total`, and so on).
    """

    hits: int = 0
    misses: int = 0
    fills: int = 0
    fill_bytes: int = 0
    fill_seconds: float = 0.0
    verify_failures: int = 0
    retries: int = 0
    evictions: int = 0
    quarantined: int = 0
    objects: int = 0
    bytes: int = 0
    budget_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CachedObject:
    """A published object, pinned while open: eviction cannot remove it.

    Use as a context manager (or call `close()`); the pin is a shared flock on
    the object's file and is released by the kernel even if the process dies.
    `path` stays valid and its bytes unchanged while the object is open.
    """

    __slots__ = ("path", "digest", "key", "size", "kind", "_fd")

    def __init__(self, *, path: str, digest: str, key: str, size: int, kind: str, fd: int) -> None:
        self.path = path
        self.digest = digest  # "b3:<hex>" of the bytes at `path`
        self.key = key  # "b3:<hex>" cache key (== digest for raw objects)
        self.size = size
        self.kind = kind
        self._fd = fd

    @property
    def pinned(self) -> bool:
        return self._fd >= 0

    def mmap(self) -> mmap.mmap:
        """A read-only memory map of the bytes (valid after `close()` too: it holds its own mapping)."""
        if self._fd < 0:
            raise CacheError(f"object {self.key}: closed; fetch it again to map it")
        if self.size == 0:
            raise CacheError(f"object {self.key}: an empty object cannot be memory-mapped")
        return mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> CachedObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the kernel drops the pin with the process anyway
            pass

    def __repr__(self) -> str:
        return f"CachedObject({self.key}, {self.size} bytes, {'pinned' if self.pinned else 'closed'})"


@dataclass(frozen=True)
class _Damaged:
    rec: IndexRecord
    reason: str
    verify: bool  # found by re-hashing (counts as a verify failure)


@dataclass(frozen=True)
class DebrisReport:
    tmp_files: int = 0
    orphan_objects: int = 0
    dropped_entries: int = 0
    stale_reservations: int = 0
    lock_files: int = 0
    quarantine_pruned: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    ok: int
    damaged: tuple[tuple[str, str], ...]  # (key, reason)
    busy: tuple[str, ...]  # keys being filled right now: not checked

    def to_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "ok": self.ok, "damaged": [list(d) for d in self.damaged],
                "busy": list(self.busy)}


def _key_hex(digest: str, where: str) -> str:
    if not (isinstance(digest, str) and _DIGEST_RE.fullmatch(digest)):
        raise CacheError(f"{where}: {digest!r} is not a digest of the form b3:<64 lowercase hex>")
    return digest[3:]


def derived_digest(key_inputs: Mapping[str, Any]) -> str:
    """Cache key ("b3:<hex>") of a derived object: BLAKE3 of its canonical inputs."""
    if "kind" in key_inputs:
        raise CacheError("derived key inputs: the field name 'kind' is reserved")
    try:
        return digest_id(canonical_bytes({"kind": DERIVED_KIND, **key_inputs}))
    except ManifestError as exc:
        raise CacheError(f"derived key inputs {dict(key_inputs)!r}: {exc}") from exc


def hash_file(path: str, chunk: int = 1 << 20) -> tuple[str, int]:
    """("b3:<hex>", size) of the file at `path`."""
    h = blake3.blake3()
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return "b3:" + h.hexdigest(), size


def _hash_fd(fd: int, chunk: int = 1 << 20) -> tuple[str, int]:
    h = blake3.blake3()
    size = 0
    offset = 0
    while data := os.pread(fd, chunk, offset):
        h.update(data)
        offset += len(data)
        size += len(data)
    return "b3:" + h.hexdigest(), size


class NodeCache:
    """A per-node, content-addressed cache of dataset objects in the folder `root`.

    Safe to use from many threads and from many processes on the same folder
    (each process opens its own LMDB environment, after any fork). `budget_bytes`
    bounds the published bytes plus the bytes reserved by fills in progress;
    least recently used unpinned objects are evicted to make room, and a fill
    that cannot fit fails with CacheError instead of overrunning the budget.

    A fill makes `1 + retries` tries; between tries it sleeps
    `min(max_backoff_s, backoff_s * 2**(try-1))` times a jitter in [0.5, 1)
    seeded by (key, pid, try). `open_tmp` opens a temporary file for writing (a
    test hook for injected write errors such as ENOSPC; every fill writes
    through it). `hash_thread` hashes on a second thread, overlapping the
    write: faster when a core is idle, slower and costlier on a busy machine.

    `durable=True` fsyncs each object and its folder before indexing it and
    syncs the index after publishing, so even a power loss cannot leave an
    entry whose bytes were not on disk. `durable=False` skips every fsync: still safe
    against process crashes and kill -9 (the kernel keeps what was written),
    not against an OS crash, after which `sluice cache verify` is due.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        budget_bytes: int,
        *,
        verify_on_read: bool = False,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        s3_options: S3Options | None = None,
        chunk_bytes: int = 1 << 20,
        lock_timeout_s: float = 600.0,
        quarantine_keep: int = 32,
        durable: bool = True,
        hash_thread: bool = False,
        open_tmp: TmpOpener | None = None,
        collect: bool = True,
    ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise CacheError(f"cache {root}: budget_bytes must be a positive integer, got {budget_bytes!r}")
        if retries < 0:
            raise CacheError(f"cache {root}: retries must be >= 0, got {retries}")
        if chunk_bytes < 4096:
            raise CacheError(f"cache {root}: chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.verify_on_read = verify_on_read
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.s3_options = s3_options
        self.chunk_bytes = chunk_bytes
        self.lock_timeout_s = lock_timeout_s
        self.quarantine_keep = quarantine_keep
        self.durable = durable
        self.hash_thread = hash_thread
        self._open_tmp = open_tmp or _default_open_tmp
        for sub in ("objects", "tmp", "locks", "quarantine"):
            try:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CacheError(f"cache {self.root}: cannot create {sub}/ ({exc.strerror})") from exc
        self._index = Index(self.root)
        self._mu = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._pending: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._touches: dict[bytes, int] = {}
        self._last_flush = time.monotonic()
        self._seq = itertools.count()
        with self._index.write() as txn:
            self._index.set_meta(txn, b"budget", budget_bytes)
        if collect:
            self.collect_debris()

    # ----------------------------------------------------------------- paths
    def _object_path(self, key: str) -> str:
        return f"{self.root}/objects/{key[:2]}/{key}"

    def _lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def _tmp_path(self, key: str) -> str:
        return f"{self.root}/tmp/{key}.{os.getpid()}.{next(self._seq)}.part"

    # -------------------------------------------------------------- counters
    def _count(self, **deltas: int) -> None:
        with self._mu:
            for name, delta in deltas.items():
                self._counts[name] += delta
                self._pending[name] += delta

    def _take_pending(self) -> tuple[dict[str, int], dict[bytes, int]]:
        with self._mu:
            pending, self._pending = self._pending, dict.fromkeys(COUNTERS, 0)
            touches, self._touches = self._touches, {}
            self._last_flush = time.monotonic()
        return pending, touches

    def _flush_into(self, txn: Any) -> None:
        pending, touches = self._take_pending()
        self._index.add_counters(txn, pending)
        self._index.touch(txn, touches)

    def flush(self) -> None:
        """Persist pending counters and last-use times (done automatically about once a second)."""
        with self._index.write() as txn:
            self._flush_into(txn)

    def _hit(self, key: str) -> None:
        with self._mu:
            self._counts["hits"] += 1
            self._pending["hits"] += 1
            self._touches[key.encode()] = time.time_ns()
            due = len(self._touches) >= _FLUSH_TOUCHES or time.monotonic() - self._last_flush > _FLUSH_SECONDS
        if due:
            self.flush()

    def stats(self, *, all_processes: bool = False) -> CacheStats:
        """This instance's counters (default), or the cumulative ones of every process.

        `all_processes=True` first persists this instance's pending counters; other
        processes' counters appear once they flush (about once a second, at each
        fill and at close).
        """
        if all_processes:
            self.flush()
        with self._index.read() as txn:
            objects = self._index.meta(txn, b"objects")
            nbytes = self._index.meta(txn, b"bytes")
            counts = self._index.counters(txn) if all_processes else None
        if counts is None:
            with self._mu:
                counts = dict(self._counts)
        return CacheStats(
            hits=counts["hits"], misses=counts["misses"], fills=counts["fills"],
            fill_bytes=counts["fill_bytes"], fill_seconds=counts["fill_us"] / 1e6,
            verify_failures=counts["verify_failures"], retries=counts["retries"],
            evictions=counts["evictions"], quarantined=counts["quarantined"],
            objects=objects, bytes=nbytes, budget_bytes=self.budget_bytes,
        )

    # --------------------------------------------------------------- lookups
    def _lookup(self, key: str) -> CachedObject | _Damaged | None:
        """A pinned hit, a damaged entry, or None (not published)."""
        kb = key.encode()
        path = self._object_path(key)
        for _ in range(_BUSY_SPINS):
            with self._index.read() as txn:
                rec = self._index.get(txn, kb)
            if rec is None:
                return None
            pin = pin_file(path, rec.size)
            if isinstance(pin, int):
                if self.verify_on_read:
                    digest, size = _hash_fd(pin, self.chunk_bytes)
                    if digest != rec.content or size != rec.size:
                        os.close(pin)
                        return _Damaged(rec, f"re-hash on read gave {digest} size {size}, expected "
                                             f"{rec.content} size {rec.size}", verify=True)
                return CachedObject(path=path, digest=rec.content, key="b3:" + key, size=rec.size,
                                    kind=rec.kind, fd=pin)
            if pin is PinResult.WRONG_SIZE:
                return _Damaged(rec, f"file {path} does not have the indexed size {rec.size}", verify=False)
            if pin is PinResult.GONE:
                with self._index.read() as txn:
                    again = self._index.get(txn, kb)
                if again == rec:  # the entry stays but its file is gone: damage, not a race
                    return _Damaged(rec, f"file {path} is missing", verify=False)
                continue
            time.sleep(0.001)  # BUSY: an evictor holds it; its entry disappears at commit
        raise CacheError(f"object b3:{key}: {path} stayed locked by an evictor for {_BUSY_SPINS} ms")

    def lookup(self, digest: str) -> CachedObject | None:
        """The pinned object for a raw digest or derived key if published (counts nothing)."""
        found = self._lookup(_key_hex(digest, "lookup"))
        return found if isinstance(found, CachedObject) else None

    # ----------------------------------------------------------------- fetch
    def fetch(self, obj: ObjectRecord, location: str) -> CachedObject:
        """The pinned local copy of `obj`, filling it from `location` on a miss.

        `location` is the already resolved source (local path or s3:// URI).
        Raises DigestMismatch (bytes never matched), SourceReadError (source
        unreadable on every try) or CacheError (budget, disk, lock); every
        message names the object's digest and location, the source, expected
        and actual digest and size, and the number of tries.
        """
        key = _key_hex(obj.digest, f"object {obj.location}")
        found = self._lookup(key)
        if isinstance(found, CachedObject):
            self._hit(key)
            return found
        self._count(misses=1)
        what = f"object {obj.digest} (manifest location {obj.location!r}, source {location!r})"
        lock = lock_file(self._lock_path(key), timeout_s=self.lock_timeout_s, what=what)
        try:
            found = self._settle(key)
            if found is not None:
                return found
            self._reserve(key, obj.size, what)
            try:
                return self._fill_tries(key, obj, location, what)
            except BaseException:
                self._unreserve(key)
                raise
        finally:
            os.close(lock)

    def _settle(self, key: str) -> CachedObject | None:
        """Under the fill lock: the object if another filler published it; drop damage."""
        found = self._lookup(key)
        if isinstance(found, _Damaged):
            self._drop_damaged(key, found)
            return None
        return found

    def _drop_damaged(self, key: str, damaged: _Damaged) -> None:
        """Under the fill lock: move a damaged object's file to quarantine, drop its entry."""
        path = self._object_path(key)
        note = {"key": "b3:" + key, "reason": damaged.reason, "source": damaged.rec.source,
                "expected_digest": damaged.rec.content, "expected_size": damaged.rec.size}
        with self._index.write() as txn:
            self._index.delete(txn, key.encode())
        if os.path.exists(path):
            self._quarantine(path, key, note)
            self._count(quarantined=1)
        if damaged.verify:
            self._count(verify_failures=1)

    def _fill_tries(self, key: str, obj: ObjectRecord, location: str, what: str) -> CachedObject:
        tries = 1 + self.retries
        failures: list[str] = []
        last: dict[str, Any] = {}
        mismatch = False
        for attempt in range(1, tries + 1):
            tmp = self._tmp_path(key)
            start = time.monotonic()
            try:
                digest, size = self._copy_source(location, tmp, obj.size, what)
            except CacheError as exc:  # the cache side failed (disk full, ...): retrying the source cannot help
                raise CacheError(f"{exc} (try {attempt} of {tries}, expected size {obj.size}; "
                                 "cache-side errors are not retried)") from exc
            except SourceReadError as exc:
                _unlink(tmp)
                failures.append(f"try {attempt}: {exc}")
                last = {"error": str(exc)}
            else:
                if digest == obj.digest and size == obj.size:
                    rec = IndexRecord(size=size, kind="raw", content=digest, source=location,
                                      filled_ns=time.time_ns())
                    return self._publish(key, tmp, rec, time.monotonic() - start)
                mismatch = True
                qpath = self._quarantine(tmp, key, {
                    "key": obj.digest, "manifest_location": obj.location, "source": location,
                    "expected_digest": obj.digest, "expected_size": obj.size,
                    "actual_digest": digest, "actual_size": size, "try": attempt})
                self._count(quarantined=1)
                failures.append(f"try {attempt}: got digest {digest} size {size} (bytes quarantined at {qpath})")
                last = {"actual_digest": digest, "actual_size": size}
            if attempt < tries:
                self._count(retries=1)
                time.sleep(self._backoff(key, attempt))
        expected = f"expected digest {obj.digest} size {obj.size}"
        if "actual_digest" in last:
            actual = f"got digest {last['actual_digest']} size {last['actual_size']}"
        else:
            actual = f"got no bytes ({last.get('error', 'unknown error')})"
        message = f"{what}: fill failed after {tries} tries: {expected}, {actual}; " + "; ".join(failures)
        exc_type = DigestMismatch if mismatch and "actual_digest" in last else SourceReadError
        err = exc_type(message)
        err.details = {"digest": obj.digest, "location": obj.location, "source": location,  # type: ignore[attr-defined]
                       "expected_digest": obj.digest, "expected_size": obj.size,
                       "actual_digest": last.get("actual_digest"), "actual_size": last.get("actual_size"),
                       "tries": tries}
        raise err

    def _backoff(self, key: str, attempt: int) -> float:
        # Jitter spreads the retries of many nodes hitting one store; it is seeded by
        # stable values so nothing in a run depends on a global random state.
        jitter = random.Random(f"{key}:{os.getpid()}:{attempt}").random()
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + 0.5 * jitter)

    def _copy_source(self, location: str, tmp: str, expected: int, what: str) -> tuple[str, int]:
        """Stream `location` into `tmp` while hashing; return (digest, size) of the source.

        One pass: read a chunk into a buffer, hash it, write it, so the digest
        is of exactly the bytes written. With `hash_thread` the hashing runs on
        a second thread over a pool of buffers, overlapping the write.
        Writes at most `expected + 1` bytes (enough to prove the size changed);
        the rest of a longer source is only hashed, so the error can say its
        real digest and size. Source failures raise SourceReadError; cache-side
        write failures (ENOSPC, ...) raise CacheError after removing `tmp`.
        """
        limit = expected + 1
        total = 0
        if is_s3(location):
            src = open_input(location, self.s3_options)
        else:  # unbuffered: each readinto is one read(2) straight into our buffer
            try:
                src = open(location, "rb", buffering=0)
            except FileNotFoundError as exc:
                raise SourceReadError(f"source {location}: no such file") from exc
            except OSError as exc:
                raise SourceReadError(f"source {location}: cannot open ({exc.strerror or exc})") from exc
        try:
            out = self._open_tmp(tmp)
        except OSError as exc:
            src.close()
            raise self._write_error(exc, tmp, what, 0) from exc
        hasher = _ThreadHasher(self.chunk_bytes) if self.hash_thread else _InlineHasher(self.chunk_bytes)
        try:
            while True:
                buf = hasher.free_buffer()
                try:
                    n = src.readinto(buf)
                except OSError as exc:
                    hasher.give_back(buf)
                    raise SourceReadError(f"source {location}: read failed after {total} bytes ({exc})") from exc
                if not n:
                    hasher.give_back(buf)
                    break
                chunk = buf[:n]
                hasher.feed(chunk, buf)
                if total < limit:
                    try:
                        _write_all(out, chunk[: limit - total])
                    except OSError as exc:
                        raise self._write_error(exc, tmp, what, total) from exc
                total += n
            try:
                if self.durable:
                    os.fsync(out.fileno())
                out.close()
            except OSError as exc:
                raise self._write_error(exc, tmp, what, total) from exc
            digest = hasher.finish()
        except BaseException:
            hasher.finish()
            out.close()
            _unlink(tmp)
            raise
        finally:
            src.close()
        return digest, total

    def _write_error(self, exc: OSError, tmp: str, what: str, written: int) -> CacheError:
        _unlink(tmp)
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        hint = "; the cache disk is full: free space or lower the budget" if exc.errno == errno.ENOSPC else ""
        return CacheError(f"{what}: writing the cache file {tmp} failed after {written} bytes "
                          f"({name}: {exc.strerror}); the partial file was removed{hint}")

    def _publish(self, key: str, tmp: str, rec: IndexRecord, seconds: float) -> CachedObject:
        """Under the fill lock: pin `tmp`, rename it into objects/, then index it."""
        pin = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(pin, fcntl.LOCK_SH)  # the pin follows the inode through the rename
            dest = self._object_path(key)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(tmp, dest)
            if self.durable:
                _fsync_dir(os.path.dirname(dest))
            self._count(fills=1, fill_bytes=rec.size, fill_us=int(seconds * 1e6))
            with self._index.write() as txn:
                self._index.put(txn, key.encode(), rec, time.time_ns())
                self._index.unreserve(txn, key.encode())
                self._flush_into(txn)
            if self.durable:
                self._index.sync()
        except BaseException:
            os.close(pin)
            _unlink(tmp)
            raise
        return CachedObject(path=dest, digest=rec.content, key="b3:" + key, size=rec.size, kind=rec.kind, fd=pin)

    # --------------------------------------------------------------- derived
    @staticmethod
    def derived_key(raw_digest: str, tokenizer_digest: str, transform_version: str) -> str:
        """Key of the object derived from `raw_digest` by a tokenizer and transform version.

        Equal to the key `put_derived` uses for
        ``{"raw": raw_digest, "tokenizer": tokenizer_digest, "transform": transform_version}``.
        """
        return derived_digest({"raw": raw_digest, "tokenizer": tokenizer_digest, "transform": transform_version})

    def get_derived(self, key_inputs: Mapping[str, Any]) -> CachedObject | None:
        """The pinned derived object for `key_inputs` if present (counted as a hit), else None.

        A miss is not counted here (`put_derived` counts it); a damaged entry is
        quarantined and dropped, so the caller then rebuilds it with `put_derived`.
        """
        key = _key_hex(derived_digest(key_inputs), "derived key")
        found = self._lookup(key)
        if isinstance(found, CachedObject):
            self._hit(key)
            return found
        if isinstance(found, _Damaged):
            lock = lock_file(self._lock_path(key), timeout_s=self.lock_timeout_s, what=f"derived object b3:{key}")
            try:
                found = self._settle(key)
            finally:
                os.close(lock)
            if found is not None:
                self._hit(key)
                return found
        return None

    def put_derived(self, key_inputs: Mapping[str, Any], producer: Callable[[Path], None]) -> CachedObject:
        """The derived object for `key_inputs`, made by `producer(tmp_path)` on a miss.

        The producer writes the whole object to the path it is given; it runs at
        most once per key across threads and processes sharing the folder. The
        index records the BLAKE3 of what it wrote, which verify-on-read checks.
        """
        key = _key_hex(derived_digest(key_inputs), "derived key")
        found = self._lookup(key)
        if isinstance(found, CachedObject):
            self._hit(key)
            return found
        self._count(misses=1)
        source = canonical_bytes({"kind": DERIVED_KIND, **key_inputs}).decode()
        what = f"derived object b3:{key} (inputs {source})"
        lock = lock_file(self._lock_path(key), timeout_s=self.lock_timeout_s, what=what)
        try:
            found = self._settle(key)
            if found is not None:
                return found
            tmp = self._tmp_path(key)
            start = time.monotonic()
            try:
                producer(Path(tmp))
                digest, size = hash_file(tmp, self.chunk_bytes)
            except FileNotFoundError as exc:
                raise CacheError(f"{what}: the producer wrote nothing to {tmp}") from exc
            except OSError as exc:
                raise self._write_error(exc, tmp, what, 0) from exc
            except BaseException:
                _unlink(tmp)
                raise
            try:
                self._reserve(key, size, what)
            except BaseException:
                _unlink(tmp)
                raise
            rec = IndexRecord(size=size, kind="derived", content=digest, source=source, filled_ns=time.time_ns())
            try:
                return self._publish(key, tmp, rec, time.monotonic() - start)
            except BaseException:
                self._unreserve(key)
                raise
        finally:
            os.close(lock)

    # ---------------------------------------------------------------- budget
    def _reserve(self, key: str, size: int, what: str) -> None:
        """Reserve `size` bytes for a fill of `key`, evicting LRU unpinned objects if needed."""
        if size > self.budget_bytes:
            raise CacheError(f"{what}: {size} bytes do not fit in the cache budget of {self.budget_bytes} bytes")
        victims: list[tuple[str, int]] = []
        try:
            with self._index.write() as txn:
                self._flush_into(txn)
                victims = self._make_room(txn, size, what, exclude=key)
                self._index.reserve(txn, key.encode(), size)
        except BaseException:
            for _, fd in victims:
                os.close(fd)
            raise
        self._unlink_victims(victims)

    def _unreserve(self, key: str) -> None:
        with self._index.write() as txn:
            self._index.unreserve(txn, key.encode())

    def _make_room(self, txn: Any, size: int, what: str, exclude: str | None) -> list[tuple[str, int]]:
        """Inside a write txn: delete entries until `size` more bytes fit; return (path, fd) to unlink.

        Each victim is held with an exclusive flock (proof that nobody pins it)
        until it is unlinked after the commit.
        """
        idx = self._index
        used = idx.meta(txn, b"bytes")
        reservations = {k: v for k, v in idx.reservations(txn).items() if k.decode() != exclude}
        reserved = sum(reservations.values())
        if used + reserved + size <= self.budget_bytes:
            return []
        for k, nbytes in reservations.items():  # a reservation whose filler died is stale
            if not is_locked(self._lock_path(k.decode())):
                idx.unreserve(txn, k)
                reserved -= nbytes
        need = used + reserved + size - self.budget_bytes
        victims: list[tuple[str, int]] = []
        pinned = 0
        if need > 0:
            for kb, _ in sorted(idx.last_use(txn).items(), key=lambda kv: (kv[1], kv[0])):
                rec = idx.get(txn, kb)
                if rec is None:
                    continue
                path = self._object_path(kb.decode())
                fd = try_exclusive(path)
                if fd is PinResult.GONE:
                    idx.delete(txn, kb)  # file already gone: the entry is wrong, drop it
                    need -= rec.size
                elif fd is None:
                    pinned += rec.size
                    continue
                else:
                    idx.delete(txn, kb)
                    victims.append((path, fd))
                    need -= rec.size
                if need <= 0:
                    break
        if need > 0:
            for _, fd in victims:
                os.close(fd)
            raise CacheError(
                f"{what}: {size} bytes do not fit in the cache budget of {self.budget_bytes} bytes: "
                f"{used} bytes published ({pinned} of them pinned by readers), {reserved} reserved by fills "
                "in progress; nothing else can be evicted"
            )
        return victims

    def _unlink_victims(self, victims: list[tuple[str, int]]) -> None:
        for path, fd in victims:
            _unlink(path)
            os.close(fd)
        if victims:
            self._count(evictions=len(victims))

    def enforce_budget(self, budget_bytes: int | None = None) -> int:
        """Evict LRU unpinned objects until the published bytes fit the budget; return evictions."""
        if budget_bytes is not None:
            self.budget_bytes = budget_bytes
        victims: list[tuple[str, int]] = []
        try:
            with self._index.write() as txn:
                self._flush_into(txn)
                self._index.set_meta(txn, b"budget", self.budget_bytes)
                victims = self._make_room(txn, 0, f"cache {self.root}", exclude=None)
        except BaseException:
            for _, fd in victims:
                os.close(fd)
            raise
        self._unlink_victims(victims)
        return len(victims)

    # ------------------------------------------------------------ quarantine
    def _quarantine(self, path: str, key: str, note: dict[str, Any]) -> str:
        """Move `path` into quarantine/ with a JSON note; keep only the newest `quarantine_keep`."""
        base = f"{self.root}/quarantine/{key}.{time.time_ns()}.{os.getpid()}.{next(self._seq)}"
        try:
            os.replace(path, base + ".bad")
            with open(base + ".json", "w", encoding="utf-8") as f:
                json.dump(note, f, sort_keys=True)
        except OSError:
            _unlink(path)  # quarantine is best effort; never keep bad bytes in objects/ or tmp/
        self._prune_quarantine()
        return base + ".bad"

    def _prune_quarantine(self) -> int:
        qdir = self.root / "quarantine"
        try:
            bad = sorted((p for p in qdir.iterdir() if p.suffix == ".bad"), key=lambda p: int(p.name.split(".")[1]))
        except OSError:
            return 0
        excess = bad[: max(0, len(bad) - self.quarantine_keep)]
        for p in excess:
            _unlink(str(p))
            _unlink(str(p.with_suffix(".json")))
        return len(excess)

    # ------------------------------------------------------------ debris, gc
    def collect_debris(self) -> DebrisReport:
        """Remove what crashed or killed fillers left behind; safe while others use the cache.

        Temporary files and reservations whose fill lock nobody holds, object
        files without an index entry, index entries whose file is missing or
        has the wrong size, unheld lock files, quarantine beyond its bound.
        """
        counts = dict.fromkeys(DebrisReport.__dataclass_fields__, 0)
        tmp_dir = self.root / "tmp"
        for p in _listdir(tmp_dir):
            key = p.name.split(".", 1)[0]
            if not is_locked(self._lock_path(key)):
                _unlink(str(p))
                counts["tmp_files"] += 1
        idx = self._index
        with idx.read() as txn:
            entries = dict(idx.items(txn))
            reservations = idx.reservations(txn)
        on_disk: set[bytes] = set()
        for sub in _listdir(self.root / "objects"):
            for p in _listdir(sub):
                kb = p.name.encode()
                on_disk.add(kb)
                if kb not in entries:
                    counts["orphan_objects"] += self._remove_orphan(p.name)
        for kb, rec in entries.items():
            key = kb.decode()
            path = self._object_path(key)
            try:
                ok = os.stat(path).st_size == rec.size
            except FileNotFoundError:
                ok = False
            if not ok:
                counts["dropped_entries"] += self._drop_if_still(key, rec)
        stale = [k for k in reservations if not is_locked(self._lock_path(k.decode()))]
        if stale:
            with idx.write() as txn:
                for k in stale:
                    idx.unreserve(txn, k)
            counts["stale_reservations"] = len(stale)
        for p in _listdir(self.root / "locks"):
            key = p.name.split(".", 1)[0]
            if p.name.endswith(".lock") and not os.path.exists(self._object_path(key)) and remove_lock_file(p):
                counts["lock_files"] += 1
        counts["quarantine_pruned"] = self._prune_quarantine()
        return DebrisReport(**counts)

    def _remove_orphan(self, key: str) -> int:
        lock = lock_file(self._lock_path(key), blocking=False)
        if lock is None:
            return 0  # a filler is publishing it right now
        try:
            with self._index.read() as txn:
                if self._index.get(txn, key.encode()) is not None:
                    return 0
            _unlink(self._object_path(key))
            return 1
        finally:
            os.close(lock)

    def _drop_if_still(self, key: str, rec: IndexRecord) -> int:
        lock = lock_file(self._lock_path(key), blocking=False)
        if lock is None:
            return 0
        try:
            found = self._lookup(key)
            if isinstance(found, _Damaged) and found.rec == rec:
                self._drop_damaged(key, found)
                return 1
            if isinstance(found, CachedObject):
                found.close()
            return 0
        finally:
            os.close(lock)

    def verify_all(self) -> VerifyReport:
        """Re-hash every published object; quarantine and unindex the damaged ones."""
        with self._index.read() as txn:
            entries = list(self._index.items(txn))
        ok = 0
        damaged: list[tuple[str, str]] = []
        busy: list[str] = []
        for kb, rec in entries:
            key = kb.decode()
            lock = lock_file(self._lock_path(key), blocking=False)
            if lock is None:
                busy.append("b3:" + key)
                continue
            try:
                found = self._lookup(key)
                if found is None:
                    continue  # evicted meanwhile
                if isinstance(found, CachedObject):
                    with found:
                        digest, size = hash_file(found.path, self.chunk_bytes)
                    if digest == rec.content and size == rec.size:
                        ok += 1
                        continue
                    found = _Damaged(rec, f"re-hash gave {digest} size {size}, expected {rec.content} "
                                          f"size {rec.size}", verify=True)
                self._drop_damaged(key, found)
                damaged.append(("b3:" + key, found.reason))
            finally:
                os.close(lock)
        return VerifyReport(checked=len(entries), ok=ok, damaged=tuple(damaged), busy=tuple(busy))

    def close(self) -> None:
        """Persist pending counters and close this process's index handle."""
        try:
            self.flush()
        finally:
            self._index.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _InlineHasher:
    """BLAKE3 of a stream of chunks, hashed in the caller's thread from one buffer.

    The cheapest in CPU (the chunk is hashed while it is hot in this core's
    cache), hence the default: a loader node's cores are busy decoding and
    tokenizing, and concurrent fills of different objects give the parallelism.
    """

    def __init__(self, chunk: int) -> None:
        self._hash = blake3.blake3()
        self._buf = memoryview(bytearray(chunk))

    def free_buffer(self) -> memoryview:
        return self._buf

    def give_back(self, buf: memoryview) -> None:
        pass

    def feed(self, chunk: memoryview, buf: memoryview) -> None:
        self._hash.update(chunk)

    def finish(self) -> str:
        return "b3:" + self._hash.hexdigest()


class _ThreadHasher(_InlineHasher):
    """BLAKE3 of a stream of chunks, hashed on a second thread from a fixed buffer pool.

    Bounded: four buffers of `chunk` bytes. The reader takes a free buffer,
    fills it, hands it to `hash` and writes it; the hashing thread returns it
    to the pool when done, so a buffer is never refilled before it is hashed.
    Faster in wall time when a core is idle; costs more CPU in total (the
    bytes move between cores), so it is slower on a busy machine.
    """

    _BUFFERS = 4

    def __init__(self, chunk: int) -> None:
        self._hash = blake3.blake3()
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(self._BUFFERS):
            self._free.put(memoryview(bytearray(chunk)))
        self._work: queue.Queue[tuple[memoryview, memoryview] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sluice-cache-hash", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            chunk, buf = item
            self._hash.update(chunk)
            self._free.put(buf)

    def free_buffer(self) -> memoryview:
        return self._free.get()

    def give_back(self, buf: memoryview) -> None:
        self._free.put(buf)

    def feed(self, chunk: memoryview, buf: memoryview) -> None:
        self._work.put((chunk, buf))

    def finish(self) -> str:
        if not self._done:
            self._done = True
            self._work.put(None)
            self._thread.join()
        return "b3:" + self._hash.hexdigest()


def _write_all(out: IO[bytes], data: memoryview) -> None:
    while data:
        n = out.write(data)
        if n is None or n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listdir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except FileNotFoundError:
        return []
