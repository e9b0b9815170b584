"""File locks that die with their holder: `flock(2)` on files in the cache folder.

Two uses, both on Linux `flock` (advisory, per open file description, so two
descriptors in one process conflict exactly like two processes do, and the
kernel drops the lock when the holder exits or is killed):

* **Fill locks** (`locks/<key>.lock`, exclusive): one filler per key across
  threads and processes. A waiter polls with a bounded timeout.
* **Pins** (the object file itself, shared): a reader holds a shared lock on the
  object's file while it uses it; eviction takes a non-blocking exclusive lock
  and skips the object when that fails. A pin of a killed process vanishes with
  it, so stale pins can never block eviction.

Lock files may be unlinked by garbage collection while someone is about to lock
them; `lock_file` therefore checks after locking that the path still names the
inode it locked (the classic lock-file protocol) and retries otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from enum import Enum
from pathlib import Path

from sluice.errors import DISK_REFUSALS, CacheError, CacheWriteError

_O_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def lock_file(path: Path, *, blocking: bool = True, timeout_s: float = 600.0, what: str = "") -> int | None:
    """Exclusively lock `path` (created if missing); return the descriptor holding the lock.

    Non-blocking: returns None when another holder has it. Blocking: polls
    (0.5 ms growing to 20 ms) until `timeout_s`, then raises CacheError naming
    `what` and the lock file. Closing the descriptor releases the lock.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        try:
            fd = os.open(path, _O_FLAGS, 0o600)
        except OSError as exc:  # a full disk may refuse even an empty file (no inode, no directory block)
            if exc.errno in DISK_REFUSALS:
                raise CacheWriteError(f"{what or path}: cannot create the lock file {path} "
                                      f"({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror})",
                                      exc.errno) from exc
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if not blocking:
                return None
            if time.monotonic() >= deadline:
                raise CacheError(
                    f"{what or path}: lock {path} still held by another filler after {timeout_s:.0f} s"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
            continue
        # The file may have been unlinked (gc) between our open and our flock:
        # then we hold a lock nobody else can see. Retry on the current file.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def is_locked(path: Path) -> bool:
    """True if someone holds the lock file `path` right now (probe, then release)."""
    fd = lock_file(path, blocking=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def remove_lock_file(path: Path) -> bool:
    """Unlink an unheld lock file; False (and nothing removed) if it is held."""
    fd = lock_file(path, blocking=False)
    if fd is None:
        return False
    try:
        os.unlink(path)
    finally:
        os.close(fd)
    return True


class PinResult(Enum):
    GONE = "gone"  # no file, or the path names another inode now
    BUSY = "busy"  # an evictor holds it exclusively: it is leaving
    WRONG_SIZE = "wrong-size"  # the file exists but its size is not the indexed one
    LINK = "link"  # a symbolic link stands where the object's file should be


def pin_file(path: str, size: int) -> int | PinResult:
    """Open `path` read-only and take a shared lock; return the descriptor or why not.

    The descriptor is the pin: eviction cannot take the file while it is open.
    """
    fd = _open_locked(path, fcntl.LOCK_SH)
    if fd is PinResult.LINK:
        return PinResult.WRONG_SIZE  # damage: the entry is dropped and the link removed
    if isinstance(fd, PinResult):
        return fd
    st = os.fstat(fd)
    try:
        current = os.stat(path).st_ino
    except FileNotFoundError:
        current = -1
    if current != st.st_ino:
        os.close(fd)
        return PinResult.GONE
    if st.st_size != size:
        os.close(fd)
        return PinResult.WRONG_SIZE
    return fd


def try_exclusive(path: str) -> int | PinResult | None:
    """Open `path` and take a non-blocking exclusive lock (eviction's test for "unpinned").

    Returns the descriptor, None when someone pins the file, PinResult.GONE when
    there is no file.
    """
    fd = _open_locked(path, fcntl.LOCK_EX)
    if fd is PinResult.LINK:
        return PinResult.GONE  # no object file there: the entry goes; debris collection removes the link
    return None if fd is PinResult.BUSY else fd


def _open_locked(path: str, op: int) -> int | PinResult:
    """Open `path` read-only and flock it with `op` without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return PinResult.GONE
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link planted in objects/: never serve through it
            return PinResult.LINK
        raise
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return PinResult.BUSY
    return fd
