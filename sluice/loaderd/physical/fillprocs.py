"""The worker processes of `--worker-kind process`: whole-object fills (decode + tokenize), replaced on death.

DocSource submits one object's fill at a time to this pool. A worker that
dies (kill -9, the OOM killer, a crash in a native decoder) breaks a
`ProcessPoolExecutor` for good: every later submit raises BrokenProcessPool.
So the broken pool is dropped and the next submit starts a fresh one (the
worker initializer runs again); the caller decides whether the object's fill
is tried again (DocSource: once, and only if nothing of it was served yet).

The worker side is here too: `worker_init` (once per process) and
`worker_fill` (one object's token shard, its progress counted in a file the
daemon polls with `read_count`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice.errors import SluiceError

if TYPE_CHECKING:  # concurrent.futures.process imports multiprocessing: only when a pool starts
    from concurrent.futures import Future, ProcessPoolExecutor

log = logging.getLogger("sluice.loaderd")


class FillProcesses:
    """A replaceable ProcessPoolExecutor of `workers` processes (forkserver where available)."""

    def __init__(self, workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
        self._workers = workers
        self._init = initializer
        self._initargs = initargs
        self._lock = threading.Lock()
        self._ex: ProcessPoolExecutor | None = None
        self._closed = False
        self.restarts = 0  # pools replaced after a worker died

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("worker processes closed")
            if self._ex is None:
                from concurrent.futures import ProcessPoolExecutor

                from sluice.procpool import pool_context

                ctx = pool_context()  # workers leave a terminal's Ctrl-C to the daemon, which drains and closes them
                self._ex = ProcessPoolExecutor(max_workers=self._workers, mp_context=ctx, initializer=self._init,
                                               initargs=self._initargs)
            return self._ex

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[ProcessPoolExecutor, Future[Any]]:
        """(the pool, the future) of `fn(*args)` in a worker; a pool found broken is replaced first, once."""
        from concurrent.futures.process import BrokenProcessPool

        ex = self._executor()
        try:
            return ex, ex.submit(fn, *args)
        except BrokenProcessPool:  # a worker died while idle: the pool is unusable from then on
            self.replace(ex)
            ex = self._executor()
            return ex, ex.submit(fn, *args)

    def replace(self, ex: ProcessPoolExecutor) -> None:
        """Drop the broken pool `ex` (unless another thread did already); the next submit starts a new one."""
        with self._lock:
            if self._ex is not ex:
                return
            self._ex = None
            self.restarts += 1
        log.warning("fill worker process died; its pool is replaced", extra={"restarts": self.restarts})
        ex.shutdown(wait=False, cancel_futures=True)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the workers: wait for their fills (`timeout_s` None), or terminate them and wait at most
        `timeout_s` seconds (the daemon stops: a fill cut short is debris the node cache collects)."""
        from sluice.procpool import stop_pool

        with self._lock:
            self._closed = True
            ex, self._ex = self._ex, None
        if ex is None:
            return
        if timeout_s is None:
            ex.shutdown(wait=True, cancel_futures=True)
        else:
            stop_pool(ex, timeout_s)


# -- worker-process side ---------------------------------------------------------
# Worker-process state (worker_kind="process"): set once per process by worker_init.
_WORKER: tuple[Any, Any, Any, int] | None = None


def worker_init(manifest: Any, cache_root: str, budget: int, verify: bool, chunk_bytes: int, roots: Any = None,
                threads: int | None = None) -> None:
    """A fill worker process's state; `threads`: its encoder threads (the daemon's budget shared out)."""
    global _WORKER
    from sluice.cache import NodeCache
    from sluice.tokenize import encoder_for_manifest

    cache = NodeCache(cache_root, budget, verify_on_read=verify, collect=False, allowed_roots=roots)
    # With the cache, a tiktoken encoding the daemon built is read, not built again in every worker.
    _WORKER = (manifest, cache, encoder_for_manifest(manifest, cache=cache, threads=threads), chunk_bytes)


def worker_fill(s: int, o: int, tmp: str, ready_path: str, cancel_path: str) -> tuple[Any, ...]:
    """Write the object's token shard at `tmp` in this worker process, counting documents in `ready_path`.

    Returns ``("ok", FillStats)`` or ``("error", message, object_location)``
    (plain values: no exception objects cross the process boundary).
    """
    import os
    import struct
    from pathlib import Path

    from sluice.tokenize.tokcache import tokenize_into

    assert _WORKER is not None, "bug in sluice: worker process not initialised"
    manifest, cache, encoder, chunk_bytes = _WORKER
    src = manifest.sources[s]
    obj = src.objects[o]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    fd = os.open(ready_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        reader, stats = tokenize_into(Path(tmp), manifest, cache, encoder, s, o, chunk_bytes=chunk_bytes,
                                      on_chunk=lambda n: os.pwrite(fd, struct.pack("<Q", n), 0),
                                      cancelled=lambda: os.path.exists(cancel_path))
        reader.close()
    except SluiceError as exc:
        return ("error", str(exc) if where in str(exc) else f"{where}: {exc}", obj.location)
    finally:
        os.close(fd)
    return ("ok", stats)


def read_count(path: str) -> int:
    """The document count a worker wrote at `path` (0 if none yet; an 8-byte write is never seen torn)."""
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read(8)
    except OSError:
        return 0
    return struct.unpack("<Q", data)[0] if len(data) == 8 else 0
