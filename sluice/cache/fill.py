"""Filling the cache: stream a source into a temporary file while hashing, then publish.

Life of a fill (the caller holds the key's fill lock and a budget reservation)::

    stream source -> tmp file, BLAKE3 while writing
           | digest+size ok                   | mismatch / read error
           v                                  v
    pin tmp, rename into objects/,      quarantine bytes, backoff + jitter,
    index entry (one LMDB txn)          retry; after the last try raise

Crash safety: the index entry is written only after the rename, so a kill -9
at any moment leaves at worst an unindexed file or a temporary file, both
collected at start (maintenance.py). Nothing in the index points at missing or
unverified bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sluice.cache.budget import Budget
from sluice.cache.chunks import VERIFY_CHUNK, encode_chunks, hash_file_chunks
from sluice.cache.core import Core
from sluice.cache.hashing import InlineHasher, Observer, ThreadHasher
from sluice.cache.index import IndexRecord
from sluice.cache.layout import unlink
from sluice.cache.objects import CachedObject
from sluice.errors import (DISK_REFUSALS, CacheError, CacheWriteError, FillMismatch, FillReadError, FillReport,
                           LocationRefused, MissingExtra, SourceReadError)
from sluice.fsutil import fsync_dir, start_writeback
from sluice.manifest.sources import ObjectRecord
from sluice.manifest.storage import is_remote, open_input

TmpOpener = Callable[[str], IO[bytes]]


def default_open_tmp(path: str) -> IO[bytes]:
    """A new private (0600 whatever the umask) file, never through a symbolic link, unbuffered.

    Opened read-write: the in-kernel copy reads back what it wrote to hash it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return open(fd, "wb", buffering=0)


# copy_file_range cannot copy between these two files (another file system, a device, a pipe, an old
# kernel): the fill copies through user space instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.ESPIPE}
_CACHE_SIDE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # failures of the cache's disk
WRITEBACK_BYTES = 8 << 20  # a durable fill starts the writeback of every 8 MiB it wrote (fsutil.start_writeback)


class Filler:
    """Copies verified bytes into one cache and publishes them (raw fills and derived objects)."""

    def __init__(self, core: Core, budget: Budget, open_tmp: TmpOpener | None = None, roots: Any = None) -> None:
        self.core = core
        self.budget = budget
        self.open_tmp = open_tmp or default_open_tmp
        self.roots = roots  # AllowedRoots a local source must lie within once opened (roots.py), or None

    # ----------------------------------------------------------------- raw
    def fill(self, key: str, obj: ObjectRecord, location: str, what: str,
             observe: Observer | None = None) -> CachedObject:
        """Under the fill lock, with `obj.size` reserved: make `1 + retries` tries, publish or raise.

        `observe` sees each try's bytes, from offset 0 (`_copy_source`)."""
        cfg = self.core.config
        tries = 1 + cfg.retries
        failures: list[str] = []
        last: dict[str, Any] = {}
        mismatch = False
        for attempt in range(1, tries + 1):
            tmp = self.core.layout.tmp_path(key)
            start = time.monotonic()
            try:
                digest, size, chunks = self._copy_source(location, tmp, obj.size, what, observe)
            except (LocationRefused, MissingExtra):  # outside the roots / no package: retrying cannot help
                raise
            except CacheError as exc:  # the cache side failed (disk full, ...): retrying the source cannot help
                message = f"{exc} (try {attempt} of {tries}, expected size {obj.size}; cache-side errors are not retried)"
                raise (CacheWriteError(message, exc.errno) if isinstance(exc, CacheWriteError)
                       else CacheError(message)) from exc
            except SourceReadError as exc:
                unlink(tmp)
                failures.append(f"try {attempt}: {exc}")
                last = {"error": str(exc)}
            else:
                if digest == obj.digest and size == obj.size:
                    rec = IndexRecord(size=size, kind="raw", content=digest, source=location,
                                      filled_ns=time.time_ns())
                    return self.publish(key, tmp, rec, time.monotonic() - start, chunks)
                mismatch = True
                qpath = self.core.quarantine.put(tmp, key, {
                    "key": obj.digest, "manifest_location": obj.location, "source": location,
                    "expected_digest": obj.digest, "expected_size": obj.size,
                    "actual_digest": digest, "actual_size": size, "try": attempt})
                self.core.counters.count(quarantined=1)
                failures.append(f"try {attempt}: {_got(digest, size, obj.size)} (bytes quarantined at {qpath})")
                last = {"actual_digest": digest, "actual_size": size}
            if attempt < tries:
                self.core.counters.count(retries=1)
                time.sleep(backoff_delay(key, attempt, cfg.backoff_s, cfg.max_backoff_s))
        expected = f"expected digest {obj.digest} size {obj.size}"
        if "actual_digest" in last:
            actual = _got(last["actual_digest"], last["actual_size"], obj.size)
        else:
            actual = f"got no bytes ({last.get('error', 'unknown error')})"
        message = f"{what}: fill failed after {tries} tries: {expected}, {actual}; " + "; ".join(failures)
        details = FillReport(digest=obj.digest, location=obj.location, source=location,
                             expected_digest=obj.digest, expected_size=obj.size,
                             actual_digest=last.get("actual_digest"), actual_size=last.get("actual_size"),
                             tries=tries)
        if mismatch and "actual_digest" in last:
            raise FillMismatch(message, details)
        raise FillReadError(message, details)

    def _copy_source(self, location: str, tmp: str, expected: int, what: str,
                     observe: Observer | None = None) -> tuple[str, int, tuple[bytes, ...]]:
        """Stream `location` into `tmp` while hashing; return (digest, size, chunk digests) of the source.

        One pass, chunk by chunk, so the digest is of exactly the bytes written:
        read the chunk into a buffer, write it, hash it. With `kernel_copy`, for
        a local source and the default temporary file, copy the chunk in the
        kernel (copy_file_range) and read it back from the temporary file into
        the buffer to hash it instead (falling back to the read when the kernel
        cannot copy: a remote store, another file system, a device, a test's `open_tmp`).
        With `hash_thread` the hashing runs on a second thread over a pool of
        buffers, overlapping the next chunk's copy. `observe` (see
        `sluice.cache.hashing.Observer`) sees every chunk hashed, in order, in
        the thread that hashes it.
        Reads and writes at most `expected + 1` bytes: one byte more than the
        manifest records proves the source is longer, and a source that never
        ends (a location of /dev/zero, a growing file) cannot keep the fill
        busy forever. Source failures raise SourceReadError; cache-side write
        failures (ENOSPC, ...) raise CacheError after removing `tmp`.
        """
        cfg = self.core.config
        limit = expected + 1
        total = 0
        flushed = 0  # bytes whose writeback was started (durable fills)
        if is_remote(location):  # s3 or a fsspec scheme: bounded timeouts, errors name the object
            src = open_input(location, cfg.s3_options)
        else:  # unbuffered: each readinto is one read(2) straight into our buffer
            try:
                src = open(location, "rb", buffering=0)
            except FileNotFoundError as exc:
                raise SourceReadError(f"source {location}: no such file") from exc
            except OSError as exc:
                raise SourceReadError(f"source {location}: cannot open ({exc.strerror or exc})") from exc
            if self.roots is not None:  # on the file opened: a link swapped after fetch's check is caught here
                try:
                    self.roots.check_opened(src.fileno(), location, what)
                except BaseException:
                    src.close()
                    raise
        try:
            out = self.open_tmp(tmp)
        except OSError as exc:
            src.close()
            raise _write_error(exc, tmp, what, 0) from exc
        hasher = (ThreadHasher if cfg.hash_thread else InlineHasher)(cfg.chunk_bytes, observe)
        # With `kernel_copy`, the default temporary file of a local source: copy in the
        # kernel, then read back the bytes just written and hash them (see `_kernel_copy`).
        in_kernel = (cfg.kernel_copy and self.open_tmp is default_open_tmp and not is_remote(location)
                     and hasattr(os, "copy_file_range"))
        try:
            while True:
                if total >= limit:
                    break
                buf = hasher.free_buffer()
                want = min(len(buf), limit - total)
                n = self._kernel_copy(src, out, buf, want, total, location, tmp, what) if in_kernel else None
                if n is None:  # through user space: read, hash, write
                    in_kernel = False
                    try:
                        n = src.readinto(buf if want == len(buf) else buf[:want])
                    except OSError as exc:
                        hasher.give_back(buf)
                        raise SourceReadError(f"source {location}: read failed after {total} bytes ({exc})") from exc
                    if n:
                        try:
                            _write_all(out, buf[:n])
                        except OSError as exc:
                            hasher.give_back(buf)
                            raise _write_error(exc, tmp, what, total) from exc
                if not n:
                    hasher.give_back(buf)
                    break
                hasher.feed(buf[:n], buf)
                total += n
                if cfg.durable and total - flushed >= WRITEBACK_BYTES:  # see `start_writeback`
                    start_writeback(out.fileno(), flushed, total - flushed)
                    flushed = total
            try:
                if cfg.durable:
                    os.fsync(out.fileno())
                out.close()
            except OSError as exc:
                raise _write_error(exc, tmp, what, total) from exc
            digest = hasher.finish()
            chunks = hasher.chunks.finish()
        except BaseException:
            try:
                hasher.finish()  # stops the hashing thread
            except BaseException:  # the error being raised is the one to report
                pass
            out.close()
            unlink(tmp)
            raise
        finally:
            src.close()
        return digest, total, chunks

    @staticmethod
    def _kernel_copy(src: Any, out: Any, buf: memoryview, want: int, offset: int, location: str, tmp: str,
                     what: str) -> int | None:
        """Copy up to `want` bytes at `offset` from `src` to `out` with copy_file_range, then read
        them back from `out` into `buf`; returns the count (0 at the end of the source), or None when
        the kernel cannot copy between these files (only ever at offset 0: then the caller copies
        through user space from the start).

        Why it is not the default: it reads every byte back into the buffer to hash it, a copy the
        read path does not make. With a buffer that stays in the core's L2 cache (`chunk_bytes` 256
        KiB) read + write + hash measured cheaper: 0.75-0.91x of copyfile's wall time against
        0.51-0.73x for this loop (standalone loops, 256 MiB and 1 GiB, load 3-4; docs/cache.md,
        "Speed"). Where the file system shares extents (reflinks) this path may still win: the copy
        itself is then free.
        """
        try:
            n = os.copy_file_range(src.fileno(), out.fileno(), want, offset, offset)
        except OSError as exc:
            if offset == 0 and exc.errno in _NO_KERNEL_COPY:
                return None
            if exc.errno in _CACHE_SIDE:
                raise _write_error(exc, tmp, what, offset) from exc
            raise SourceReadError(f"source {location}: read failed after {offset} bytes ({exc})") from exc
        if n == 0 and offset == 0:
            return None  # an empty source, or a file system that copies nothing (procfs): read() decides
        try:
            got = os.preadv(out.fileno(), [buf[:n]], offset) if n else 0
        except OSError as exc:
            raise _write_error(exc, tmp, what, offset) from exc
        if got != n:
            raise _write_error(OSError(errno.EIO, f"read back {got} of {n} bytes just written"), tmp, what, offset)
        return n

    # ------------------------------------------------------------- derived
    def produce(self, key: str, source: str, producer: Callable[[Path], None], what: str) -> CachedObject:
        """Under the fill lock: run `producer(tmp)`, hash what it wrote, reserve, publish."""
        tmp = self.core.layout.tmp_path(key)
        start = time.monotonic()
        try:
            producer(Path(tmp))
            digest, size, chunks = _hash_with_chunks(tmp)
        except FileNotFoundError as exc:
            raise CacheError(f"{what}: the producer wrote nothing to {tmp}") from exc
        except OSError as exc:
            raise _write_error(exc, tmp, what, 0) from exc
        except BaseException:
            unlink(tmp)
            raise
        try:
            self.budget.reserve(key, size, what)
        except BaseException:
            unlink(tmp)
            raise
        rec = IndexRecord(size=size, kind="derived", content=digest, source=source, filled_ns=time.time_ns())
        try:
            return self.publish(key, tmp, rec, time.monotonic() - start, chunks)
        except BaseException:
            self.budget.unreserve(key)
            raise

    # -------------------------------------------------------------- publish
    def publish(self, key: str, tmp: str, rec: IndexRecord, seconds: float,
                chunks: tuple[bytes, ...] | None = None) -> CachedObject:
        """Under the fill lock: pin `tmp`, rename it into objects/, then index it (with its chunk digests,
        in the same transaction: an entry never lacks the digests its readers verify against)."""
        core = self.core
        durable = core.config.durable
        pin = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.fchmod(pin, 0o600)  # a derived producer or a test's open_tmp chose its own mode
            fcntl.flock(pin, fcntl.LOCK_SH)  # the pin follows the inode through the rename
            dest = core.layout.object_path(key)
            folder = core.layout.object_dir(key)
            os.replace(tmp, dest)
            if durable:
                fsync_dir(folder)
            core.counters.count(fills=1, fill_bytes=rec.size, fill_us=int(seconds * 1e6))
            with core.index.write() as txn:
                core.index.put(txn, key.encode(), rec, time.time_ns())
                if chunks is not None:
                    core.index.put_chunks(txn, key.encode(), encode_chunks(VERIFY_CHUNK, chunks))
                core.index.unreserve(txn, key.encode())
                core.counters.flush_into(txn)
            if durable:
                core.index.sync()
        except BaseException:
            os.close(pin)
            unlink(tmp)
            raise
        return CachedObject(path=dest, digest=rec.content, key="b3:" + key, size=rec.size, kind=rec.kind, fd=pin,
                            chunks=None if chunks is None else (VERIFY_CHUNK, chunks), learn=core.learn_chunks)


def _hash_with_chunks(path: str) -> tuple[str, int, tuple[bytes, ...]]:
    """(digest, size, chunk digests) of a file a derived producer wrote, in one pass."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        digest, chunks = hash_file_chunks(fd, size)
    finally:
        os.close(fd)
    return digest, size, chunks


def _got(digest: str, size: int, expected: int) -> str:
    """What a try read, for an error message: a longer source was read only up to expected + 1."""
    if size > expected:
        return (f"got more than {expected} bytes: the source is longer than the recorded size {expected} "
                f"(reading stopped at {size} bytes)")
    shorter = f" (the source is shorter than the recorded size {expected})" if size < expected else ""
    return f"got digest {digest} size {size}{shorter}"


def backoff_delay(key: str, attempt: int, backoff_s: float, max_backoff_s: float) -> float:
    """Sleep before try `attempt + 1`: `min(max, base * 2**(attempt-1))` times a jitter in [0.5, 1).

    Jitter spreads the retries of many nodes hitting one store; it is seeded by
    (key, pid, attempt) so nothing in a run depends on a global random state.
    """
    jitter = random.Random(f"{key}:{os.getpid()}:{attempt}").random()
    return min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) * (0.5 + 0.5 * jitter)


def _write_error(exc: OSError, tmp: str, what: str, written: int) -> CacheError:
    """The error of a failed write of `tmp` (removed here): a CacheWriteError (with its errno) when the
    disk refused it (DISK_REFUSALS: a caller may keep what was made in memory instead), else a CacheError."""
    unlink(tmp)
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    hint = "; the cache disk is full: free space or lower the budget" if exc.errno == errno.ENOSPC else ""
    message = (f"{what}: writing the cache file {tmp} failed after {written} bytes "
               f"({name}: {exc.strerror}); the partial file was removed{hint}")
    return CacheWriteError(message, exc.errno) if exc.errno in DISK_REFUSALS else CacheError(message)


def _write_all(out: IO[bytes], data: memoryview) -> None:
    while data:
        n = out.write(data)
        if n is None or n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]
