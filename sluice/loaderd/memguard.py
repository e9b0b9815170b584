"""The daemon's memory bound against what libzmq buffers for its peers (docs/hardening.md, issue 27).

libzmq hands a multipart message to the daemon only once every frame of it
has arrived, and bounds each frame (ZMQ_MAXMSGSIZE), never the frame count;
its receive high-water mark counts whole messages per connection. So a peer
that passed the handshake (a token holder) can make libzmq's IO thread hold
any number of bytes before the daemon sees one frame: three connections
sending 250 x 4 MiB frames at once took the daemon to 3,061 MiB. Nothing in
libzmq 4.3 bounds it, and the daemon cannot tell which connection holds what.

What bounds it: `MemoryGuard` samples the daemon's anonymous resident memory
(`/proc/self/statm`: resident minus shared pages, so the node cache's mapped
files do not count) every `INTERVAL_S` in its own thread, or every
`CALM_INTERVAL_S` while it is calm: at least `CALM_MARGIN` under the limit and
grown by less than `RISE` since the sample before. Each sample is a wake-up of
a thread (measured 70-130 us of CPU on a 2-vCPU VM, where a 10 ms period kept
1.2-2% of a core busy in an idle daemon); a flood leaves the calm state at its
first sample, so it passes the limit within a calm interval only if it brings
`CALM_MARGIN` in `CALM_INTERVAL_S` (over 5 GiB/s). Above the limit it
wakes the IO thread, which drops every connection and what libzmq holds for
them (`Server._reset_wire`, `WireIO.reset`: the ROUTER is closed and bound again, freed memory
is handed back to the system with `malloc_trim`) and takes a new instance ID,
so clients recover as after a daemon restart: within their `timeout_s` they
probe, see the new instance and RESTORE their last state. Memory above the
limit that a reset does not free is not the wire's: logged once, and the guard
waits until the memory is below the limit again before it acts again.

The limit (`--memory-limit`, default `auto`): the anonymous memory at start
plus the declared data-path bounds (`--queue-bytes` per served replica,
`--decoded-bytes`) plus `HEADROOM` for the Python heap, the compiled kernel and
requests in flight. Overshoot is what arrives within one sample interval plus
the reset itself.
"""

from __future__ import annotations

import os
import threading

import zmq

INTERVAL_S = 0.01  # the period near the limit or while memory grows
CALM_INTERVAL_S = 0.05  # the period while calm (see above)
CALM_MARGIN = 256 << 20
RISE = 8 << 20
HEADROOM = 512 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


class AnonMemory:
    """Reads this process's anonymous resident bytes (resident minus shared pages) from /proc/self/statm."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)

    def __call__(self) -> int:
        fields = os.pread(self._fd, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE

    def close(self) -> None:
        os.close(self._fd)


def available() -> bool:
    """True where /proc/self/statm can be read (Linux); elsewhere the daemon runs without the guard."""
    try:
        AnonMemory().close()
    except OSError:
        return False
    return True


def auto_limit(start_bytes: int, queue_bytes: int, replicas: int, decoded_bytes: int) -> int:
    """`--memory-limit auto`: memory at start + the data path's declared bounds + HEADROOM."""
    return start_bytes + queue_bytes * replicas + decoded_bytes + HEADROOM


def period_after(used: int, last: int, limit: int) -> float:
    """Seconds to the next sample after one of `used` bytes (`last` the sample before): `CALM_INTERVAL_S` while
    at least `CALM_MARGIN` under `limit` and grown by less than `RISE`, else `INTERVAL_S`."""
    return CALM_INTERVAL_S if used < limit - CALM_MARGIN and used - last < RISE else INTERVAL_S


def trim() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim); a no-op elsewhere.

    libzmq allocates large frames from the heap once glibc has raised its mmap
    threshold, and freed heap memory otherwise stays resident: the guard would
    see the peak after a reset freed it.
    """
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryGuard:
    """Samples anonymous memory every `INTERVAL_S` (`CALM_INTERVAL_S` while calm); above `limit` wakes the IO thread
    once and waits for `handled`.

    The wake is `WAKE` sent to the IO thread's notification socket at `wake_addr`
    (an inproc PULL; the guard's PUSH lives and dies in the guard's thread, so
    none is opened after `stop()`). The thread only reads and wakes; the IO thread owns the sockets and does
    the reset, then calls `handled(after)` with the memory it left: below the
    limit, the guard watches again; above, it waits until the memory is
    below the limit before it can trip again (`over_limit_not_wire` counts it).
    """

    WAKE = b"-1"  # not a replica number: the IO thread's notification socket carries those

    def __init__(self, limit: int, ctx: zmq.Context, wake_addr: str) -> None:
        self.limit = limit
        self.read = AnonMemory()
        self._ctx, self._wake_addr = ctx, wake_addr
        self._tripped = threading.Event()
        self._stop = threading.Event()
        self._disarmed = False
        self.peak = 0
        self.samples = 0
        self.trips = 0
        self.over_limit_not_wire = 0
        self._thread = threading.Thread(target=self._run, name="loaderd-memguard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.read.close()

    @property
    def tripped(self) -> bool:
        return self._tripped.is_set()

    def handled(self, after: int) -> bool:
        """The IO thread reset the wire and `after` bytes remain; True if that brought them under the limit."""
        ok = after <= self.limit
        if not ok:
            self.over_limit_not_wire += 1
            self._disarmed = True  # not the wire's memory: wait for it to go below the limit
        self._tripped.clear()
        return ok

    def _run(self) -> None:
        wake = self._ctx.socket(zmq.PUSH)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)
        try:
            last, period = self.read(), INTERVAL_S
            while not self._stop.wait(period):
                used = self.read()
                self.peak = max(self.peak, used)
                period, last = period_after(used, last, self.limit), used
                self.samples += 1
                if self._disarmed:
                    self._disarmed = used > self.limit
                    continue
                if used > self.limit and not self._tripped.is_set():
                    self.trips += 1
                    self._tripped.set()
                    try:
                        wake.send(self.WAKE, zmq.NOBLOCK)
                    except zmq.Again:  # wakes already queued: the IO thread will look
                        pass
        except zmq.ZMQError:  # the context is ending (shutdown): nothing left to guard
            pass
        finally:
            wake.close(0)
