"""Maintenance of a cache folder: collect what killed fillers left, re-hash everything.

Both are safe while other threads and processes use the cache: a file is
touched only under its key's fill lock, and only after re-checking the index
while holding it, so collection never races with a publisher.
"""

from __future__ import annotations

import os

from sluice.cache.core import Core
from sluice.cache.index import IndexRecord
from sluice.cache.layout import listdir, unlink
from sluice.cache.locks import is_locked, lock_file, remove_lock_file
from sluice.cache.objects import CachedObject, Damaged, DebrisReport, VerifyReport
from sluice.fsutil import hash_file


class Maintenance:
    """Debris collection and full verification of one cache."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def collect_debris(self) -> DebrisReport:
        """Remove what crashed or killed fillers left behind; safe while others use the cache.

        Temporary files and reservations whose fill lock nobody holds, object
        files without an index entry, index entries whose file is missing or
        has the wrong size, unheld lock files, quarantine beyond its bound.
        """
        layout, idx = self.core.layout, self.core.index
        counts = dict.fromkeys(DebrisReport.__dataclass_fields__, 0)
        for p in listdir(layout.root / "tmp"):
            key = p.name.split(".", 1)[0]
            if not is_locked(layout.lock_path(key)):
                unlink(str(p))
                counts["tmp_files"] += 1
        with idx.read() as txn:
            entries = dict(idx.items(txn))
            reservations = idx.reservations(txn)
        for sub in listdir(layout.root / "objects"):
            for p in listdir(sub):
                if p.name.encode() not in entries:
                    counts["orphan_objects"] += self._remove_orphan(p.name)
        for kb, rec in entries.items():
            key = kb.decode()
            try:
                ok = os.stat(layout.object_path(key)).st_size == rec.size
            except FileNotFoundError:
                ok = False
            if not ok:
                counts["dropped_entries"] += self._drop_if_still(key, rec)
        stale = [k for k in reservations if not is_locked(layout.lock_path(k.decode()))]
        if stale:
            with idx.write() as txn:
                for k in stale:
                    idx.unreserve(txn, k)
            counts["stale_reservations"] = len(stale)
        for p in listdir(layout.root / "locks"):
            key = p.name.split(".", 1)[0]
            if p.name.endswith(".lock") and not os.path.exists(layout.object_path(key)) and remove_lock_file(p):
                counts["lock_files"] += 1
        counts["quarantine_pruned"] = self.core.quarantine.prune()
        return DebrisReport(**counts)

    def _remove_orphan(self, key: str) -> int:
        lock = lock_file(self.core.layout.lock_path(key), blocking=False)
        if lock is None:
            return 0  # a filler is publishing it right now
        try:
            with self.core.index.read() as txn:
                if self.core.index.get(txn, key.encode()) is not None:
                    return 0
            unlink(self.core.layout.object_path(key))
            return 1
        finally:
            os.close(lock)

    def _drop_if_still(self, key: str, rec: IndexRecord) -> int:
        lock = lock_file(self.core.layout.lock_path(key), blocking=False)
        if lock is None:
            return 0
        try:
            found = self.core.lookup(key)
            if isinstance(found, Damaged) and found.rec == rec:
                self.core.drop_damaged(key, found)
                return 1
            if isinstance(found, CachedObject):
                found.close()
            return 0
        finally:
            os.close(lock)

    def verify_all(self) -> VerifyReport:
        """Re-hash every published object; quarantine and unindex the damaged ones."""
        core = self.core
        with core.index.read() as txn:
            entries = list(core.index.items(txn))
        ok = 0
        damaged: list[tuple[str, str]] = []
        busy: list[str] = []
        for kb, rec in entries:
            key = kb.decode()
            lock = lock_file(core.layout.lock_path(key), blocking=False)
            if lock is None:
                busy.append("b3:" + key)
                continue
            try:
                found = core.lookup(key)
                if found is None:
                    continue  # evicted meanwhile
                if isinstance(found, CachedObject):
                    with found:
                        digest, size = hash_file(found.path, core.config.chunk_bytes)
                    if digest == rec.content and size == rec.size:
                        ok += 1
                        continue
                    found = Damaged(rec, f"re-hash gave {digest} size {size}, expected {rec.content} "
                                         f"size {rec.size}", verify=True)
                core.drop_damaged(key, found)
                damaged.append(("b3:" + key, found.reason))
            finally:
                os.close(lock)
        return VerifyReport(checked=len(entries), ok=ok, damaged=tuple(damaged), busy=tuple(busy))
