"""The state every part of a NodeCache shares: settings, folder, index, counters, lookup.

The fill (fill.py), budget (budget.py) and maintenance (maintenance.py) parts
each hold one `Core`; the facade (store.py) wires them. Lookup lives here
because all of them need it: it turns an index entry into a pinned object,
or says why it cannot (missing, wrong size, re-hash mismatch).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.cache.chunks import decode_chunks, encode_chunks
from sluice.cache.hashing import key_hex
from sluice.cache.index import COUNTERS, Index
from sluice.cache.layout import Layout, Quarantine
from sluice.cache.locks import PinResult, pin_file
from sluice.cache.objects import CachedObject, CacheStats, Damaged
from sluice.errors import CacheError, ChunkDamaged
from sluice.manifest.storage import S3Options

log = logging.getLogger("sluice.cache")

_FLUSH_TOUCHES = 4096  # pending last-use updates that force a flush
_FLUSH_SECONDS = 1.0  # at most this long between flushes while hits arrive
_BUSY_SPINS = 2000  # x 1 ms: how long a reader waits for an evictor to finish


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How a NodeCache fills and checks (NodeCache's keyword arguments, validated)."""

    root: Path
    verify_on_read: bool = False
    retries: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    s3_options: S3Options | None = None
    # 256 KiB: the buffer stays in a core's L2 cache while it is read into, hashed and written out,
    # which measured the cheapest fill (docs/cache.md, "Speed"; 4 MiB was 4x slower).
    chunk_bytes: int = 256 << 10
    lock_timeout_s: float = 600.0
    quarantine_keep: int = 32
    durable: bool = True
    hash_thread: bool = False
    kernel_copy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.retries, int) or self.retries < 0:
            raise CacheError(f"cache {self.root}: retries must be an integer >= 0, got {self.retries!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise CacheError(f"cache {self.root}: chunk_bytes must be an integer >= 4096, got {self.chunk_bytes!r}")
        if not isinstance(self.quarantine_keep, int) or self.quarantine_keep < 0:
            raise CacheError(f"cache {self.root}: quarantine_keep must be an integer >= 0, "
                             f"got {self.quarantine_keep!r}")
        for name in ("backoff_s", "max_backoff_s", "lock_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise CacheError(f"cache {self.root}: {name} must be a number >= 0, got {value!r}")


class Counters:
    """This process's counters, plus what is not yet persisted (counters and last-use times).

    A hit only touches memory; the pending deltas go to the index in the next
    write transaction (`flush_into`), about once a second while hits arrive.
    """

    def __init__(self, index: Index) -> None:
        self._index = index
        self._mu = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._pending: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._touches: dict[bytes, int] = {}
        self._last_flush = time.monotonic()

    def count(self, **deltas: int) -> None:
        with self._mu:
            for name, delta in deltas.items():
                self._counts[name] += delta
                self._pending[name] += delta

    def hit(self, key: str) -> None:
        with self._mu:
            self._counts["hits"] += 1
            self._pending["hits"] += 1
            self._touches[key.encode()] = time.time_ns()
            due = len(self._touches) >= _FLUSH_TOUCHES or time.monotonic() - self._last_flush > _FLUSH_SECONDS
        if due:
            try:
                self.flush()
            except CacheError:  # (a full disk under the index): a hit is served anyway; counts wait
                pass

    def flush_into(self, txn: Any) -> tuple[dict[str, int], dict[bytes, int]]:
        """Inside a write transaction: persist the pending counters and last-use times; returns what
        it took (counters, touches), for `flush` to put back when the transaction is not committed."""
        with self._mu:
            pending, self._pending = self._pending, dict.fromkeys(COUNTERS, 0)
            touches, self._touches = self._touches, {}
            self._last_flush = time.monotonic()
        self._index.add_counters(txn, pending)
        self._index.touch(txn, touches)
        return pending, touches

    def flush(self) -> None:
        """Persist the pending counters and last-use times; on a CacheError (the index's disk is
        full: nothing was committed) they stay pending for the next flush."""
        taken: tuple[dict[str, int], dict[bytes, int]] | None = None
        try:
            with self._index.write() as txn:
                taken = self.flush_into(txn)
        except CacheError:
            if taken is not None:
                with self._mu:
                    for name, delta in taken[0].items():
                        self._pending[name] += delta
                    for key, ns in taken[1].items():
                        self._touches.setdefault(key, ns)
            raise

    def stats(self, budget_bytes: int, *, all_processes: bool) -> CacheStats:
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
            objects=objects, bytes=nbytes, budget_bytes=budget_bytes,
        )


class Core:
    """Settings, folder, index, counters and quarantine of one NodeCache, with lookup."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.layout = Layout(config.root)
        self.layout.create()
        self.index = Index(config.root)
        self.counters = Counters(self.index)
        self.quarantine = Quarantine(self.layout, config.quarantine_keep)
        # on_damaged(key "b3:<hex>", damaged): told of every damaged object this process quarantined (a reader
        # that names it in its log and metrics: the daemon's DocSource). Called under the key's fill lock.
        self.on_damaged: Callable[[str, Damaged], None] | None = None

    def lookup(self, key: str) -> CachedObject | Damaged | None:
        """A pinned hit, a damaged entry, or None (not published)."""
        kb = key.encode()
        path = self.layout.object_path(key)
        for _ in range(_BUSY_SPINS):
            with self.index.read() as txn:
                rec = self.index.get(txn, kb)
                chunks = None if rec is None else self.index.get_chunks(txn, kb)
            if rec is None:
                return None
            pin = pin_file(path, rec.size)
            if isinstance(pin, int):
                found = CachedObject(path=path, digest=rec.content, key="b3:" + key, size=rec.size,
                                     kind=rec.kind, fd=pin, learn=self.learn_chunks,
                                     chunks=None if chunks is None else decode_chunks(chunks, "b3:" + key))
                if self.config.verify_on_read:  # every chunk re-hashed; the pin keeps the verified guard
                    try:
                        found.guard().ensure()
                    except ChunkDamaged as exc:
                        found.close()
                        return Damaged(rec, f"re-hash on read: {exc}", verify=True)
                return found
            if pin is PinResult.WRONG_SIZE:
                return Damaged(rec, f"file {path} does not have the indexed size {rec.size}", verify=False)
            if pin is PinResult.GONE:
                with self.index.read() as txn:
                    again = self.index.get(txn, kb)
                if again == rec:  # the entry stays but its file is gone: damage, not a race
                    return Damaged(rec, f"file {path} is missing", verify=False)
                continue
            time.sleep(0.001)  # BUSY: an evictor holds it; its entry disappears at commit
        raise CacheError(f"object b3:{key}: {path} stayed locked by an evictor for {_BUSY_SPINS} ms")

    def settle(self, key: str) -> CachedObject | None:
        """Under the fill lock: the object if another filler published it; drop damage."""
        found = self.lookup(key)
        if isinstance(found, Damaged):
            self.drop_damaged(key, found)
            return None
        return found

    def learn_chunks(self, key: str, content: str, chunk: int, digests: tuple[bytes, ...]) -> None:
        """Record the chunk digests of an object published before they existed (computed by a reader that
        checked the whole digest), if its entry still names the same bytes."""
        kb = key_hex(key, "chunk digests").encode()
        with self.index.write() as txn:
            rec = self.index.get(txn, kb)
            if rec is not None and rec.content == content and self.index.get_chunks(txn, kb) is None:
                self.index.put_chunks(txn, kb, encode_chunks(chunk, digests))

    def drop_damaged(self, key: str, damaged: Damaged) -> None:
        """Under the fill lock: move a damaged object's file to quarantine, drop its entry."""
        path = self.layout.object_path(key)
        note = {"key": "b3:" + key, "reason": damaged.reason, "source": damaged.rec.source,
                "expected_digest": damaged.rec.content, "expected_size": damaged.rec.size}
        with self.index.write() as txn:
            self.index.delete(txn, key.encode())
        if os.path.lexists(path):
            self.quarantine.put(path, key, note)
            self.counters.count(quarantined=1)
        if damaged.verify:
            self.counters.count(verify_failures=1)
        log.warning("cache %s: quarantined damaged object b3:%s (%s): %s", self.config.root, key,
                    damaged.rec.source[:200], damaged.reason)
        if self.on_damaged is not None:
            try:
                self.on_damaged("b3:" + key, damaged)
            except Exception:  # a reader's report must not stop the cache from dropping the object
                log.exception("cache %s: the damage report of b3:%s failed", self.config.root, key)
