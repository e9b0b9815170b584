"""The ERROR reply: its codes (docs/protocol.md), the one table mapping codes to sluice's exceptions
both sides use, and `error_reply`, the header that answers a request with a code."""

from __future__ import annotations

from typing import Any

from sluice.errors import (
    DaemonError,
    ExhaustedError,
    FencedError,
    InternalError,
    SluiceError,
    SourceReadError,
    StateError,
    WireError,
)
from sluice.wire.protocol import ERROR, Header, Message

# Error codes carried in ERROR replies (body["code"]); see docs/protocol.md.
E_MALFORMED = "MALFORMED"  # header not JSON / not an object / a field of the wrong type
E_VERSION = "VERSION"  # unsupported protocol version
E_UNKNOWN_KIND = "UNKNOWN_KIND"  # kind not in KINDS, or a reply kind sent to the daemon
E_OVERSIZED = "OVERSIZED"  # header or frame larger than the receiver's limits
E_TOO_MANY_FRAMES = "TOO_MANY_FRAMES"
E_TRUNCATED = "TRUNCATED"  # frame count or frame length does not match header["arrays"]
E_BAD_ARRAY = "BAD_ARRAY"  # dtype not allowed or bad shape
E_WRONG_RUN = "WRONG_RUN"  # run_id differs from the daemon's
E_WRONG_DATASET = "WRONG_DATASET"  # dataset_id differs from the daemon's
E_BAD_REPLICA = "BAD_REPLICA"  # replica not served by this daemon / replica count differs
E_OUT_OF_RANGE = "OUT_OF_RANGE"  # step/micro already released or negative / micro >= micro_per_step
E_TOO_FAR_AHEAD = "TOO_FAR_AHEAD"  # step beyond the prefetch lead bound
E_FENCED = "FENCED"  # generation older than the daemon's
E_WRONG_INSTANCE = "WRONG_INSTANCE"  # request addressed to another (earlier) daemon instance
E_BAD_STATE = "BAD_STATE"  # lane states refused (other dataset, run spec, schema, lanes)
E_OBJECT = "OBJECT"  # a dataset object is corrupt or missing (names object and step)
E_EXHAUSTED = "EXHAUSTED"  # a source ran out under rule stop/fail
E_END = "END"  # step >= max_steps: the run's stream has ended (not a fault)
E_OVERLOADED = "OVERLOADED"  # too many pending requests from the daemon's point of view
E_SHUTTING_DOWN = "SHUTTING_DOWN"
E_EXPIRED = "EXPIRED"  # a parked GET waited longer than the daemon's request TTL: ask again
E_UNAUTHORIZED = "UNAUTHORIZED"  # the request lacks the run's token (or carries another one)
E_INTERNAL = "INTERNAL"

ERROR_CODES = (
    E_MALFORMED, E_VERSION, E_UNKNOWN_KIND, E_OVERSIZED, E_TOO_MANY_FRAMES, E_TRUNCATED,
    E_BAD_ARRAY, E_WRONG_RUN, E_WRONG_DATASET, E_BAD_REPLICA, E_OUT_OF_RANGE,
    E_TOO_FAR_AHEAD, E_FENCED, E_WRONG_INSTANCE, E_BAD_STATE, E_OBJECT, E_EXHAUSTED, E_END, E_OVERLOADED,
    E_SHUTTING_DOWN, E_EXPIRED, E_UNAUTHORIZED, E_INTERNAL,
)


# Error code <-> exception, the one table both sides use. The daemon answers an
# exception with `code_for(exc)`; the client raises `exception_for(reply)`.
# Codes not listed raise DaemonError(code) on the client.
_CODE_EXCEPTIONS: tuple[tuple[str, type[SluiceError]], ...] = (
    (E_FENCED, FencedError),
    (E_BAD_STATE, StateError),
    (E_OBJECT, SourceReadError),
    (E_EXHAUSTED, ExhaustedError),
)


def code_for(exc: SluiceError) -> str:
    """The ERROR code the daemon sends for `exc` (INTERNAL for anything unexpected)."""
    if isinstance(exc, WireError):
        return exc.code
    if isinstance(exc, DaemonError):
        return exc.code
    for code, cls in _CODE_EXCEPTIONS:
        if isinstance(exc, cls):
            return code
    return E_INTERNAL


def exception_for(reply: Message) -> SluiceError:
    """The exception a client raises for an ERROR reply (message names code, step and replica)."""
    code = reply.body.get("code", E_INTERNAL)
    message = str(reply.body.get("message", ""))
    h = reply.header
    if code == E_OBJECT:
        return SourceReadError(f"loaderd: object {reply.body.get('object')!r} at step {h.step}: {message}")
    for c, cls in _CODE_EXCEPTIONS:
        if c == code:
            return cls(f"loaderd: {message}")
    return DaemonError(str(code), message, step=h.step, replica=h.replica)


def raise_for(reply: Message) -> None:
    """Raise `exception_for(reply)`."""
    raise exception_for(reply)


def error_reply(request: Header | None, code: str, message: str, *, instance: str = "", **extra: Any) -> Header:
    """An ERROR header answering `request` (or an unparseable message when None)."""
    if code not in ERROR_CODES:
        raise InternalError(f"unknown error code {code!r}")
    base = request or Header(kind=ERROR)
    return Header(
        kind=ERROR,
        run_id=base.run_id,
        dataset_id=base.dataset_id,
        generation=base.generation,
        replica=base.replica,
        step=base.step,
        micro=base.micro,
        request_id=base.request_id,
        instance=instance,
        body={"code": code, "message": message, "in_reply_to": request.kind if request else None, **extra},
    )
