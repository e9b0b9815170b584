"""Durable file primitives for checkpoint storage on a POSIX filesystem.

Every visible change is "write a temporary file, fsync it, rename it over the
target, fsync the directory": a reader (or a restart after a crash or power
loss) sees either the old bytes or the new ones, never a mix. Shard digests are
BLAKE3, computed while the bytes are written so no second read is needed.
"""

from __future__ import annotations

import os
import stat

import blake3

from sluice.errors import CheckpointError
from sluice.fsutil import fsync_dir, hash_file, write_atomic

__all__ = ["HashingWriter", "fsync_dir", "fsync_file", "hash_file", "read_small", "write_atomic"]


def read_small(path: str | os.PathLike[str], limit: int, what: str) -> bytes | None:
    """The bytes of a small control file (manifest, run record, `latest`, MAC); None if it is absent.

    Refuses, with CheckpointError, anything but a regular file of at most
    `limit` bytes: a FIFO in its place would block the reader forever, and a
    huge file would be read whole into memory.
    """
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CheckpointError(f"{what} {path} is not a regular file of at most {limit} bytes "
                                  f"(mode {st.st_mode:o}, {st.st_size} bytes)")
        with open(path, "rb") as fh:
            return fh.read(limit + 1)[:limit]
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{what} {path} cannot be read ({exc.strerror})") from exc


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file that was written and closed earlier."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """A binary file writer that counts bytes and BLAKE3-hashes them as they pass.

    `close()` flushes and fsyncs; the caller fsyncs the directory once for all
    shards it wrote.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fh = open(path, "xb")
        self._hash = blake3.blake3()
        self.bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = self._fh.write(data)
        self._hash.update(data)
        self.bytes += n
        return n

    def flush(self) -> None:
        self._fh.flush()

    def close(self, fsync: bool = True) -> None:
        """Flush and close; `fsync=False` leaves durability to a later `fsync_file`
        (a writer of many shards fsyncs them together after writing them all)."""
        if not self._fh.closed:
            self._fh.flush()
            if fsync:
                os.fsync(self._fh.fileno())
            self._fh.close()

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    @property
    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    # torch.save wants a file-like object with write/flush; seek/tell are not needed
    # for the zipfile writer torch uses on unseekable streams.
