"""What the node cache hands out and reports: pinned objects, counters, maintenance reports.

Plain values with no behaviour beyond their own resources (a `CachedObject`
owns the descriptor that pins its file); the machinery is in the sibling modules.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Any

from sluice.cache.chunks import VERIFY_CHUNK, ChunkGuard
from sluice.cache.index import IndexRecord
from sluice.errors import CacheError


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
    `path` stays valid while the object is open; its bytes are what was
    verified unless something outside sluice writes to the file, which
    `guard()` detects (chunks.py).
    """

    __slots__ = ("path", "digest", "key", "size", "kind", "_fd", "_chunks", "_learn", "_guard")

    def __init__(self, *, path: str, digest: str, key: str, size: int, kind: str, fd: int,
                 chunks: tuple[int, tuple[bytes, ...]] | None = None,
                 learn: Callable[[str, str, int, tuple[bytes, ...]], None] | None = None) -> None:
        self.path = path
        self.digest = digest  # "b3:<hex>" of the bytes at `path`
        self.key = key  # "b3:<hex>" cache key (== digest for raw objects)
        self.size = size
        self.kind = kind
        self._fd = fd
        self._chunks = chunks  # (chunk bytes, digests) recorded at publish, or None (published before them)
        self._learn = learn  # learn(key, content, chunk, digests): record the digests of an older object
        self._guard: ChunkGuard | None = None

    def guard(self) -> ChunkGuard:
        """The object's chunk guard (one per pin, made on first use; closed with the pin): `ensure()` before
        the bytes are first served, `check()` after copying them (chunks.py)."""
        if self._guard is None:
            if self._fd < 0:
                raise CacheError(f"object {self.key}: closed; fetch it again to verify it")
            chunk, digests = self._chunks if self._chunks is not None else (VERIFY_CHUNK, None)
            learn, key, content = self._learn, self.key, self.digest
            self._guard = ChunkGuard(
                os.dup(self._fd), key=key, path=self.path, size=self.size, content=content, chunk=chunk,
                digests=digests,
                on_learned=None if learn is None else (lambda c, d: learn(key, content, c, d)))
        return self._guard

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
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()

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
class Damaged:
    """An index entry whose file is missing, has the wrong size, or re-hashed to other bytes."""

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
