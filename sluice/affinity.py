"""CPU affinity of threads (a shared leaf): the process's CPUs, and a thread that must not keep a pin it inherited.

loaderd keeps its GIL-bound threads on one CPU (`sluice.loaderd.gilcpu`). A
thread or process started by a pinned thread inherits its one CPU (Linux
copies the creator's mask), which would put a tokenizer's threads, a kernel's
compile or every worker the fork server makes on that CPU. A process is
started inside `widened()`, which gives the calling thread the CPUs the
process started with for that while (`procpool.pool_context`'s fork server,
the kernel's compile child). Threads started by a pinned thread get them
back from the daemon's upkeep (`GilCpu.spread_others`).

Where the platform has no affinity calls (not Linux) everything here does
nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CPUS", "count", "supported", "widened"]


def supported() -> bool:
    """Whether this platform sets per-thread affinity (`os.sched_setaffinity` on a thread ID: Linux)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


# The CPUs this process may run on, read when sluice first imports this module (before any thread was pinned);
# empty where the platform has no affinity calls.
CPUS: frozenset[int] = frozenset(os.sched_getaffinity(0)) if supported() else frozenset()


def count() -> int:
    """How many CPUs this process may run on (`CPUS`; the CPU count where the platform has no affinity calls):
    not the calling thread's own, which may be one CPU (loaderd's GIL-bound threads)."""
    return len(CPUS) or os.cpu_count() or 1


@contextmanager
def widened() -> Iterator[None]:
    """The calling thread on every CPU of `CPUS` for the block (a process it starts inherits them), then on
    what it had before. Nothing where the platform has no affinity calls or the thread has them all."""
    before = os.sched_getaffinity(0) if CPUS else CPUS
    if before == CPUS:
        yield
        return
    try:
        os.sched_setaffinity(0, CPUS)
    except OSError:  # (a CPU taken away since, by a cgroup: the thread keeps what it has)
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError:
            pass
