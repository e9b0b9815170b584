"""File primitives shared by every component: durable publish and the one BLAKE3 file hasher.

A visible change is always "write a temporary file in the same folder, fsync
it, rename it over the target, fsync the folder": a reader, or a restart after
a crash or power loss, sees the old bytes or the new ones, never a mix, and an
interrupted write leaves no partial target.

`hash_file` is the only BLAKE3 file hasher of the repository (the manifest,
the cache, pretokenize and the checkpoints all digest files with it); it
returns a `FileDigest(digest="b3:<hex>", size)`, in that order everywhere.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import IO, NamedTuple

import blake3

HASH_CHUNK = 1 << 20  # bytes read per call: bounded memory whatever the file's size


class FileDigest(NamedTuple):
    """BLAKE3 of a file or stream and the number of bytes hashed."""

    digest: str  # "b3:" + 64 lowercase hex
    size: int

    @property
    def hex(self) -> str:
        """The bare 64-hex digest (without the "b3:" prefix)."""
        return self.digest[3:]


def hash_file(file: str | os.PathLike[str] | int, chunk: int = HASH_CHUNK) -> FileDigest:
    """BLAKE3 and size of a whole file, read in `chunk`-byte pieces into one reused buffer.

    `file` is a path, or an open descriptor (read with `pread` from offset 0,
    so its position is left alone and a pinned descriptor can be re-hashed).
    """
    h = blake3.blake3()
    buf = bytearray(chunk)
    view = memoryview(buf)
    size = 0
    if isinstance(file, int):
        while n := os.preadv(file, [buf], size):
            h.update(view[:n])
            size += n
    else:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
    return FileDigest("b3:" + h.hexdigest(), size)


def hash_stream(stream: IO[bytes], sink: IO[bytes] | None = None, chunk: int = HASH_CHUNK) -> FileDigest:
    """BLAKE3 and size of what `stream.read` yields until EOF, copying it to `sink` if given."""
    h = blake3.blake3()
    size = 0
    while data := stream.read(chunk):
        h.update(data)
        size += len(data)
        if sink is not None:
            sink.write(data)
    return FileDigest("b3:" + h.hexdigest(), size)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or create inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` atomically and durably; on any error nothing is left behind.

    The temporary name carries the process and thread, so concurrent writers of
    one target never share a temporary file (the last rename wins).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_sync_file_range = None  # libc's sync_file_range, looked up on first use (False: not available)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing `nbytes` at `offset` of `fd` to disk, without waiting (Linux
    `sync_file_range(SYNC_FILE_RANGE_WRITE)`); nothing elsewhere.

    Why: a durable fill fsyncs the whole object before publishing it; started
    chunk by chunk while the copy goes on, the writeback overlaps the copy and
    the final fsync has little left (a 1 GiB durable copy 0.76 -> 0.52 s here,
    its fsync 0.27 -> 0.00 s), and the dirty pages a fill leaves never pile up
    to the point where the kernel throttles writers. Errors are not reported
    here: the fsync that follows reports them.
    """
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):  # not Linux (or no such call in this libc)
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def reserve_lmdb_lock(folder: str | os.PathLike[str], max_readers: int) -> None:
    """Give the lock file of the LMDB environment in `folder` its disk blocks before LMDB maps it.

    Why: LMDB sizes `lock.mdb` with ftruncate (a sparse file) and writes it through a
    shared memory map; on a full disk the first write to a page without a block kills
    the process with SIGBUS (a daemon started on a full cache disk died so, before a
    single line of output). Allocated here (posix_fallocate), a full disk is an OSError
    instead, raised for a new lock file. An existing one is left as it is when there
    is no room: the pages in use (header and first reader slots) were written when it
    was made, and a full disk must not stop what still works.
    """
    path = Path(folder) / "lock.mdb"
    size = -(-(4096 + 64 * (max_readers + 2)) // 4096) * 4096  # >= LMDB's (header + one 64-byte slot a reader)
    Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
    new = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        if new:
            os.close(fd)
            fd = -1
            path.unlink(missing_ok=True)  # not left for LMDB to map without its blocks
            raise
    finally:
        if fd >= 0:
            os.close(fd)


def read_secret_file(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """The bytes of a file holding a secret, checked the way ssh checks a private key.

    Refused with `SpecError` naming `what`, the path and the fix: a path that
    cannot be opened, a link (O_NOFOLLOW), anything but a regular file (a FIFO
    is opened with O_NONBLOCK, so it cannot hang the open), a file owned by
    another user than this process's effective user (whoever owns it can
    rewrite it, or already read it), a mode that lets group or others read or
    write it, or more than `max_bytes` bytes. Checks run on the open
    descriptor, so a file swapped after the check is never the one read.
    """
    import stat

    from sluice.errors import SpecError

    where = f"{what} {os.fspath(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise SpecError(f"{where}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with its own exception
        os.close(fd)
        raise SpecError(f"{where}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_uid != os.geteuid():
            raise SpecError(f"{where}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); a secret "
                            "must be the daemon user's own file: copy it, then chmod 600 the copy")
        if st.st_mode & 0o077:
            raise SpecError(f"{where}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; chmod 600 it")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise SpecError(f"{where}: more than {max_bytes} bytes; not a secret of this kind")
    return data
