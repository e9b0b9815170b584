"""The client's sockets to loaderd: credentials, and a refused handshake told apart from silence.

A daemon with a run token (and no CurveZMQ) admits only ZMTP PLAIN peers
whose password is the token; one with CurveZMQ only the listed client keys.
A refused peer gets no message at all, so each DEALER made here carries a
socket monitor until the first answer: a failed handshake surfaces as
`HandshakeRefused` (code UNAUTHORIZED) at once instead of a silent wait
until the reconnect deadline. Used by `Client` and `sluice peek`.
"""

from __future__ import annotations

from typing import Any

import zmq

from sluice.errors import HandshakeRefused
from sluice.wire import errorcodes, runtoken

__all__ = ["LoaderdSocket", "close_dealer", "dealer", "poll_or_refused", "recv_frames", "recv_within",
           "send_or_refused"]

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class LoaderdSocket(zmq.Socket):
    """A DEALER to loaderd; carries its handshake monitor until the first answer settles the handshake."""

    handshake_monitor: zmq.Socket | None = None
    wait_ms: int = -1  # its ZMQ_RCVTIMEO as `recv_within` last set it


def dealer(ctx: zmq.Context, endpoint: str, *, curve: Any = None, token: str | None = None) -> LoaderdSocket:
    """A DEALER connected to loaderd with the run's credentials, watched for a refused handshake.

    CurveZMQ keys when given; otherwise, with a run token, ZMTP PLAIN (user
    `runtoken.TOKEN_USER`, the token as password): a daemon with a token refuses
    any other peer during the handshake. `poll_or_refused` reports such a
    refusal as UNAUTHORIZED instead of silence; `close_dealer` closes both.
    """
    s = ctx.socket(zmq.DEALER, socket_class=LoaderdSocket)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_publickey = curve.public
        s.curve_secretkey = curve.secret
        s.curve_serverkey = curve.server_public
    elif token is not None:
        s.plain_username = runtoken.TOKEN_USER.encode()
        s.plain_password = token.encode()
    s.setsockopt(zmq.RCVHWM, 0)  # replies are bounded by our credits
    s.handshake_monitor = s.get_monitor_socket(_HANDSHAKE_FAILED)  # before connect: no event is missed
    s.connect(endpoint)
    return s


def poll_or_refused(sock: zmq.Socket, timeout_s: float, endpoint: str) -> bool:
    """Whether a reply is waiting within `timeout_s`; HandshakeRefused (UNAUTHORIZED) if the handshake failed."""
    mon = getattr(sock, "handshake_monitor", None)
    if mon is None:
        return bool(sock.poll(int(timeout_s * 1000) + 1))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    events = dict(poller.poll(int(timeout_s * 1000) + 1))
    if sock in events:
        _unwatch(sock)  # a daemon answered: the handshake is settled
        return True
    if mon in events:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(mon)
        _unwatch(sock)
        raise HandshakeRefused(errorcodes.E_UNAUTHORIZED,
                               f"loaderd at {endpoint} refused the connection handshake "
                               f"(zmq event {event['event']!r}, value {event['value']}): "
                               "this client's run token or CurveZMQ keys are not the daemon's")
    return False


def send_or_refused(sock: zmq.Socket, frames: list[Any], timeout_s: float, endpoint: str) -> bool:
    """Send a request on a socket made by `dealer` without blocking; False if it could not leave.

    A refused handshake removes the DEALER's only pipe and libzmq does not
    reconnect, so a blocking send would wait forever; on a loaded machine the
    refusal can come before the first send. Then the monitor tells why:
    HandshakeRefused (UNAUTHORIZED) within `timeout_s`, else False (silence).
    """
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        poll_or_refused(sock, timeout_s, endpoint)  # raises HandshakeRefused when that is why
        return False


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """One multipart message as zmq.Frames (no copy), like ``recv_multipart(copy=False)``.

    `recv_multipart` asks the socket for RCVMORE after every frame (an enum
    conversion each in pyzmq); each received Frame already carries it
    (`more`), and a message's frames arrive together.
    """
    frame = sock.recv(copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames


WAIT_SLICE_MS = 1000  # the longest single blocking receive (`recv_within`); the caller's deadline decides


def recv_within(sock: LoaderdSocket, timeout_s: float) -> list[zmq.Frame] | None:
    """One message (`recv_frames`) if one arrives within `timeout_s` (waiting at most `WAIT_SLICE_MS`); else None.

    A blocking receive under ZMQ_RCVTIMEO: a message already queued costs no
    system call (``sock.poll`` then ``recv`` makes a poll(2) and builds a
    Poller each time). The timeout is set only when it changes: every slice is
    `WAIT_SLICE_MS` but the last, so a caller loops on None until its deadline.
    """
    ms = min(WAIT_SLICE_MS, int(timeout_s * 1000) + 1)
    if ms != sock.wait_ms:
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.wait_ms = ms
    try:
        return recv_frames(sock)
    except zmq.Again:
        return None


def close_dealer(sock: zmq.Socket) -> None:
    """Close a socket made by `dealer` and its monitor."""
    _unwatch(sock)
    sock.close(0)


def _unwatch(sock: zmq.Socket) -> None:
    mon = getattr(sock, "handshake_monitor", None)
    if mon is not None:
        sock.handshake_monitor = None
        try:
            sock.disable_monitor()
        except zmq.ZMQError:  # already closed
            pass
        mon.close(0)
