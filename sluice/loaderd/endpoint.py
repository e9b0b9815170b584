"""Where loaderd listens, and who may connect: endpoint rules, binding, the run token.

Endpoint rules (docs/hardening.md, threat model):

* ``ipc:///path`` -- a socket file, chmod 0600 after bind; the default lives in
  a fresh 0700 directory. File permissions decide who may connect.
* ``ipc://@name`` -- a Linux abstract socket: it has no file and no permission
  bits, so any process in the network namespace can connect. Allowed only with
  a run token (or CurveZMQ).
* ``tcp://127.0.0.1:*`` (loopback) -- any local user can connect, so a run
  token (or CurveZMQ) is required.
* ``tcp://`` beyond loopback -- CurveZMQ keys only.

With a run token (and no CurveZMQ) the ROUTER is a ZMTP PLAIN server whose
ZAP handler (`TokenAuthenticator`) admits only the user "sluice" with the
token as password, compared in constant time: a peer without the token is
refused during the handshake, before libzmq accepts a single frame from it,
so a stranger cannot make the daemon buffer anything (libzmq assembles a
whole multipart message before delivering its first frame; MAXMSGSIZE bounds
only each frame, so what a token holder can make it buffer is bounded by
memguard.py instead). The token is checked again in every request body. A
connection that has not finished its handshake within `HANDSHAKE_S` is
dropped, so idle strangers cannot hold every file descriptor for long.

`bind_router` binds and reports a failed bind (port in use, a folder that does
not exist) as `BindError` after closing the socket, so the caller can exit at
once instead of hanging in ``Context.term()`` on a socket left open.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import zmq

from sluice.errors import BindError, SpecError
from sluice.loaderd import heldzmq
from sluice.loaderd.physical.stepqueue import COPY_BELOW
from sluice.wire import protocol, runtoken

_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def private_ipc_endpoint() -> str:
    """ipc:// endpoint in a fresh 0700 directory (mkdtemp creates it 0700)."""
    d = tempfile.mkdtemp(prefix="sluice-loaderd-")
    return f"ipc://{d}/loaderd.sock"


def is_abstract(endpoint: str) -> bool:
    return endpoint.startswith("ipc://@")


def check_endpoint(endpoint: str, curve: bool = False, token: bool = True) -> None:
    """Refuse endpoints that would let strangers in (see the module docstring); SpecError names the fix."""
    if endpoint.startswith("ipc://"):
        if is_abstract(endpoint) and not (token or curve):
            raise SpecError(f"loaderd: endpoint {endpoint} is an abstract socket, which any local process can reach; "
                            "give the run a token (--token-file) or use a path ipc:// endpoint")
        return
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        if host not in _LOOPBACK and not curve:
            raise SpecError(
                f"loaderd: endpoint {endpoint} is not loopback; tcp beyond loopback needs CurveZMQ keys "
                "(--curve-secret and --curve-clients; see `sluice curve-keys`), or use ipc:// or tcp://127.0.0.1:*"
            )
        if not (token or curve):
            raise SpecError(f"loaderd: endpoint {endpoint} is reachable by every local user; give the run a token "
                            "(--token-file) or CurveZMQ keys, or use the default private ipc:// socket")
        return
    raise SpecError(f"loaderd: endpoint {endpoint!r} must start with ipc:// or tcp://")


def write_private(path: str, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)


_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27, ZAP)
_ZAP_VERSION = b"1.0"


class TokenAuthenticator:
    """ZAP handler admitting PLAIN user `runtoken.TOKEN_USER` with the run token; counts refusals.

    A thread owns a REP socket on the context's ZAP endpoint (made in that
    thread) and answers each handshake: 200 for the user "sluice" with this
    run's token (compared in constant time, never logged), 400 for anything
    else (another mechanism, user or token, a malformed request). pyzmq's
    `ThreadAuthenticator` does this too, but it imports asyncio: 20-40 ms of
    every daemon start (measured, docs/loaderd.md "Start-up"); CurveZMQ still
    uses it.
    """

    def __init__(self, ctx: zmq.Context, token: str) -> None:
        self.ctx = ctx
        self._token = token
        self.denied = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind the handler; return once it answers (BindError if it cannot bind or does not start)."""
        self._thread = threading.Thread(target=self._run, name="loaderd-zap", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self.stop()
            raise BindError(f"loaderd: the run-token handler did not start ({self._error or 'timeout'})")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the handler's thread, waiting at most `timeout_s` seconds (it polls every 0.1 s)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            sock.close(0)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):  # bounded wait: stop() is seen within 0.1 s
                    sock.send_multipart(self.reply(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(0)

    def reply(self, msg: list[bytes]) -> list[bytes]:
        """The ZAP reply frames to one request (RFC 27: version, id, status code, text, user id, metadata)."""
        request_id = msg[1] if len(msg) > 1 else b""
        if len(msg) < 6 or msg[0] != _ZAP_VERSION:
            self.denied += 1
            return [_ZAP_VERSION, request_id, b"400", b"malformed ZAP request", b"", b""]
        mechanism, credentials = msg[5], msg[6:]
        ok = (mechanism == b"PLAIN" and len(credentials) == 2 and credentials[0] == runtoken.TOKEN_USER.encode()
              and runtoken.token_matches(self._token, credentials[1].decode("utf-8", "replace")))
        if not ok:
            self.denied += 1
            return [_ZAP_VERSION, request_id, b"400", b"not this run's token", b"", b""]
        return [_ZAP_VERSION, request_id, b"200", b"OK", runtoken.TOKEN_USER.encode(), b""]


# pyzmq's `send_multipart` checks every part's type (a memoryview per array) and combines enum flags
# per frame through its `send` wrapper: about 20 Python calls a reply on the IO thread, which holds the
# GIL the producer needs. The backend's `send` (the class pyzmq's Socket extends) takes int flags and
# applies `copy_threshold` itself, so `send_frames` has the same effect with one call a frame.
_BACKEND_SEND = zmq.backend.Socket.send if issubclass(zmq.Socket, zmq.backend.Socket) else None
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)
_HELD = heldzmq.available()  # (the GIL kept through libzmq's calls: heldzmq.py)


def send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK, copy=False)``: the same frames, flags and copies (frames
    under the socket's `copy_threshold` copied), raising the same ZMQError. `frames`: zmq.Frame, bytes or
    contiguous buffers, which the caller leaves unchanged. Through `heldzmq` (the GIL kept) where it is
    available and no frame is to go without a copy."""
    if _HELD and heldzmq.send(sock, frames, COPY_BELOW):
        return
    send = _BACKEND_SEND
    if send is None:  # a pyzmq whose Socket does not extend its backend's
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return
    for f in frames[:-1]:
        send(sock, f, _MORE, False)
    send(sock, frames[-1], _LAST, False)


# Connections that have not finished their ZMTP handshake (a stranger's idle TCP connection, a peer
# that sends half a greeting) are dropped after this long, not libzmq's default 30 s: each holds a file
# descriptor, and with descriptors exhausted no client is accepted (1,000 such connections delayed a
# real client 23 s under a 1,024-descriptor limit; docs/hardening.md). A real handshake (NULL, PLAIN or
# CURVE, with the ZAP reply) takes milliseconds.
HANDSHAKE_S = 5.0
# Pending connections the kernel queues before libzmq accepts them (libzmq's default is 100): a burst of
# connections beyond it makes further connects, a real client's included, wait for a SYN retransmission.
LISTEN_BACKLOG = 1024


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; (soft, hard) after.

    Every connection the ROUTER holds is a descriptor; the common default soft
    limit of 1,024 is reached by about 1,000 idle connections, after which
    libzmq accepts nobody until some close. Called by the daemon's own process
    only (cli.py), never by a program that embeds a Server.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # e.g. an infinite hard limit above the kernel's nr_open: keep soft
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _router_socket(ctx: zmq.Context, curve: Any, limits: protocol.Limits, token: str | None) -> zmq.Socket:
    """A ROUTER with the daemon's options (security mechanism, bounds, handshake limit), not yet bound."""
    router = ctx.socket(zmq.ROUTER)
    try:
        if curve is not None:
            router.curve_secretkey = curve.secret
            router.curve_publickey = curve.public
            router.curve_server = True
        elif token is not None:
            router.plain_server = True
        router.setsockopt(zmq.LINGER, 0)
        router.copy_threshold = COPY_BELOW
        # Report a reply to a peer that is gone (or whose queue is full) instead of dropping
        # it silently: the server never counts such a reply as a delivery.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.RCVHWM, 1024)
        router.setsockopt(zmq.SNDHWM, 4096)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        router.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        # Transport bound per frame: libzmq drops the peer before buffering a larger frame.
        # Requests carry no array frames, so the largest frame is a header. The frame count
        # is not bounded by libzmq: memguard.py bounds what it can buffer.
        router.setsockopt(zmq.MAXMSGSIZE, limits.max_header_bytes)
    except BaseException:
        router.close(0)
        raise
    return router


def _listen(router: zmq.Socket, endpoint: str) -> str:
    """Bind `router`; its resolved endpoint (a socket file chmod 0600). BindError says why it cannot."""
    try:
        router.bind(endpoint)
    except zmq.ZMQError as exc:
        raise BindError(f"loaderd: cannot listen on {endpoint}: {exc.strerror} (errno {exc.errno})") from None
    bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
    if bound.startswith("ipc://") and not is_abstract(bound):
        os.chmod(bound[len("ipc://"):], 0o600)
    return bound


def bind_router(ctx: zmq.Context, endpoint: str, *, curve: Any, limits: protocol.Limits,
                token: str | None = None) -> tuple[zmq.Socket, str, Any]:
    """A bound ROUTER, its resolved endpoint and the ZAP authenticator (None without CurveZMQ or token).

    On any failure everything opened here is closed again and BindError (or
    SpecError) is raised, so a daemon that cannot listen exits at once.
    """
    auth = None
    router = None
    try:
        if curve is not None:
            # ZAP handler: only clients whose public key is in clients_dir get in.
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=curve.clients_dir)
        elif token is not None:
            auth = TokenAuthenticator(ctx, token)
            auth.start()
        router = _router_socket(ctx, curve, limits, token)
        return router, _listen(router, endpoint), auth
    except BaseException:
        if router is not None:
            router.close(0)
        if auth is not None:
            auth.stop()
        raise


def rebind_router(ctx: zmq.Context, endpoint: str, *, curve: Any, limits: protocol.Limits, token: str | None,
                  timeout_s: float = 2.0) -> zmq.Socket:
    """A fresh ROUTER bound at `endpoint` (the resolved one of a ROUTER just closed), the ZAP handler kept.

    libzmq closes the old listener in its IO thread, so the address may still be
    taken for a moment: tried again every 10 ms for `timeout_s`, then BindError.
    """
    import time

    router = _router_socket(ctx, curve, limits, token)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _listen(router, endpoint)
            return router
        except BindError:
            if time.monotonic() >= deadline:
                router.close(0)
                raise
            time.sleep(0.01)


def receive_bounded(router: zmq.Socket, limits: protocol.Limits) -> tuple[list[Any], int]:
    """One message frame by frame: (identity + kept frames, frames released unread).

    libzmq bounds each frame (MAXMSGSIZE) but not the frame count; frames
    beyond `limits.max_frames` or the header-size budget are released as they
    are read, so Python never holds more than the limits of one message.
    Raises zmq.Again when nothing is waiting. The identity comes as bytes, the other frames as bytes or
    zmq.Frames (through `heldzmq`, the GIL kept, where it is available).
    """
    if _HELD:
        return heldzmq.receive_bounded(router, limits)
    first = router.recv(zmq.NOBLOCK, copy=False)  # the peer identity
    frames: list[Any] = [first.bytes]
    nbytes, dropped, more = 0, 0, first.more
    while more:
        f = router.recv(copy=False)  # zmq delivers whole messages: the rest is already here
        more = f.more
        size = len(f)  # (a Frame's byte length; `len(f.buffer)` made a memoryview first: 0.65 against 0.08 us)
        if dropped or len(frames) > limits.max_frames or nbytes + size > limits.max_header_bytes:
            dropped += 1
            continue  # released here, never accumulated
        frames.append(f)
        nbytes += size
    return frames, dropped


def monitor_event(frames: list[bytes]) -> int:
    """The event number of one socket-monitor message (libzmq 4: a 6-byte frame, 16-bit event + 32-bit value,
    then the endpoint); 0 for anything else.

    pyzmq's `zmq.utils.monitor.recv_monitor_message` does the same, but importing it imports asyncio
    (zmq.asyncio): 25-100 ms of the IO thread's GIL at the first connection, while the first step is made.
    """
    if len(frames) != 2 or len(frames[0]) != 6:
        return 0
    return int.from_bytes(frames[0][:2], sys.byteorder)


class Connections:
    """How many transport connections the ROUTER holds, from its socket monitor (STATS `connections`).

    libzmq reports an accepted connection and, once its IO thread has seen the
    peer go (or refused its handshake), the disconnect; `open` is the
    difference. It makes "the daemon has seen that client go" observable: a
    reply to a client whose disconnect was seen fails (ROUTER_MANDATORY) and is
    never counted as a delivery, while one sent before is indistinguishable
    from a delivery. Used by the IO thread only; `drain()` never blocks.

    Bounded: events wait in the monitor's inproc pipe (libzmq's default
    high-water marks, 1000 + 1000 messages); at that limit libzmq's IO thread
    waits until the IO loop drains them, which it does on every pass (at most
    `DRAIN_MAX` events a call, so a connection flood cannot hold the loop).
    """

    DRAIN_MAX = 4096

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED

    def __init__(self, router: zmq.Socket) -> None:
        self.socket = router.get_monitor_socket(self.EVENTS)
        self.accepted = 0
        self.disconnected = 0

    @property
    def open(self) -> int:
        return self.accepted - self.disconnected

    def drain(self) -> None:
        """Count the events waiting on the monitor socket (at most DRAIN_MAX; the rest on the next pass)."""
        for _ in range(self.DRAIN_MAX):
            if not self.socket.poll(0):
                return
            event = monitor_event(self.socket.recv_multipart(zmq.NOBLOCK))
            self.accepted += event == zmq.EVENT_ACCEPTED
            self.disconnected += event == zmq.EVENT_DISCONNECTED

    def close(self, router: zmq.Socket) -> None:
        """Stop the monitor (before `router` closes); drained first, so libzmq is not waiting to send one."""
        self.drain()
        router.disable_monitor()
        self.socket.close(0)
