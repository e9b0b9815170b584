"""The node cache: content-addressed, digest-verified fills on an LMDB index.

`NodeCache` is a small facade over the parts, one job each:

| module           | job                                                          |
| ---------------- | ------------------------------------------------------------ |
| `core.py`        | settings, folder, index handle, counters, lookup + pinning   |
| `fill.py`        | stream a source into a temporary file while hashing; publish |
| `budget.py`      | reservations and LRU eviction that skips pinned objects      |
| `maintenance.py` | debris collection, full verification                         |
| `hashing.py`     | cache keys (raw and derived), streaming hashers              |
| `layout.py`      | paths of the cache folder, the bounded quarantine            |
| `index.py`, `locks.py`, `objects.py` | LMDB index, flock locks, returned values |

Life of a fetch::

    fetch(obj) -> index hit? -- yes --> pin (shared flock on the file) --> CachedObject
                     | no
                     v
              fill lock (flock locks/<key>.lock; waiters poll) -> hit now? -> pin
                     | still a miss
                     v
              reserve obj.size in the budget (evict LRU, skip pinned)
                     v
              fill (fill.py): copy + hash, publish or quarantine and retry
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sluice.cache.budget import Budget
from sluice.cache.core import CacheConfig, Core
from sluice.cache.fill import Filler, TmpOpener
from sluice.cache.hashing import Observer, derived_digest, derived_source, key_hex
from sluice.cache.locks import lock_file
from sluice.cache.maintenance import Maintenance
from sluice.cache.objects import CachedObject, CacheStats, Damaged, DebrisReport, VerifyReport
from sluice.cache.roots import AllowedRoots
from sluice.errors import CacheError
from sluice.manifest.sources import ObjectRecord
from sluice.manifest.storage import S3Options

__all__ = ["CachedObject", "CacheStats", "DebrisReport", "NodeCache", "VerifyReport", "derived_digest"]


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
    `kernel_copy` copies a local source with copy_file_range and reads each
    chunk back to hash it (worth it where the file system shares extents);
    by default a chunk is read into a buffer, hashed and written, which
    measured cheaper here (fill.py, `_kernel_copy`).

    `durable=True` fsyncs each object and its folder before indexing it and
    syncs the index after publishing, so even a power loss cannot leave an
    entry whose bytes were not on disk. `durable=False` skips every fsync: still safe
    against process crashes and kill -9 (the kernel keeps what was written),
    not against an OS crash, after which `sluice cache verify` is due.

    `allowed_roots` (optional): a miss whose location lies outside these roots
    is refused with LocationRefused before anything is read, checked on the
    name and again on the file opened (see roots.py).
    Folders and files are private: 0700 and 0600 whatever the umask.
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
        chunk_bytes: int = 256 << 10,
        lock_timeout_s: float = 600.0,
        quarantine_keep: int = 32,
        durable: bool = True,
        hash_thread: bool = False,
        kernel_copy: bool = False,
        open_tmp: TmpOpener | None = None,
        collect: bool = True,
        allowed_roots: AllowedRoots | None = None,
    ) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise CacheError(f"cache {root}: budget_bytes must be a positive integer, got {budget_bytes!r}")
        config = CacheConfig(
            root=Path(root), verify_on_read=verify_on_read, retries=retries, backoff_s=backoff_s,
            max_backoff_s=max_backoff_s, s3_options=s3_options, chunk_bytes=chunk_bytes,
            lock_timeout_s=lock_timeout_s, quarantine_keep=quarantine_keep, durable=durable,
            hash_thread=hash_thread, kernel_copy=kernel_copy,
        )
        self._roots = allowed_roots
        self._core = Core(config)
        self._budget = Budget(self._core, budget_bytes)
        self._filler = Filler(self._core, self._budget, open_tmp, allowed_roots)
        self._maintenance = Maintenance(self._core)
        with self._core.index.write() as txn:
            self._core.index.set_meta(txn, b"budget", budget_bytes)
        if collect:
            self.collect_debris()

    # ------------------------------------------------------------ settings
    @property
    def root(self) -> Path:
        return self._core.config.root

    @property
    def budget_bytes(self) -> int:
        return self._budget.bytes

    @property
    def allowed_roots(self) -> AllowedRoots | None:
        """The roots every miss is checked against (None: no check)."""
        return self._roots

    @property
    def on_damaged(self) -> Callable[[str, Damaged], None] | None:
        """Told of every damaged object this process quarantines: `fn(key, damaged)` (`damaged.reason` says
        why, `damaged.rec.kind` whether raw or derived), under the key's fill lock; it must not raise."""
        return self._core.on_damaged

    @on_damaged.setter
    def on_damaged(self, fn: Callable[[str, Damaged], None] | None) -> None:
        self._core.on_damaged = fn

    @property
    def verify_on_read(self) -> bool:
        return self._core.config.verify_on_read

    @property
    def config(self) -> CacheConfig:
        return self._core.config

    # --------------------------------------------------------------- lookups
    def lookup(self, digest: str) -> CachedObject | None:
        """The pinned object for a raw digest or derived key if published (counts nothing)."""
        found = self._core.lookup(key_hex(digest, "lookup"))
        return found if isinstance(found, CachedObject) else None

    def fetch(self, obj: ObjectRecord, location: str, *, observe: Observer | None = None) -> CachedObject:
        """The pinned local copy of `obj`, filling it from `location` on a miss.

        `location` is the already resolved source (local path or s3:// URI).
        `observe(chunk, offset)` is called for every chunk a fill by this call
        hashes (each try from offset 0; never on a hit or when another process
        filled it): a way to compute something from the bytes in the same pass
        (a line index), to be trusted only if this call returns.
        Raises DigestMismatch (bytes never matched), SourceReadError (source
        unreadable on every try) or CacheError (budget, disk, lock); every
        message names the object's digest and location, the source, expected
        and actual digest and size, and the number of tries.
        """
        key = key_hex(obj.digest, f"object {obj.location}")
        core = self._core
        found = core.lookup(key)
        if isinstance(found, CachedObject):
            core.counters.hit(key)
            return found
        core.counters.count(misses=1)
        if self._roots is not None:  # checked again at fill time: a link may have changed since the start
            self._roots.check(location, f"object {obj.digest} (manifest location {obj.location!r})")
        what = f"object {obj.digest} (manifest location {obj.location!r}, source {location!r})"
        lock = lock_file(core.layout.lock_path(key), timeout_s=core.config.lock_timeout_s, what=what)
        try:
            found = core.settle(key)
            if found is not None:
                return found
            self._budget.reserve(key, obj.size, what)
            try:
                return self._filler.fill(key, obj, location, what, observe)
            except BaseException:
                self._budget.unreserve(key)
                raise
        finally:
            os.close(lock)

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
        key = key_hex(derived_digest(key_inputs), "derived key")
        core = self._core
        found = core.lookup(key)
        if isinstance(found, Damaged):
            lock = lock_file(core.layout.lock_path(key), timeout_s=core.config.lock_timeout_s,
                             what=f"derived object b3:{key}")
            try:
                found = core.settle(key)
            finally:
                os.close(lock)
        if isinstance(found, CachedObject):
            core.counters.hit(key)
            return found
        return None

    def put_derived(self, key_inputs: Mapping[str, Any], producer: Callable[[Path], None]) -> CachedObject:
        """The derived object for `key_inputs`, made by `producer(tmp_path)` on a miss.

        The producer writes the whole object to the path it is given; it runs at
        most once per key across threads and processes sharing the folder. The
        index records the BLAKE3 of what it wrote, which verify-on-read checks.
        """
        source = derived_source(key_inputs)
        key = key_hex(derived_digest(key_inputs), "derived key")
        core = self._core
        found = core.lookup(key)
        if isinstance(found, CachedObject):
            core.counters.hit(key)
            return found
        core.counters.count(misses=1)
        what = f"derived object b3:{key} (inputs {source})"
        lock = lock_file(core.layout.lock_path(key), timeout_s=core.config.lock_timeout_s, what=what)
        try:
            found = core.settle(key)
            if found is not None:
                return found
            return self._filler.produce(key, source, producer, what)
        finally:
            os.close(lock)

    def drop_derived(self, key_inputs: Mapping[str, Any], reason: str) -> bool:
        """Quarantine the derived object for `key_inputs` that its reader refused (`reason`: why,
        naming the file), so that the next `put_derived` makes it anew; False if none is published.

        Readers that hold it pinned keep their descriptors; the entry and the file leave the cache.
        """
        key = key_hex(derived_digest(key_inputs), "derived key")
        return self._drop(key, f"derived object b3:{key}", reason, verify=False)

    def quarantine_damaged(self, obj: CachedObject, reason: str) -> bool:
        """Quarantine a pinned object whose bytes a reader found changed (`ChunkDamaged`: `reason`), so that
        the next fetch fills it anew; False if the cache already replaced it (another reader came first).

        Counts a verify failure. Readers holding it keep their descriptors (and must not serve from them).
        """
        key = key_hex(obj.key, "quarantine")
        path = self._core.layout.object_path(key)

        def still_ours() -> bool:  # the published file is the inode the reader found damaged, not a refill
            try:
                return os.stat(path).st_ino == os.fstat(obj.guard().fileno()).st_ino
            except (OSError, CacheError):
                return False

        return self._drop(key, f"damaged object {obj.key}", reason, verify=True, still_ours=still_ours)

    def _drop(self, key: str, what: str, reason: str, *, verify: bool,
              still_ours: Callable[[], bool] | None = None) -> bool:
        """Under the key's fill lock: quarantine the published object and drop its entry (`Core.drop_damaged`);
        False if none is published, or `still_ours()` says it is not the one the caller refused."""
        core = self._core
        lock = lock_file(core.layout.lock_path(key), timeout_s=core.config.lock_timeout_s, what=what)
        try:
            with core.index.read() as txn:
                rec = core.index.get(txn, key.encode())
            if rec is None or (still_ours is not None and not still_ours()):
                return False
            core.drop_damaged(key, Damaged(rec, reason, verify=verify))
            return True
        finally:
            os.close(lock)

    # ------------------------------------------------------- budget, upkeep
    def enforce_budget(self, budget_bytes: int | None = None) -> int:
        """Evict LRU unpinned objects until the published bytes fit the budget; return evictions."""
        return self._budget.enforce(budget_bytes)

    def collect_debris(self) -> DebrisReport:
        """Remove what crashed or killed fillers left behind; safe while others use the cache."""
        return self._maintenance.collect_debris()

    def verify_all(self) -> VerifyReport:
        """Re-hash every published object; quarantine and unindex the damaged ones."""
        return self._maintenance.verify_all()

    # -------------------------------------------------------------- counters
    def stats(self, *, all_processes: bool = False) -> CacheStats:
        """This instance's counters (default), or the cumulative ones of every process.

        `all_processes=True` first persists this instance's pending counters; other
        processes' counters appear once they flush (about once a second, at each
        fill and at close).
        """
        return self._core.counters.stats(self._budget.bytes, all_processes=all_processes)

    def flush(self) -> None:
        """Persist pending counters and last-use times (done automatically about once a second)."""
        self._core.counters.flush()

    def close(self) -> None:
        """Persist pending counters and close this process's index handle."""
        try:
            self.flush()
        finally:
            self._core.index.close()

    def __enter__(self) -> NodeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
