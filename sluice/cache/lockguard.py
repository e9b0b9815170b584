"""Guard against a deleted or replaced `index/lock.mdb` (issue 10 item 21).

LMDB coordinates the processes sharing an environment through `lock.mdb`
(the writer mutex and the reader table live in it). If someone deletes it while
processes use the index, they keep the old, unlinked file, and the next process
to open the index creates a new one: two groups of processes would then write
without a common lock and without seeing each other's readers, and the index
would be corrupted (entries lost, objects orphaned).

What the cache does (documented in docs/cache.md):

* every process that has the index open holds an open-file-description read
  lock (`F_OFD_SETLK`) on `index/data.mdb`, the file nobody deletes by mistake
  (deleting it deletes the index itself), for as long as its environment is open;
* LMDB itself holds a POSIX read lock on byte 0 of the `lock.mdb` it uses;
* before opening, a process tests both without taking anything (`F_OFD_GETLK`):
  if `data.mdb` is in use but no process holds the current `lock.mdb` (missing,
  or a new file), the lock file was deleted or replaced under running processes,
  and the open is refused with a CacheError that says what to do.

So the processes that were running keep one common (unlinked) lock file and stay
correct, and nobody can join them with another one: the deletion is harmless.
A running process also notices the change at its next write transaction and logs
a warning once. After every process using the cache stopped, the next one opens
normally and LMDB creates a fresh `lock.mdb`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from pathlib import Path

from sluice.errors import CacheError

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86_64/aarch64: type, whence, start, len, pid
log = logging.getLogger("sluice.cache")


def _held(path: Path, start: int, length: int) -> bool:
    """True if some process holds a lock on `path`'s range that a write lock would conflict with."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    finally:
        os.close(fd)  # this process has no LMDB lock on this file yet, so closing drops none
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


def check_before_open(index_dir: Path) -> None:
    """Refuse to open an index whose lock file was deleted or replaced under running processes."""
    data, lock = index_dir / "data.mdb", index_dir / "lock.mdb"
    if not _held(data, 0, 0):
        return  # nobody has it open: LMDB (re)initializes lock.mdb safely
    if not _held(lock, 0, 1):
        state = "missing" if not lock.exists() else "a new file no running process uses"
        raise CacheError(
            f"cache index {index_dir}: lock.mdb is {state}, but other processes have the index open "
            "(they hold data.mdb): it was deleted or replaced while they ran. Opening the index now would "
            "let two groups of processes write without a common lock and corrupt it, so this process "
            f"refuses. Stop every process using the cache {index_dir.parent} (daemons, warmers), then "
            "start them again"
        )


class Membership:
    """This process's read lock on `data.mdb`, held while its environment is open."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = index_dir
        self._fd = os.open(index_dir / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
        self._lock_id = _identity(index_dir / "lock.mdb")
        self._warned = False

    def check(self) -> None:
        """At each write: warn once if lock.mdb is no longer the file this process opened."""
        if self._warned or _identity(self.index_dir / "lock.mdb") == self._lock_id:
            return
        self._warned = True
        log.warning("cache index %s: lock.mdb was deleted or replaced while this process used it; this process "
                    "and the others that were running stay consistent (new processes are refused until all of "
                    "them stopped); restart every process using the cache", self.index_dir)

    def close(self) -> None:
        """Drop the read lock (before the environment closes, so a probe never sees data but no lock)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
