"""Durable file primitives shared by every component that publishes a file.

A visible change is always "write a temporary file in the same folder, fsync
it, rename it over the target, fsync the folder": a reader, or a restart after
a crash or power loss, sees the old bytes or the new ones, never a mix, and an
interrupted write leaves no partial target.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


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
