"""The run record: the current generation (fencing token) of a checkpoint folder.

``DIR/run.json`` holds ``{"schema": "sluice.ckpt.run/1", "generation": G, ...}``.
Every change is a compare-and-swap done while holding an exclusive POSIX record
lock (``fcntl.lockf``) on ``DIR/run.lock``; the new record is written to a
temporary file, fsynced and renamed over ``run.json``, then the folder is
fsynced. POSIX record locks are released by the kernel when the holder dies
(kill -9 included) and are honoured across hosts by NFSv4 and the usual
cluster filesystems, so a crashed writer can never wedge the run.

A writer *acquires* a generation (bump: G -> G+1) when it starts or restores;
it may publish only while ``run.json`` still says its generation, checked under
the same lock as the publish itself (`RunRecord.fenced`). A writer that was
superseded gets `FencedError` and publishes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sluice.errors import CheckpointError, FencedError
from sluice.trainer_hooks.durable import fsync_dir, read_small, write_atomic

RUN_SCHEMA = "sluice.ckpt.run/1"
# The daemon refuses generations above 2^53 - 1 (exact in every JSON reader): the run
# record, whose generation is the daemon's fencing token, stays below it.
MAX_GENERATION = 2**53 - 1
_MAX_RECORD_BYTES = 64 << 10

# POSIX record locks belong to a process, not a thread: a second thread of the
# same process would "acquire" a lock its process already holds. One
# threading.Lock per lock file makes the run lock exclusive between threads too
# (an async drain thread publishing while the trainer thread restores).
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(key, threading.Lock())


class RunRecord:
    """Compare-and-swap access to ``DIR/run.json`` (see module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.path = self.root / "run.json"
        self.lock_path = self.root / "run.lock"

    @contextlib.contextmanager
    def locked(self, timeout_s: float = 60.0) -> Iterator[None]:
        """Hold the exclusive run lock (polling with backoff up to `timeout_s`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        tlock = _thread_lock(self.lock_path)
        if not tlock.acquire(timeout=timeout_s):
            raise CheckpointError(f"run lock {self.lock_path}: still held by another thread after {timeout_s:.0f} s")
        try:
            with self._process_lock(deadline, timeout_s):
                yield
        finally:
            tlock.release()

    @contextlib.contextmanager
    def _process_lock(self, deadline: float, timeout_s: float) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            delay = 0.001
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise CheckpointError(
                            f"run lock {self.lock_path}: still held by another writer after {timeout_s:.0f} s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read_unlocked(self) -> dict:
        data = read_small(self.path, _MAX_RECORD_BYTES, "run record")
        if data is None:
            return {"schema": RUN_SCHEMA, "generation": 0}
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"run record {self.path}: not valid JSON ({exc})") from exc
        except RecursionError:
            raise CheckpointError(f"run record {self.path}: JSON nested too deeply") from None
        if not isinstance(obj, dict) or obj.get("schema") != RUN_SCHEMA:
            raise CheckpointError(
                f"run record {self.path}: schema is {obj.get('schema') if isinstance(obj, dict) else obj!r}, "
                f"expected {RUN_SCHEMA!r}"
            )
        gen = obj.get("generation")
        if not isinstance(gen, int) or isinstance(gen, bool) or not 0 <= gen < MAX_GENERATION:
            raise CheckpointError(f"run record {self.path}: generation {gen!r:.40} is not an integer in "
                                  f"[0, {MAX_GENERATION})")
        return obj

    def _write_unlocked(self, obj: dict) -> None:
        write_atomic(self.path, json.dumps(obj, sort_keys=True).encode("ascii") + b"\n")
        fsync_dir(self.root)

    def generation(self) -> int:
        """The current generation (0 for a folder no writer has acquired yet)."""
        return int(self._read_unlocked()["generation"])

    def compare_and_swap(self, expected: int, new: int) -> bool:
        """Set generation to `new` iff it is `expected`; True if it was swapped."""
        if new <= expected:
            raise CheckpointError(f"run record {self.path}: generation must grow ({expected} -> {new})")
        with self.locked():
            obj = self._read_unlocked()
            if obj["generation"] != expected:
                return False
            obj = {**obj, "generation": new, "acquired_unix_ns": time.time_ns(), "acquired_pid": os.getpid()}
            self._write_unlocked(obj)
            return True

    def acquire(self) -> int:
        """Bump the generation (G -> G+1) and return the new one: this writer's fencing token."""
        with self.locked():
            obj = self._read_unlocked()
            new = int(obj["generation"]) + 1
            self._write_unlocked(
                {**obj, "generation": new, "acquired_unix_ns": time.time_ns(), "acquired_pid": os.getpid()}
            )
            return new

    @contextlib.contextmanager
    def fenced(self, generation: int, what: str = "publish") -> Iterator[None]:
        """Run the body under the lock only if `generation` is still current.

        Raises FencedError (a CheckpointError for callers that catch those) naming
        both generations otherwise; nothing in the body runs.
        """
        with self.locked():
            current = int(self._read_unlocked()["generation"])
            if current != generation:
                raise FencedError(
                    f"checkpoint {what} in {self.root} refused: this writer holds generation {generation}, "
                    f"the run record says {current} (a newer writer took over)"
                )
            yield
