"""The IO thread's sends and receives through libzmq with the GIL kept: no hand-off to the producer per frame.

pyzmq releases the GIL around every ``zmq_msg_send`` and ``zmq_msg_recv``,
as it must for a call that may block. The daemon's IO thread never blocks
there (``ZMQ_DONTWAIT``), but each release can be a hand-off: the producer
thread, waiting for the GIL, takes it, and the IO thread waits to get it back,
up to the switch interval (CPython's convoy effect); five calls a GET (the
request's two frames, the reply's three), and beside a busy thread 62-71% of
GETs saw one (`bench/gil_handoff.py`). Called through `ctypes.PyDLL`, the same
libzmq functions run without releasing the GIL, for the microseconds a
non-blocking call takes.

The library is the one pyzmq loaded: its path is read from
``/proc/self/maps`` and opened again, which gives the loaded instance, never
a second copy; its version must be pyzmq's. Where it cannot be found (no
/proc, a pyzmq linked statically), `available()` is False and the callers use
pyzmq as before, as they do for a reply with a frame of `COPY_BELOW` bytes or
more, which pyzmq sends without copying it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any

import numpy as np
import zmq

from sluice.wire import protocol

__all__ = ["available", "receive_bounded", "receive_small", "send"]

_DONTWAIT = int(zmq.NOBLOCK)
_MORE, _LAST = int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.NOBLOCK)
_EINTR_TRIES = 16  # (a signal during a non-blocking call: tried again, as pyzmq does)


def _library() -> Any:
    """libzmq as pyzmq loaded it, its functions called with the GIL held; None where it is not found."""
    try:
        with open("/proc/self/maps") as f:  # (a mapped file's line ends in its path, the sixth field)
            fields = [line.split(maxsplit=5) for line in f if "libzmq" in line]
    except OSError:
        return None
    paths = {x[5].strip() for x in fields if len(x) == 6 and os.path.basename(x[5].strip()).startswith("libzmq")}
    if len(paths) != 1:  # none (linked statically) or two copies: which one pyzmq uses is not known
        return None
    try:
        lib = ctypes.PyDLL(paths.pop())
        major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        lib.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
        if (major.value, minor.value, patch.value) != zmq.zmq_version_info():
            return None
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args, res in (("zmq_send", [vp, vp, sz, i], i), ("zmq_msg_init", [vp], i),
                                ("zmq_msg_recv", [vp, vp, i], i), ("zmq_msg_data", [vp], vp),
                                ("zmq_msg_more", [vp], i), ("zmq_msg_close", [vp], i), ("zmq_errno", [], i)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib
    except (OSError, AttributeError):
        return None


_LIB = _library()


def available() -> bool:
    """True where the IO thread's calls go through libzmq with the GIL kept (else pyzmq's, as before)."""
    return _LIB is not None


def _checked(call: Any, *args: Any) -> int:
    """``call(*args)``'s result (>= 0), tried again after a signal (EINTR), as pyzmq does; else pyzmq's error
    (`zmq.Again` for EAGAIN)."""
    for _ in range(_EINTR_TRIES):
        rc = call(*args)
        if rc >= 0:
            return rc
        code = _LIB.zmq_errno()
        if code != errno.EINTR:
            raise zmq.Again() if code == errno.EAGAIN else zmq.ZMQError(code)
    raise zmq.ZMQError(errno.EINTR)


def send(sock: zmq.Socket, frames: list[Any], zero_copy_from: int) -> bool:
    """``sock.send_multipart(frames, zmq.NOBLOCK)``, each frame copied into libzmq's buffers, the GIL kept: the
    same frames and the same `zmq.ZMQError` (EHOSTUNREACH; EAGAIN as `zmq.Again`). False, nothing sent, where a
    frame has `zero_copy_from` bytes or more (pyzmq sends those without a copy). `frames`: bytes and
    C-contiguous buffers. Requires `available()`."""
    parts = []
    for f in frames:
        if type(f) is bytes:
            parts.append((f, len(f)))
            continue
        a = np.frombuffer(f, np.uint8)  # (its address and byte count; `frames` keeps it alive meanwhile)
        if a.nbytes >= zero_copy_from:
            return False
        parts.append((a.ctypes.data, a.nbytes))
    handle, send_one, last = sock.underlying, _LIB.zmq_send, len(parts) - 1
    for i, (ptr, size) in enumerate(parts):
        _checked(send_one, handle, ptr, size, _LAST if i == last else _MORE)
    return True


class _Message:
    """One zmq_msg_t (64 bytes, pointer-aligned) a thread's receives reuse."""

    def __init__(self) -> None:
        self.buf = (ctypes.c_uint64 * 8)()
        self.ptr = ctypes.addressof(self.buf)

    def recv(self, handle: int, keep: int) -> tuple[bytes | None, int, bool]:
        """The next frame: (its bytes, or None when it is longer than `keep` bytes (not copied); its size; more
        frames follow). Raises `zmq.Again` when no message waits."""
        lib, msg = _LIB, self.ptr
        lib.zmq_msg_init(msg)
        try:
            size = _checked(lib.zmq_msg_recv, msg, handle, _DONTWAIT)
            data = ctypes.string_at(lib.zmq_msg_data(msg), size) if size <= keep else None
            return data, size, bool(lib.zmq_msg_more(msg))
        finally:
            lib.zmq_msg_close(msg)


_MSGS = threading.local()  # (one message buffer per thread: two servers in one process never share it)


def _message() -> _Message:
    msg = getattr(_MSGS, "msg", None)
    if msg is None:
        msg = _MSGS.msg = _Message()
    return msg


def receive_small(sock: zmq.Socket, keep: int) -> bytes | None:
    """The next message's first frame, the GIL kept: its bytes, or None when it is longer than `keep` bytes
    (released uncopied, as are further frames). Raises `zmq.Again` when nothing waits. Requires `available()`."""
    msg, handle = _message(), sock.underlying
    data, _, more = msg.recv(handle, keep)
    while more:
        _, _, more = msg.recv(handle, -1)
    return data


def receive_bounded(router: zmq.Socket, limits: protocol.Limits) -> tuple[list[bytes], int]:
    """`endpoint.receive_bounded` with the GIL kept: (identity + kept frames, as bytes; frames released unread).
    The same bounds: frames past `limits.max_frames` or the header-size budget are released uncopied. Raises
    `zmq.Again` when nothing waits. Requires `available()`."""
    msg, handle = _message(), router.underlying
    first, _, more = msg.recv(handle, 1 << 16)  # (a ROUTER's identity: at most 255 bytes)
    frames: list[bytes] = [first or b""]
    nbytes, dropped = 0, 0
    while more:
        # (zmq delivers whole messages: the rest is already here, never zmq.Again)
        room = -1 if dropped or len(frames) > limits.max_frames else limits.max_header_bytes - nbytes
        data, size, more = msg.recv(handle, room)
        if data is None:
            dropped += 1
            continue
        frames.append(data)
        nbytes += size
    return frames, dropped
