"""Process pools of the command-line tools: started deaf to Ctrl-C, stopped at once.

A terminal's Ctrl-C sends SIGINT to every process of its group: the command,
multiprocessing's fork server and the pool's workers. Only the command should
answer it (one line, exit 130: sluice.cli). A fork server still importing its
preload modules would print a KeyboardInterrupt traceback of its own, and a
worker would die mid-task (a traceback, a broken pool) or finish its task
first. So:

* `pool_context(preload)` starts the fork server (forkserver where the platform
  has it, else spawn) with SIGINT blocked, as multiprocessing's own resource
  tracker is started; the server and every worker it forks keep it blocked
  (a worker initializer may unblock it);
* `ctrl_c_deferred()` holds a Ctrl-C back while tasks are submitted: a
  submission may start a worker, and one interrupted half-way is a worker
  `stop_pool` cannot see, which then fails loudly once its parent is gone;
* `stop_pool(pool)` cancels the queued tasks and terminates the workers, for
  work whose interrupted remains are collected anyway (a node cache's fills)
  or that writes nothing (freeze's scans).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sluice import affinity


def pool_context(preload: Sequence[str] | None = None) -> Any:
    """A multiprocessing context for a ProcessPoolExecutor whose processes ignore the terminal's Ctrl-C.

    `preload`: modules the fork server imports once, so workers fork ready
    (None: multiprocessing's default, the main module). The fork server is one
    per process: one this process started before by other means is used as it is.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver, resource_tracker

    ctx = multiprocessing.get_context("forkserver")
    if preload is not None:
        ctx.set_forkserver_preload(list(preload))
    # Both processes get every CPU of the process, not this thread's one where loaderd keeps it on one
    # (sluice/affinity.py). Start the resource tracker first: starting it unblocks SIGINT in this thread again.
    with affinity.widened():
        resource_tracker.ensure_running()
    # The server inherits this thread's mask; SIGINT arriving meanwhile stays pending here.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with affinity.widened():
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return ctx


def stop_pool(pool: Any, timeout_s: float = 5.0) -> list[int]:
    """Cancel `pool`'s queued tasks and terminate its workers now (a ProcessPoolExecutor); their pids.

    Waits at most `timeout_s` seconds in all for the workers to end; one that
    has not ended by then (SIGTERM blocked or ignored) is killed, which cannot
    be refused. `_processes` is the executor's own table of workers (Python
    3.14 has `terminate_workers()` for this); its manager thread
    (`_executor_manager_thread`) has ended on return, or was given a second.
    """
    import time

    procs = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # shutdown() forgets it
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    # The executor's manager thread closes its wake-up pipe once it sees the workers gone. At exit,
    # concurrent.futures writes to that pipe without its lock: a close racing that write printed
    # "OSError: Bad file descriptor" after our one line. Let the thread finish here first.
    if manager is not None:
        manager.join(max(1.0, deadline - time.monotonic()))
    return [proc.pid for proc in procs]


def stop_threads(pool: Any, deadline: float) -> list[str]:
    """Cancel a ThreadPoolExecutor's queued tasks and wait for its running ones until `deadline`
    (time.monotonic(); infinity: until they end); the names of its threads still running then (empty:
    all ended).

    A thread cannot be stopped from outside: a task that does not look at its
    stop flag before the deadline (one long tokenizer call, one large object
    hashed) is left to the caller, which reports it and exits without it.
    `_threads` is the executor's own set of workers (CPython 3.8 to 3.14).
    """
    import time

    pool.shutdown(wait=False, cancel_futures=True)
    threads = list(getattr(pool, "_threads", ()))
    for t in threads:
        t.join(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Run the block with Ctrl-C held back; one that arrived meanwhile is raised (KeyboardInterrupt) after it.

    Only in the main thread with Python's default SIGINT handler in place
    (elsewhere the block runs as is).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if got:
        raise KeyboardInterrupt
