"""The cyclic garbage collector in the daemon: its start-up heap frozen, its pauses measured.

A collection holds the GIL for its whole duration, so in the daemon's process
it stops the IO thread too (issue 9, "Time to batch"). Measured in the daemon
after start-up (bench/serve.py's pre-tokenized corpus): a full collection
took 3-8 ms, the generation-1 collections seen while a client drains the
queue 0.7-1.1 ms; nearly all the objects they walk are the start-up heap
(manifest, plans, indexes, imported modules), alive for the daemon's life.
`freeze_startup_heap` moves them to the collector's permanent generation
(`gc.freeze`), after which a full collection of that daemon took under
0.1 ms and the generation-1 ones 0.15 ms. Raising the generation-0 threshold
was measured too and made each collection longer (1.4 ms at 10,000), so the
thresholds stay Python's.

`GcPauses` records every collection's duration (a `gc.callbacks` hook) for the
``sluice_gc_pause_seconds`` histogram. The hook runs inside whatever
allocation triggered the collection, possibly while that thread holds a
metric's lock, so it only appends to a bounded deque (no lock); the IO
thread's upkeep moves what it holds into the histogram (`drain`). Bound:
`KEPT` pauses between two drains (0.5 s apart; a busy daemon makes a few
hundred a second); at the bound the oldest are dropped and counted in
`dropped`.
"""

from __future__ import annotations

import collections
import gc
import time
from typing import Any

__all__ = ["GcPauses", "freeze_startup_heap"]

KEPT = 4096


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now (`gc.freeze`); returns how many are frozen.

    Call at the end of a daemon's start-up, before its producers run: frozen
    objects are never walked or collected again (what dies later is still
    freed by reference counting; only cycles among them would stay, and the
    collection first frees those that exist now).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Durations of the collector's runs in this process, by generation, for a histogram."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[int, float]] = collections.deque(maxlen=KEPT)
        self._started: float | None = None
        self.recorded = 0  # pauses appended, drained or not
        self.drained = 0
        self._installed = False

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pending.append((int(info.get("generation", 0)), time.perf_counter() - self._started))
            self._started = None
            self.recorded += 1

    def start(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._hook)
            self._installed = True
        return self

    def stop(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._hook)
            self._installed = False

    def drain(self, histogram_of: Any) -> int:
        """Observe every pause recorded since the last drain in `histogram_of(generation)`; returns how many."""
        n = 0
        while True:
            try:
                generation, seconds = self._pending.popleft()
            except IndexError:
                break
            histogram_of(generation).observe(seconds)
            n += 1
        self.drained += n
        return n

    @property
    def dropped(self) -> int:
        """Pauses lost to the bound: recorded, yet neither drained nor waiting."""
        return self.recorded - self.drained - len(self._pending)
