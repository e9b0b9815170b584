"""The byte budget: reservations for fills in progress and LRU eviction that skips pins.

`budget_bytes` bounds published bytes plus the bytes reserved by live fills.
Eviction runs inside the reserving write transaction, oldest last use first
(ties by key bytes), skipping pinned objects; a fill that cannot fit fails
before it reads its source, so the budget is never overrun.
"""

from __future__ import annotations

import os
from typing import Any

from sluice.cache.core import Core
from sluice.cache.layout import unlink
from sluice.cache.locks import PinResult, is_locked, lock_file, try_exclusive
from sluice.errors import CacheError


class Budget:
    """Reserve, release and evict against one cache's byte budget."""

    def __init__(self, core: Core, budget_bytes: int) -> None:
        self.core = core
        self.bytes = budget_bytes

    def reserve(self, key: str, size: int, what: str) -> None:
        """Reserve `size` bytes for a fill of `key`, evicting LRU unpinned objects if needed."""
        if size > self.bytes:
            raise CacheError(f"{what}: {size} bytes do not fit in the cache budget of {self.bytes} bytes")
        victims: list[tuple[str, int, int]] = []
        idx = self.core.index
        try:
            with idx.write() as txn:
                self.core.counters.flush_into(txn)
                victims = self._make_room(txn, size, what, exclude=key)
                idx.reserve(txn, key.encode(), size)
        except BaseException:
            _close_all(victims)
            raise
        self._unlink_victims(victims)

    def unreserve(self, key: str) -> None:
        with self.core.index.write() as txn:
            self.core.index.unreserve(txn, key.encode())

    def enforce(self, budget_bytes: int | None = None) -> int:
        """Evict LRU unpinned objects until the published bytes fit the budget; return evictions."""
        if budget_bytes is not None:
            self.bytes = budget_bytes
        victims: list[tuple[str, int, int]] = []
        idx = self.core.index
        try:
            with idx.write() as txn:
                self.core.counters.flush_into(txn)
                idx.set_meta(txn, b"budget", self.bytes)
                victims = self._make_room(txn, 0, f"cache {self.core.layout.root}", exclude=None)
        except BaseException:
            _close_all(victims)
            raise
        self._unlink_victims(victims)
        return len(victims)

    def _make_room(self, txn: Any, size: int, what: str, exclude: str | None) -> list[tuple[str, int, int]]:
        """Inside a write txn: delete entries until `size` more bytes fit; return (path, fd, lock) to unlink.

        Each victim is held with an exclusive flock on its file (proof that
        nobody pins it) and with its fill lock until it is unlinked after the
        commit: without the fill lock, a filler could publish the key again
        between our commit and our unlink, and we would unlink its fresh file
        under a fresh entry. A key whose fill lock is busy is skipped.
        """
        idx = self.core.index
        layout = self.core.layout
        used = idx.meta(txn, b"bytes")
        reservations = {k: v for k, v in idx.reservations(txn).items() if k.decode() != exclude}
        reserved = sum(reservations.values())
        if used + reserved + size <= self.bytes:
            return []
        for k, nbytes in reservations.items():  # a reservation whose filler died is stale
            if not is_locked(layout.lock_path(k.decode())):
                idx.unreserve(txn, k)
                reserved -= nbytes
        need = used + reserved + size - self.bytes
        victims: list[tuple[str, int, int]] = []
        pinned = 0
        if need > 0:
            for kb, _ in sorted(idx.last_use(txn).items(), key=lambda kv: (kv[1], kv[0])):
                rec = idx.get(txn, kb)
                if rec is None:
                    continue
                key = kb.decode()
                lock = lock_file(layout.lock_path(key), blocking=False)
                if lock is None:  # being refilled, verified or collected right now
                    pinned += rec.size
                    continue
                path = layout.object_path(key)
                fd = try_exclusive(path)
                if fd is PinResult.GONE:
                    os.close(lock)
                    idx.delete(txn, kb)  # file already gone: the entry is wrong, drop it
                    need -= rec.size
                elif fd is None:
                    os.close(lock)
                    pinned += rec.size
                    continue
                else:
                    idx.delete(txn, kb)
                    victims.append((path, fd, lock))
                    need -= rec.size
                if need <= 0:
                    break
        if need > 0:
            _close_all(victims)
            raise CacheError(
                f"{what}: {size} bytes do not fit in the cache budget of {self.bytes} bytes: "
                f"{used} bytes published ({pinned} of them pinned by readers), {reserved} reserved by fills "
                "in progress; nothing else can be evicted"
            )
        return victims

    def _unlink_victims(self, victims: list[tuple[str, int, int]]) -> None:
        for path, fd, lock in victims:
            unlink(path)
            os.close(fd)
            os.close(lock)
        if victims:
            self.core.counters.count(evictions=len(victims))


def _close_all(victims: list[tuple[str, int, int]]) -> None:
    for _, fd, lock in victims:
        os.close(fd)
        os.close(lock)
