"""The producer gives its core away within a call, not only after it: what bounds a GET's wait on a busy daemon.

A producer call of 16 steps is 1.5-3 ms of CPU: the compiled kernel's calls
(no GIL) between stretches of Python (locating documents, one entry a step).
The IO thread shares the producer's CPU (`--gil-cpu`, gilcpu.py), and a thread
woken onto a CPU the producer holds waits for the scheduler to preempt it:
traced in a busy drain (`bench/serve.py --only ttb`, the IO thread's GETs and
replies and the producer's calls timed on one clock), a GET the client sent
as a call began reached the IO thread only when the call ended, 2-3 ms
later; the switch interval (0.2 ms) does not help, since the IO thread must
run to ask for the GIL. On one CPU, a thread beside the producer's calls saw
gaps of up to 4.7 ms; with the producer yielding before each kernel call,
0.58 ms. `os.sched_yield` hands the CPU to a thread that waits for it and
returns at once when none does (a system call, about a microsecond).

`give_way()` yields when `EVERY_S` has passed since this thread last did,
so a call's stretches between two yields stay short while a call without
anyone waiting pays a few syscalls. It is called before each kernel call
(`Paced`, the faces `jitload` gives `jit.Kernel`) and between a call's
entries (`StepMaker._produce`); a call's end yields whatever the interval
(`yield_now`, steploop.py).
Nothing served depends on it. What a yield cannot do: a thread that used
more than its share of the CPU is not eligible when it wakes (EEVDF) and
runs at the next scheduler tick whatever this thread yields
(bench/results/README.md, "Stop 38").
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["EVERY_S", "Paced", "give_way", "yield_now", "yields"]

EVERY_S = 0.0002  # the longest a thread runs between two yields, where it calls `give_way` often enough

_sched_yield = getattr(os, "sched_yield", None)  # POSIX; elsewhere nothing to give away
_mine = threading.local()  # this thread's last yield (perf_counter seconds) and its count


def give_way() -> None:
    """Yield this thread's CPU (`os.sched_yield`) if `EVERY_S` passed since it last did here (or it never did)."""
    last = getattr(_mine, "t", None)
    if last is None or time.perf_counter() - last >= EVERY_S:
        yield_now()


def yield_now() -> None:
    """Yield this thread's CPU now (a call's end: steploop.py), whenever it last did."""
    if _sched_yield is None:
        return
    _sched_yield()
    _mine.t = time.perf_counter()
    _mine.n = getattr(_mine, "n", 0) + 1


def yields() -> int:
    """The yields made on this thread (`give_way`'s and `yield_now`'s)."""
    return getattr(_mine, "n", 0)


class Paced:
    """A kernel module's face (`jitdraws` / `jitrows`: numba's module, the ahead-of-time module's face, or an
    uncompiled one) whose functions call `give_way` first; anything else is read through."""

    def __init__(self, face: Any) -> None:
        self._face = face

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._face, name)
        if not callable(fn):
            return fn

        def wrapped(*args: Any) -> Any:
            give_way()
            return fn(*args)

        wrapped.__name__ = name
        self.__dict__[name] = wrapped  # (made once a name)
        return wrapped
