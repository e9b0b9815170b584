"""The worker processes of `--worker-kind process`: whole-object fills (decode + tokenize), replaced on death.

DocSource submits one object's fill at a time to this pool. A worker that
dies (kill -9, the OOM killer, a crash in a native decoder) breaks a
`ProcessPoolExecutor` for good: every later submit raises BrokenProcessPool.
So the broken pool is dropped and the next submit starts a fresh one (the
worker initializer runs again); the caller decides whether the object's fill
is tried again (DocSource: once, and only if nothing of it was served yet).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

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
                import multiprocessing

                methods = multiprocessing.get_all_start_methods()
                ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
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

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            ex, self._ex = self._ex, None
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
