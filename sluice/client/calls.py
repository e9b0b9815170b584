"""The client's calls to the daemon: connecting (HELLO, RESTORE), one request and its reply, recovery.

`Client` (iterator.py) inherits these methods; the iteration (GETs in
flight, the yield cursor) stays there. Here: the socket and the request
headers, HELLO on a fresh socket (learning the run and dataset IDs when not
given), RESTORE of the held state on a restarted daemon, one request and
its reply (`_call`; other expected replies are stashed for the iterator by
`_await`), recovery after silence (the same daemon, only slow, or a
restarted one) and STATS.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from typing import Any, Self

import zmq

from sluice.client import arena as client_arena
from sluice.client import ring as client_ring
from sluice.client.config import ClientConfig
from sluice.client.replies import Batch, read_reply
from sluice.client.transport import close_dealer, dealer, poll_or_refused, recv_within, send_or_refused
from sluice.errors import DaemonError, DaemonUnavailable, FencedError, ProtocolError, StateError
from sluice.wire import decoding, encoding, errorcodes, protocol

__all__ = ["DaemonCalls"]


class DaemonCalls:
    """Connection and request methods of `Client` (see the module docstring)."""

    # Set by Client.__init__.
    config: ClientConfig
    endpoint: str
    replica: int
    replicas: int
    run_id: str | None
    dataset_id: str | None
    curve: Any
    timeout_s: float
    reconnect_s: float
    connect_s: float
    peers: int
    credits: int
    ring: bool
    limits: protocol.Limits
    generation: int
    instance: str | None
    info: dict[str, Any]
    reconnects: int
    restore_retries: int
    batches: int
    total_wait_s: float
    _token: str | None
    _ctx: zmq.Context
    _sock: zmq.Socket | None
    _ring: client_ring.ClientRing | None
    _arena: client_arena.ClientArena | None
    _ids: itertools.count
    _inflight: deque[tuple[int, int, int]]
    _stash: dict[int, Batch | protocol.Message]
    _abandoned: OrderedDict[int, None]
    _state: dict[str, Any] | None  # FencedState: the state after the last completed step (a property)
    _start_step: int | None
    _cursor: tuple[int, int] | None
    _send_cursor: tuple[int, int] | None
    _skip_before: tuple[int, int] | None
    _need_restore: bool
    _start_over: bool
    _bump: bool
    _newer_instance: str | None

    # -- connection --------------------------------------------------------------
    def _new_socket(self) -> zmq.Socket:
        return dealer(self._ctx, self.endpoint, curve=self.curve, token=self._token)

    def _header(self, kind: str, *, step: int = -1, micro: int = -1, body: dict[str, Any] | None = None,
                request_id: int | None = None) -> protocol.Header:
        # Requests after HELLO name the daemon instance they are meant for: a restarted daemon refuses them instead
        # of serving (and releasing) steps for a request sent to its predecessor (zmq reconnects an old socket).
        return protocol.Header(kind=kind, run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation,
                               replica=self.replica, step=step, micro=micro,
                               request_id=next(self._ids) if request_id is None else request_id,
                               instance="" if kind == protocol.HELLO else self.instance or "",
                               body=self._with_token(body or {}))

    def _with_token(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "token": self._token} if self._token is not None else body

    def _hello(self, sock: zmq.Socket, timeout_s: float) -> protocol.Message | None:
        body = {"replicas": self.replicas, "peers": self.peers, **client_ring.hello_fields(self)}
        return self._ask(sock, self._header(protocol.HELLO, body=body), timeout_s)

    def _ask(self, sock: zmq.Socket, h: protocol.Header, timeout_s: float) -> protocol.Message | None:
        """Send `h` on a fresh socket and return its reply (ERROR replies raise); None on silence."""
        if not send_or_refused(sock, encoding.encode(h), timeout_s, self.endpoint):
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poll_or_refused(sock, left, self.endpoint):
                return None
            msg = decoding.decode(sock.recv_multipart(copy=False), self.limits)
            if msg.header.request_id == h.request_id:
                if msg.kind == protocol.ERROR:
                    errorcodes.raise_for(msg)
                return msg

    def connect(self) -> None:
        """Connect (or reconnect) and say HELLO; RESTORE the held state if the daemon needs it.

        A first connection fails fast when nothing listens at the endpoint (a setup error: after `connect_s`,
        the OS refuses the ipc file or tcp port); a daemon that is there but slow, or a reconnection to a
        restarting one, is waited for up to `reconnect_s`. A daemon that goes silent during the RESTORE (killed
        after HELLO) is looked for again, and the RESTORE repeated, until then.
        """
        t0 = time.monotonic()
        deadline = t0 + self.reconnect_s
        fast = t0 + self.connect_s if self.instance is None else deadline
        while not self._connect_once(t0, fast, deadline):
            self.restore_retries += 1

    def _connect_once(self, t0: float, fast: float, deadline: float) -> bool:
        """One HELLO (retried until `deadline`) and RESTORE; False if the RESTORE met silence before it."""
        from sluice.client.probe import nothing_listens

        while True:
            sock = self._new_socket()
            until = fast if time.monotonic() < fast else deadline
            wait_s = min(self.timeout_s, max(0.05, until - time.monotonic()))
            reply = self._hello(sock, wait_s) if self._identify(sock, wait_s) else None
            if reply is not None:
                break
            close_dealer(sock)
            now = time.monotonic()
            if now >= deadline or (fast <= now < deadline and nothing_listens(self.endpoint)):
                raise DaemonUnavailable(f"no loaderd answered at {self.endpoint} within {now - t0:.0f} s (is it "
                                        "running, and is this the endpoint it printed on start?)")
            time.sleep(0.05)
        if self._sock is not None:
            close_dealer(self._sock)
        self._sock = sock
        _check_hello(reply.body, self.endpoint)
        restarted = self.instance is not None and reply.body["instance"] != self.instance
        self.instance = reply.body["instance"]
        self.info = dict(reply.body)
        self._ring, self._arena = client_ring.take_offers(self._ring, self._arena, self.info, self)
        daemon_gen = int(reply.body["generation"])
        if daemon_gen > self.generation and self._cursor is not None and not self._need_restore:
            raise FencedError(f"loaderd generation {daemon_gen} is newer than this client's {self.generation}: "
                              "another trainer restored this run")
        self.generation = max(self.generation, daemon_gen)
        if self._cursor is None:
            if self._state is not None:
                self._cursor = (int(self._state["step"]) + 1, 0)
            else:
                start = self._start_step if self._start_step is not None else int(reply.body["floor_step"])
                self._cursor = (start, 0)
        if restarted or self._need_restore:
            try:
                self._restore_now()
            except DaemonUnavailable as exc:
                if isinstance(exc, DaemonError) or time.monotonic() >= deadline:
                    raise
                self._need_restore = True  # silence after HELLO: the daemon died; restore on the next one
                return False
        self._inflight.clear()
        self._stash.clear()
        self._send_cursor = self._cursor
        return True

    def batch_split(self) -> dict[str, int]:
        """The run spec's batch split as the daemon serves it (connecting first if this client has not).

        ``micro_batch`` (sequences per micro-batch), ``micro_per_step`` (this
        replica's micro-batches per global step), ``replicas`` (R) and
        ``global_batch`` (sequences per global step, all replicas): a trainer
        checks its own batch settings against them before its first step.
        """
        if not self.info:
            self.connect()
        info = self.info
        mb, mps, replicas = int(info["micro_batch"]), int(info["micro_per_step"]), int(info["replicas"])
        return {"micro_batch": mb, "micro_per_step": mps, "replicas": replicas,
                "global_batch": int(info.get("global_batch", mb * mps * replicas))}

    def _identify(self, sock: zmq.Socket, timeout_s: float) -> bool:
        """Learn the run ID and dataset ID from the daemon if not given (a STATS without IDs); False on silence."""
        if self.run_id is not None and self.dataset_id is not None:
            return True
        h = protocol.Header(kind=protocol.STATS, replica=self.replica, request_id=next(self._ids),
                            body=self._with_token({}))
        reply = self._ask(sock, h, timeout_s)
        if reply is None:
            return False
        self.run_id = self.run_id if self.run_id is not None else reply.header.run_id
        self.dataset_id = self.dataset_id if self.dataset_id is not None else reply.header.dataset_id
        return True

    def _restore_now(self) -> None:
        """RESTORE the last completed state (or nothing if we are at the daemon's start)."""
        assert self._sock is not None and self._cursor is not None
        self._need_restore = False
        if self._bump:  # reset() without fence(): take the generation after the daemon's
            self._bump = False
            self.generation += 1
        step, micro = self._cursor
        if micro:
            self._skip_before = (step, micro)  # re-request the whole step, drop what we yielded
            self._cursor = (step, 0)
        if self._state is None and self._start_over:
            reply = self._call(self._header(protocol.RESTORE, step=-1, body={"initial": True}))
            self.generation = max(self.generation, int(reply.body.get("generation", self.generation)))
            return
        if self._state is None:
            if self._cursor[0] != int(self.info.get("floor_step", 0)):
                raise StateError(f"client of replica {self.replica} has no data state to restore step "
                                 f"{self._cursor[0]} on a restarted daemon")
            return
        reply = self._call(self._header(protocol.RESTORE, step=int(self._state["step"]), body={"state": self._state}))
        self.generation = max(self.generation, int(reply.body.get("generation", self.generation)))

    def _call(self, h: protocol.Header) -> protocol.Message:
        """Send one request and wait for its reply (ERROR replies raise)."""
        assert self._sock is not None
        self._sock.send_multipart(encoding.encode(h), copy=False)
        self._newer_instance = None
        reply = self._await(h.request_id, self.timeout_s)
        if reply is None and self._newer_instance is not None:
            raise DaemonUnavailable(f"loaderd at {self.endpoint} restarted: instance {self._newer_instance} answered "
                                    f"{h.kind} sent to instance {self.instance}")
        if reply is None:
            raise DaemonUnavailable(f"loaderd at {self.endpoint} did not answer {h.kind} within {self.timeout_s} s")
        if type(reply) is Batch:  # a BATCH under this request's ID: read in full, as the caller checks any reply
            reply = reply.message(self.limits)
        if reply.kind == protocol.ERROR:
            errorcodes.raise_for(reply)
        return reply

    def close(self) -> None:
        if self._sock is not None:
            close_dealer(self._sock)
            self._sock = None
        self._ring = self._arena = client_ring.released(self._ring, self._arena)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replies -------------------------------------------------------------------
    def _await(self, request_id: int, timeout_s: float) -> Batch | protocol.Message | None:
        """The reply to `request_id`; other expected replies are stashed; None on timeout.

        A BATCH the daemon wrote comes as a `Batch` (replies.py: one typed decode),
        any other message as `decoding.decode` reads it.
        """
        if request_id in self._stash:
            return self._stash.pop(request_id)
        assert self._sock is not None
        deadline = time.monotonic() + timeout_s
        outstanding: set[int] | None = None  # built only when a reply comes out of order
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # (arrays in this connection's ring: copied out now, before any other GET may free their slot)
            got = client_ring.resolve(self._ring, recv_within(self._sock, left), self._arena)
            if got is None:  # a wait slice ended (the deadline decides), or a reply in the ring of an
                continue  # earlier connection (its request was sent again since)
            wanted = None
            for frames in got:  # (one reply; or several, joined by the daemon: docs/protocol.md)
                msg, h = read_reply(frames, self.limits)
                if self.instance is not None and h.instance and h.instance != self.instance:
                    self._newer_instance = h.instance
                    return None  # a restarted daemon answering old requests: treat as silence
                if msg.kind == protocol.RING:  # a new ring for this connection (its last expired while we were quiet)
                    self._ring = client_ring.take_offer(self._ring, msg.body.get("ring"), self)
                    continue
                rid = h.request_id
                if rid in self._abandoned:
                    continue  # a reply to a request we re-sent: the new request's reply counts
                if rid == request_id:
                    wanted = msg
                    continue
                if outstanding is None:
                    outstanding = {r for r, _, _ in self._inflight}
                if rid in outstanding and rid not in self._stash:
                    self._stash[rid] = msg
                    continue
                raise ProtocolError(f"loaderd sent a reply to request {rid} ({msg.kind} step {h.step} micro "
                                    f"{h.micro}) that is not outstanding: a repeated or unrequested message")
            if wanted is not None:
                return wanted

    def _recover(self, force: bool = False) -> dict[str, Any] | None:
        """Silence or shutdown: is it the same daemon (slow: its HELLO_OK body) or a restarted one (None)?"""
        if not force:
            # An unanswered probe proves nothing (a busy daemon may answer late): probe until some instance
            # answers. Replacing the socket while the same daemon lives would orphan our pending GETs, which it
            # would still serve to the closed socket and so release steps we need.
            deadline = time.monotonic() + self.reconnect_s
            while True:
                probe = self._new_socket()
                try:
                    reply = self._hello(probe, min(self.timeout_s, 2.0))
                finally:
                    close_dealer(probe)
                if reply is not None and reply.body.get("instance") == self.instance:
                    # Alive and busy (a cold step, a slow peer): keep the socket and the requests. The daemon answers
                    # each parked GET, with its batch or with EXPIRED after its TTL, so nothing is re-sent here.
                    return reply.body  # (where the replica stands: a long wait's warning says it)
                if reply is not None or time.monotonic() >= deadline:
                    break  # a restarted daemon answered (or none did: connect() reports it)
        self.reconnects += 1
        self._need_restore = True
        self.connect()
        return None

    def stats(self) -> dict[str, Any]:
        """The daemon's STATS plus this client's input-wait figures."""
        if self._sock is None:
            self.connect()
        reply = self._call(self._header(protocol.STATS))
        out = dict(reply.body["stats"])
        out["client"] = {"batches": self.batches, "total_wait_s": self.total_wait_s, "reconnects": self.reconnects}
        return out


# HELLO_OK body fields the client reads, each an integer >= the bound ("instance": a string).
_HELLO_INTS = {"generation": 0, "floor_step": 0, "micro_per_step": 1}


def _check_hello(body: Any, endpoint: str) -> None:
    """ProtocolError naming the field unless `body` has the HELLO_OK fields the client reads, of their types."""
    if not isinstance(body.get("instance"), str) or not body["instance"]:
        raise ProtocolError(f"loaderd at {endpoint}: HELLO_OK body field instance must be a non-empty string, "
                            f"got {body.get('instance')!r:.80}")
    for key, lo in _HELLO_INTS.items():
        v = body.get(key)
        if type(v) is not int or v < lo:
            raise ProtocolError(f"loaderd at {endpoint}: HELLO_OK body field {key} must be an integer >= {lo}, "
                                f"got {v!r:.80}")
