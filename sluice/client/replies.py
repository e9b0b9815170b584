"""The client's BATCH replies: the fields the iterator checks, read in one typed pass; the data state kept as JSON.

A BATCH the daemon writes (`encoding.BatchHeaders`) is read by
`decoding.decode_batch` without building a `protocol.Header`, a body dict or
the data state's dicts; anything it does not take is decoded by
`decoding.decode` as always and turned into the same `Batch` (`Batch.of`), so
the iterator checks one shape. The data state of a step's last micro-batch
stays JSON bytes (about 1.3 kB, 8 lanes) until the trainer asks for it
(`state_dict()`, `commit()`, a RESTORE): `held_state` checks now, cheaply,
that it is an object whose ``step`` is the batch's, or decodes it and lets
the caller's check decide, as before.
"""

from __future__ import annotations

from typing import Any

from sluice.errors import ProtocolError
from sluice.wire import decoding, protocol

__all__ = ["Batch", "held_state", "read_reply", "state_value"]


class Batch:
    """One reply as the iterator checks it: a BATCH from `decoding.decode_batch`, or any message (`of`).

    `state` is the body's data state: JSON bytes from the typed pass, the
    decoded value (None when absent) from `of`. `frames` are the received
    frames (the arrays are views on them); `message()` decodes them in full.
    """

    __slots__ = ("kind", "request_id", "instance", "generation", "step", "micro", "micro_per_step", "samples",
                 "state", "arrays", "frames")

    def __init__(self, frames: list[Any], fields: Any, state: bytes | None, arrays: dict[str, Any]) -> None:
        self.kind = protocol.BATCH
        self.request_id, self.instance, self.generation = fields.request_id, fields.instance, fields.generation
        self.step, self.micro, self.micro_per_step = fields.step, fields.micro, fields.body.micro_per_step
        samples = fields.body.samples
        self.samples = () if type(samples) is not list else samples  # (msgspec.UNSET: absent)
        self.state, self.arrays, self.frames = state, arrays, frames

    @classmethod
    def of(cls, msg: protocol.Message, micro_per_step: Any) -> Batch:
        """`msg` (any kind `decode` read) as a Batch: the body's micro_per_step or else `micro_per_step`, its
        state (None when absent) and samples as the body holds them."""
        b = cls.__new__(cls)
        h, body = msg.header, msg.body
        b.kind, b.request_id, b.instance, b.generation = msg.kind, h.request_id, h.instance, h.generation
        b.step, b.micro, b.micro_per_step = h.step, h.micro, body.get("micro_per_step", micro_per_step)
        b.samples, b.state, b.arrays, b.frames = body.get("samples", []), body.get("state"), msg.arrays, None
        return b

    def message(self, limits: protocol.Limits) -> protocol.Message:
        """The reply decoded in full (`decoding.decode`), as a caller expecting another kind reads it."""
        return decoding.decode(self.frames, limits)


def read_reply(frames: list[Any], limits: protocol.Limits) -> tuple[Batch | protocol.Message, Any]:
    """One reply's frames read: a BATCH as the daemon writes it as a `Batch` (`decoding.decode_batch`), any other
    message as `decoding.decode` reads it (WireError as it raises); with its header fields (the Batch itself, or
    the message's header)."""
    batch = decoding.decode_batch(frames, limits)
    if batch is not None:
        b = Batch(frames, *batch)
        return b, b
    msg = decoding.decode(frames, limits)
    return msg, msg.header


def held_state(raw: bytes, step: int) -> Any:
    """`raw` (a BATCH's data state: JSON text of one value, checked by `decode_batch`) if it is an object whose
    last member is ``"step": step``, as the daemon writes it (keys sorted); else its decoded value, for the
    caller's own check (an object whose "step" is `step`).

    Why the suffix suffices: the text is one valid JSON value, so a final ``}`` closes the outer object, and
    ``,"step":N}`` can only be its last member (the quote after the comma opens a string; a quote inside a
    string is escaped), which wins over an earlier "step" as in every JSON decoder here.
    """
    if raw.endswith(b',"step":%d}' % step):
        return raw
    return state_value(raw, step)


def state_value(raw: bytes, step: int) -> Any:
    """The decoded value of a BATCH's data state (`decoding.json_value`); ProtocolError naming the step if it is
    not JSON (`decode_batch` took only JSON: a bug here, not the daemon's)."""
    try:
        return decoding.json_value(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"loaderd: the data state after step {step} is not JSON ({exc})") from None
