"""The daemon's GIL-bound threads on one CPU: the IO loop and the replicas' producers (`--gil-cpu`).

These threads run Python one at a time (one GIL); the GIL passes between them
every switch interval (0.2 ms) while both have work. On two CPUs each pass is
a wake-up on the other CPU, and the interpreter's hot memory (reference
counts, the objects both touch) moves between the CPUs' caches with it. Kept
on one CPU, measured on the 2-vCPU bench machine with a client draining a
five-source mixture (`bench/steady.py --daemon-args`): 19% less daemon CPU a
micro-batch and 1.6x the tokens/s (docs/loaderd.md, "One CPU for the GIL").
Their compiled calls, which run without the GIL, then no longer overlap the
IO loop's Python: the measurement includes that.

Policy (``auto``, loaderd's default; an embedded `Server`'s is ``off``): the CPU the IO loop runs on when it
starts serving. Every `CHECK_S` the upkeep looks at the CPUs' load
(/proc/stat): when other work takes more than `BUSY_SHARE` of the pinned CPU
and another CPU of the process is less busy than that, the threads move to
the least busy one (`decide`; counted: ``gil_cpu.moves`` in STATS). ``off``
leaves the scheduler to place them; a CPU number pins them there and never moves them.
Threads and processes started by a pinned thread inherit its CPU: the upkeep
gives threads of the process other than these their CPUs back
(`spread_others`), and what starts processes or sizes a pool from its CPUs
widens itself first (`sluice.affinity.widened`: the fork server, the kernel's
compile child, fastokens' first encode). Nothing is pinned where the process may run on
one CPU only, or the platform has no per-thread affinity (not Linux).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from sluice import affinity

__all__ = ["BUSY_SHARE", "CHECK_S", "GilCpu", "decide"]

log = logging.getLogger("sluice.loaderd")

CHECK_S = 2.0  # how often the pinned CPU's load is looked at
BUSY_SHARE = 0.25  # other work's share of the pinned CPU above which the threads move


def decide(cpu: int, busy: dict[int, int], ours: int, ticks: float) -> int | None:
    """Where `auto` moves the threads after a check (None: they stay), from the load since the last one:
    `busy`, busy clock ticks per CPU of the process; `ours`, the pinned threads' ticks; `ticks`, one CPU's
    clock ticks in the window. They move when other work takes more than `BUSY_SHARE` of the pinned CPU and
    another CPU is less busy than that other work: to the least busy (the lowest of equals). Under the same
    load the CPU left is then busier than the one taken, so the next check does not move them back.

    A pinned CPU that the daemon's own threads fill while another idles is no reason to move: two replicas
    drained on 2 CPUs, one of them 30% busy, gave 99 M tokens/s pinned, 84 released, 76 never pinned
    (docs/loaderd.md, "One CPU for the GIL")."""
    other = busy.get(cpu, 0) - ours
    best = min((c for c in busy if c != cpu), key=lambda c: (busy[c], c), default=None)
    if best is not None and other > BUSY_SHARE * ticks and busy[best] < other:
        return best
    return None


def _cpu_times() -> dict[int, int]:
    """Busy clock ticks per CPU since boot (/proc/stat: user, nice, system, irq, softirq, steal)."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3:4].isdigit():
                name, *v = line.split()
                n = [int(x) for x in v[:8]]
                out[int(name[3:])] = n[0] + n[1] + n[2] + n[5] + n[6] + n[7]
    return out


def _thread_ticks(tid: int) -> int:
    """Clock ticks thread `tid` of this process ran (utime + stime); 0 when it is gone."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _current_cpu() -> int:
    """The CPU the calling thread last ran on (/proc/thread-self/stat, field 39)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


class GilCpu:
    """Which CPU the GIL-bound threads share, and keeping it so (the IO thread's; `tick` from the upkeep)."""

    def __init__(self, mode: str | int) -> None:
        self.mode = mode
        self.active = mode != "off" and affinity.supported() and len(affinity.CPUS) > 1
        self.cpu: int | None = None
        self.moves = 0
        self.spread_threads = 0  # threads that had inherited the pin and were given their CPUs back
        self._tids: set[int] = set()
        self._next = 0.0
        # (monotonic time, busy ticks per CPU, our threads' ticks) at the last check
        self._last: tuple[float, dict[int, int], int] | None = None

    def start(self, threads: list[threading.Thread]) -> None:
        """Pin the calling thread (the IO loop) and `threads` (the producers, started) to one CPU: `mode`'s, or
        for "auto" the one the caller runs on now."""
        if not self.active:
            return
        self._tids = {threading.get_native_id(), *(t.native_id for t in threads if t.native_id is not None)}
        try:
            self._pin(self.mode if isinstance(self.mode, int) else _current_cpu())
        except (OSError, ValueError, IndexError) as exc:  # (a CPU this process may not use: an embedded config)
            self._stop(exc)
        self._next = time.monotonic() + CHECK_S

    def _pin(self, cpu: int) -> None:
        for tid in list(self._tids):
            try:
                os.sched_setaffinity(tid, {cpu})
            except ProcessLookupError:  # (a thread that ended: nothing to keep)
                self._tids.discard(tid)
        self.cpu = cpu

    def _stop(self, exc: Exception) -> None:
        """Leave the threads to the scheduler from now on, said once."""
        self.active = False
        log.warning(f"loaderd: --gil-cpu {self.mode}: keeping the GIL's threads on one CPU stopped ({exc}); "
                    "the scheduler places them from now on")
        self.release()

    def tick(self, now: float) -> None:
        """Upkeep (every 0.5 s): threads that inherited the pin spread again; every `CHECK_S` under "auto",
        a move off a CPU that other work keeps busy. Never raises: a failure turns it off, said once."""
        if not self.active or self.cpu is None:
            return
        try:
            self.spread_others()
            if self.mode == "auto" and now >= self._next:
                self._next = now + CHECK_S
                self._check()
        except (OSError, ValueError, IndexError) as exc:
            self._stop(exc)

    def spread_others(self) -> None:
        """Every other thread of the process pinned to our one CPU (it inherited it) gets the process's CPUs."""
        pinned = {self.cpu}
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            if tid in self._tids:
                continue
            try:
                if os.sched_getaffinity(tid) == pinned:
                    os.sched_setaffinity(tid, affinity.CPUS)
                    self.spread_threads += 1
            except OSError:  # (ended meanwhile)
                continue

    def _check(self) -> None:
        """Move to the least busy CPU when other work takes more than `BUSY_SHARE` of ours (since the last
        check) and that CPU is less busy than the other work on ours."""
        now, cpus = time.monotonic(), _cpu_times()
        ours = sum(_thread_ticks(t) for t in self._tids)
        last, self._last = self._last, (now, cpus, ours)
        if last is None or self.cpu not in cpus:
            return
        ticks = (now - last[0]) * os.sysconf("SC_CLK_TCK")  # (the clock ticks of one CPU since the last check)
        busy = {c: cpus[c] - last[1].get(c, cpus[c]) for c in affinity.CPUS if c in cpus}
        mine = ours - last[2]
        best = decide(self.cpu, busy, mine, ticks)
        if best is not None:
            log.info("loaderd: the GIL's threads move", extra={
                "from_cpu": self.cpu, "to_cpu": best, "other_work_share": round((busy[self.cpu] - mine) / ticks, 2)})
            self._pin(best)
            self.moves += 1
            self._last = None

    def release(self) -> None:
        """Give the pinned threads the process's CPUs again (a stop; a failure)."""
        if self.cpu is None:
            return
        for tid in self._tids:
            try:
                os.sched_setaffinity(tid, affinity.CPUS)
            except OSError:
                pass
        self.cpu = None

    def stats(self) -> dict[str, Any]:
        """STATS ``gil_cpu``: the mode, the CPU now (None: not pinned), moves, threads spread."""
        return {"mode": self.mode, "cpu": self.cpu, "moves": self.moves, "spread_threads": self.spread_threads}
