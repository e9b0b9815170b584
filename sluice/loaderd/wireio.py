"""The daemon's sockets and their bookkeeping: the ROUTER, the producers' wake-ups, the memory guard.

`WireIO` binds the ROUTER (endpoint rules and the run token: endpoint.py)
with its connection monitor, sends replies without ever blocking (a reply
whose client is gone or full is counted, never a delivery), carries the
producer threads' wake-ups to the IO thread (an inproc PUSH per thread into
one PULL), runs the memory guard (memguard.py) and, when it trips, drops every
connection and listens again (`reset`). The IO loop (server.py) polls its
sockets; everything here runs on the IO thread but `notify`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from sluice.loaderd import heldzmq, memguard
from sluice.loaderd.config import ServerConfig
from sluice.loaderd.endpoint import (Connections, TokenAuthenticator, bind_router, check_endpoint,
                                     private_ipc_endpoint, rebind_router, send_frames)

__all__ = ["WireIO"]

_NOTIFY = "inproc://loaderd-notify-{}"
_POLLIN = int(zmq.POLLIN)

_HELD = heldzmq.available()  # (the GIL kept through libzmq's calls: heldzmq.py)


class WireIO:
    """The ROUTER, the wake-up sockets and the memory guard of one daemon (`bind` first, `close` last)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.endpoint: str | None = None
        self.router: zmq.Socket | None = None
        self.pull: zmq.Socket | None = None  # the producers' wake-ups (`notify`), and the memory guard's
        self.connections: Connections | None = None
        self.auth: Any = None
        self.memory_guard: memguard.MemoryGuard | None = None
        self.undeliverable = 0  # replies whose client was gone (or full): never counted as deliveries
        self.wire_resets = 0  # every connection dropped to bound memory (memguard.py)
        self._notify_addr = _NOTIFY.format(id(self))
        self._local = threading.local()
        self._notify_lock = threading.Lock()
        self._notify_socks: list[zmq.Socket] = []
        self._closing = False  # set by close(), under _notify_lock: no notify socket made or used after it

    def bind(self) -> str:
        """Bind the ROUTER and the wake-up socket; return the endpoint (BindError when it cannot be bound)."""
        endpoint = self.config.endpoint or private_ipc_endpoint()
        curve = self.config.curve
        check_endpoint(endpoint, curve=curve is not None, token=self.config.token is not None)
        self.router, self.endpoint, self.auth = bind_router(self.ctx, endpoint, curve=curve,
                                                            limits=self.config.limits, token=self.config.token)
        self.connections = Connections(self.router)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self._notify_addr)
        return self.endpoint

    def start_memory_guard(self, queues: int) -> None:
        """Start the memory guard unless it is off; before the producers (`queues` of them), whose queues
        and decoded objects the auto limit counts over the memory measured here."""
        c = self.config
        if c.memory_limit == "off" or not memguard.available():
            return
        limit = c.memory_limit
        if limit == "auto":
            start = memguard.AnonMemory()
            try:
                limit = memguard.auto_limit(start(), c.queue_bytes, queues, c.decoded_bytes)
            finally:
                start.close()
        assert isinstance(limit, int)
        self.memory_guard = memguard.MemoryGuard(limit, self.ctx, self._notify_addr)
        self.memory_guard.start()

    def register(self, poller: zmq.Poller) -> None:
        """Poll the ROUTER and the connection monitor (again after a `reset`)."""
        assert self.router is not None and self.connections is not None, "bind() first"
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.connections.socket, zmq.POLLIN)

    def woken(self) -> tuple[set[int], bool]:
        """The replicas whose producers announced steps since the last look, and whether the memory guard
        tripped (call when `pull` is readable)."""
        assert self.pull is not None
        ready: set[int] = set()
        while True:  # (readable per the poll; then looked at, not tried: a zmq.Again costs 5 us)
            try:  # (the GIL kept where it can be: heldzmq.py)
                got = heldzmq.receive_small(self.pull, 32) if _HELD else self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if got is not None:  # (only this daemon's producers and memory guard connect: a replica or -1)
                ready.add(int(got))
            if not self.pull.get(zmq.EVENTS) & _POLLIN:
                break
        if -1 in ready:  # the memory guard's wake (memguard.MemoryGuard.WAKE)
            ready.discard(-1)
            return ready, self.memory_guard is not None and self.memory_guard.tripped
        return ready, False

    def route(self, frames: list[Any]) -> bool:
        """Send without blocking; False if the peer is gone or its queue is full (ROUTER_MANDATORY).

        What did not leave is never a delivery: a client that went away with GETs
        parked releases no step a live client still needs."""
        assert self.router is not None
        try:
            send_frames(self.router, frames)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.undeliverable += 1
            return False

    def reset(self, poller: zmq.Poller) -> tuple[int, int, bool]:
        """Drop every connection and what libzmq holds for them; listen again at the same endpoint.

        Called on the IO thread when the memory guard trips (the caller drops
        the parked GETs and takes a new instance ID first). Returns the memory
        before and after, and whether dropping the wire freed it."""
        guard = self.memory_guard
        assert guard is not None and self.router is not None and self.connections is not None
        before = guard.read()
        poller.unregister(self.router)
        poller.unregister(self.connections.socket)
        self.connections.close(self.router)
        self.router.close(0)
        self.router = None
        # libzmq frees the closed pipes in its own threads: give it a moment, then hand the heap back
        deadline = time.monotonic() + 1.0
        after = before
        while True:
            memguard.trim()
            after = guard.read()
            if after <= guard.limit or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        assert self.endpoint is not None
        self.router = rebind_router(self.ctx, self.endpoint, curve=self.config.curve, limits=self.config.limits,
                                    token=self.config.token)
        self.connections = Connections(self.router)
        self.register(poller)
        self.wire_resets += 1
        return before, after, guard.handled(after)

    def notify(self, replica: int) -> None:
        """Called from a producer thread: wake the IO thread (socket per thread).

        Under `_notify_lock`, and nothing once `close` began: a socket made or
        used while `close` closes them would keep `Context.term()` waiting (or
        race libzmq's socket, which is not thread-safe). The lock is uncontended
        but for `close` (one acquisition per producer call, about 0.1 us).

        The send keeps the GIL (heldzmq.py) where it can: through pyzmq it
        released the GIL and waited to get it back from the IO thread, up to
        the switch interval, once per producer call."""
        with self._notify_lock:
            if self._closing:
                return
            sock = getattr(self._local, "sock", None)
            if sock is None:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self._notify_addr)
                self._local.sock = sock
                self._notify_socks.append(sock)
            msg = str(replica).encode()
            try:  # never blocks while holding the lock `close` needs
                if not (_HELD and heldzmq.send(sock, [msg], 1 << 62)):
                    sock.send(msg, zmq.NOBLOCK)
            except zmq.Again:
                # 1,000 wake-ups unread (the high-water mark): the IO thread is far behind, not idle. Unread
                # wake-ups are bounded by the steps made between two passes of its loop (each replica's step
                # lead), so this is not reached while it runs; after it stopped, nothing waits for a wake-up.
                pass

    def closing(self) -> None:
        """From now on a producer thread that finishes a step opens no socket and sends nothing (one made
        after the sockets were closed kept `Context.term()` waiting forever); stops the memory guard."""
        with self._notify_lock:
            self._closing = True
        if self.memory_guard is not None:
            self.memory_guard.stop()

    def close(self, left: Any) -> list[str]:
        """Close every socket, stop the auth, end the context within `left()` seconds; "zmq context" in the
        list when libzmq did not finish (a socket left open)."""
        with self._notify_lock:  # (a producer still running cannot be in `notify` meanwhile)
            for s in self._notify_socks:
                s.close(0)
            self._notify_socks.clear()
        if self.router is not None:
            if self.connections is not None:
                self.connections.close(self.router)
            self.router.close(0)
        if self.pull is not None:
            self.pull.close(0)
        if isinstance(self.auth, TokenAuthenticator):
            self.auth.stop(left())
        elif self.auth is not None:  # pyzmq's (CurveZMQ): its thread polls and leaves at once
            self.auth.stop()
        term = threading.Thread(target=self.ctx.term, name="loaderd-zmq-term", daemon=True)
        term.start()
        term.join(max(left(), 0.1))  # (every socket is closed: a spent deadline still gives it its milliseconds)
        return ["zmq context"] if term.is_alive() else []
