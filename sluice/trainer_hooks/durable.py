"""Durable file primitives for checkpoint storage on a POSIX filesystem.

Every visible change is "write a temporary file, fsync it, rename it over the
target, fsync the directory": a reader (or a restart after a crash or power
loss) sees either the old bytes or the new ones, never a mix. Shard digests are
BLAKE3, computed while the bytes are written so no second read is needed.
"""

from __future__ import annotations

import os

import blake3

from sluice.fsutil import fsync_dir, hash_file, write_atomic

__all__ = ["HashingWriter", "fsync_dir", "fsync_file", "hash_file", "write_atomic"]


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
