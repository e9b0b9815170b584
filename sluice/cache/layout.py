"""Where the node cache keeps its files, and the bounded quarantine of rejected bytes.

Folder layout under `root` (docs/cache.md has the full contract)::

    index/                      LMDB environment (see sluice/cache/index.py)
    objects/ab/<key>            published bytes; <key> = 64 hex of the cache key
    tmp/<key>.<pid>.<n>.part    fills in progress (debris if their filler died)
    locks/<key>.lock            fill locks (flock, exclusive), die with their holder
    quarantine/<key>.<ns>.<pid>.<n>.bad   bytes that did not match, plus a .json note
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from sluice.errors import CacheError

SUBDIRS = ("objects", "tmp", "locks", "quarantine")


class Layout:
    """Paths of one cache folder; `create()` makes the folders."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._seq = itertools.count()

    def create(self) -> None:
        """Make the folder and its sub-folders, private (0700 whatever the umask), refusing links.

        The cache holds copies of dataset objects (and rejected bytes in
        quarantine/), so nobody but its owner may list or read it. A sub-folder
        that is a symbolic link is refused: the cache would write through it.
        """
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise CacheError(f"cache {self.root}: cannot create or make private ({exc.strerror})") from exc
        for sub in (*SUBDIRS, "index"):
            private_dir(self.root / sub, f"cache {self.root}: {sub}/")

    def object_path(self, key: str) -> str:
        return f"{self.root}/objects/{key[:2]}/{key}"

    def object_dir(self, key: str) -> str:
        """The folder of `key`'s object file, created if missing."""
        path = f"{self.root}/objects/{key[:2]}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return path
        os.chmod(path, 0o700)  # the umask may have taken bits away; never added any
        return path

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def tmp_path(self, key: str) -> str:
        return f"{self.root}/tmp/{key}.{os.getpid()}.{next(self._seq)}.part"

    def quarantine_base(self, key: str) -> str:
        return f"{self.root}/quarantine/{key}.{time.time_ns()}.{os.getpid()}.{next(self._seq)}"


class Quarantine:
    """Rejected bytes with a JSON note each; only the newest `keep` are kept (bounded by count)."""

    def __init__(self, layout: Layout, keep: int) -> None:
        self.layout = layout
        self.keep = keep

    def put(self, path: str, key: str, note: dict[str, Any]) -> str:
        """Move `path` into quarantine/ with a JSON note; prune beyond `keep`; return the new path."""
        base = self.layout.quarantine_base(key)
        if os.path.islink(path):  # never move (or chmod through) a link planted in the cache
            unlink(path)
            return path
        try:
            os.chmod(path, 0o600)
            os.replace(path, base + ".bad")
            fd = os.open(base + ".json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with open(fd, "w", encoding="utf-8") as f:
                json.dump(note, f, sort_keys=True)
        except OSError:
            unlink(path)  # quarantine is best effort; never keep bad bytes in objects/ or tmp/
        self.prune()
        return base + ".bad"

    def prune(self) -> int:
        """Remove the oldest quarantined files beyond `keep`; return how many went."""
        qdir = self.layout.root / "quarantine"
        try:
            # a file not named by us (no <ns> field) sorts first: the oldest, so it goes first
            bad = sorted((p for p in qdir.iterdir() if p.suffix == ".bad"), key=_quarantined_ns)
        except OSError:
            return 0
        excess = bad[: max(0, len(bad) - self.keep)]
        for p in excess:
            unlink(str(p))
            unlink(str(p.with_suffix(".json")))
        return len(excess)


def _quarantined_ns(path: Path) -> int:
    """The `<ns>` field of `<key>.<ns>.<pid>.<n>.bad`; 0 for a name the cache did not write."""
    parts = path.name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0


def private_dir(path: Path, what: str) -> None:
    """Create `path` (one level) if missing and make it 0700; refuse a symbolic link or a file."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise CacheError(f"{what} cannot be created ({exc.strerror})") from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{what} is not a folder but a {'symbolic link' if stat.S_ISLNK(st.st_mode) else 'file'}; "
                         "the cache does not write through links: remove it (the cache recreates the folder)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise CacheError(f"{what} cannot be made private (0700): {exc.strerror}") from exc


def unlink(path: str) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def listdir(path: Path) -> list[Path]:
    """Sorted entries of a folder that may not exist."""
    try:
        return sorted(path.iterdir())
    except FileNotFoundError:
        return []
