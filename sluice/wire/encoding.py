"""The sending side of the wire format: a message's frames (`encode`: the header, then each array's buffer,
zero-copy), frame-0 JSON (`encode_header`, `json_bytes`), and the one writer of pre-encoded headers
(`HeaderWriter`, and `BatchHeaders` for the daemon's BATCH replies, optionally packing back-to-back arrays
into one frame). `decoding` reads what these write.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from sluice.errors import WireError
from sluice.wire.errorcodes import E_BAD_ARRAY
from sluice.wire.protocol import BATCH, DTYPES, PROTOCOL_VERSION, Header

def encode_header(header: Header) -> bytes:
    """Frame 0 for `header` (compact JSON, keys sorted: the golden fixtures' form)."""
    return _ENCODER.encode(header.to_obj()).encode("utf-8")


_WIRE_DTYPES = frozenset(np.dtype(d) for d in DTYPES)


def _wire_array(name: str, array: np.ndarray) -> np.ndarray:
    a = np.asarray(array)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    if dt.str not in DTYPES:
        raise WireError(E_BAD_ARRAY, f"array {name!r}: dtype {a.dtype.str} is not one of {DTYPES}")
    if a.dtype != dt or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=dt)  # the only copy, and only for odd inputs
    return a


def encode(header: Header, arrays: Mapping[str, np.ndarray] | None = None) -> list[Any]:
    """Frames for one message: the header, then each array's buffer (sent zero-copy).

    `header.arrays` is filled from `arrays` (name, dtype, shape) in mapping order.
    Pass the result to ``socket.send_multipart(frames, copy=False)``.
    """
    arrays = arrays or {}
    bufs: list[Any] = []
    specs = []
    for name, array in arrays.items():
        a = _wire_array(name, array)
        specs.append((name, a.dtype.str, tuple(int(x) for x in a.shape)))
        bufs.append(a.reshape(-1).view(np.uint8) if a.size else b"")
    hdr = replace(header, arrays=tuple(specs))
    return [encode_header(hdr), *bufs]


# One encoder and one decoder for every header: `json.dumps`/`json.loads` with options build a new one
# per call (the same output; a few microseconds of the IO thread per message).
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def json_bytes(value: Any) -> bytes:
    """`value` as frame-0 JSON (compact, keys sorted), for pre-encoding parts of a BATCH header."""
    return _ENCODER.encode(value).encode("utf-8")


class HeaderWriter:
    """Frame 0 of the messages of one kind and (run, dataset, generation, replica, instance): the one writer of
    pre-encoded headers (the daemon's BATCH replies, `BatchHeaders`; the client's GETs, client/requests.py).

    The constant fields are encoded once; `frame` formats only step, micro,
    request_id and takes the arrays' and the body's JSON as given, and gives
    exactly the bytes ``encode_header(Header(...))`` gives (keys sorted).
    """

    def __init__(self, *, kind: str, run_id: str | None, dataset_id: str | None, generation: int, replica: int,
                 instance: str) -> None:
        j = json_bytes
        fixed = [j(v).replace(b"%", b"%%") for v in (dataset_id, generation, instance, kind, PROTOCOL_VERSION,
                                                      replica, run_id)]  # (a % in an ID is the template's)
        # One %-format a header (one C call; the ints as str() writes them): 0.2 us against 0.8 for a join
        # of the parts with a str(int).encode() each.
        self._template = b"".join((b'{"arrays":%b,"body":%b,"dataset_id":', fixed[0], b',"generation":', fixed[1],
                                   b',"instance":', fixed[2], b',"kind":', fixed[3], b',"micro":%d,"proto":',
                                   fixed[4], b',"replica":', fixed[5], b',"request_id":%d,"run_id":', fixed[6],
                                   b',"step":%d}'))

    def frame(self, *, arrays: bytes, body: bytes, step: int, micro: int, request_id: int) -> bytes:
        """The header's bytes; `arrays` and `body` are their JSON (compact, keys sorted); the ints as ints."""
        return self._template % (arrays, body, micro, request_id, step)


class BatchHeaders:
    """BATCH replies of one (daemon instance, generation, replica) with the constant fields encoded once.

    `frames` gives exactly the frames ``encode(Header(kind=BATCH, ...), arrays)``
    gives (tested byte for byte), but only step, micro, request_id, the array
    specs and the body are formatted per message; the body's parts (samples,
    the data state) come pre-encoded by the producer (`json_bytes`), so the IO
    thread never re-encodes a data state.
    """

    SPECS_KEPT = 1024  # array-spec JSONs kept (cu_seqlens' length varies with the documents of a micro-batch)

    def __init__(self, *, run_id: str, dataset_id: str, generation: int, replica: int, instance: str) -> None:
        self.key = (generation, replica)
        self._header = HeaderWriter(kind=BATCH, run_id=run_id, dataset_id=dataset_id, generation=generation,
                                    replica=replica, instance=instance)
        self._specs: dict[tuple[Any, ...], bytes] = {}  # bounded: SPECS_KEPT, cleared at the limit

    @staticmethod
    def body(micro_per_step: int, samples: bytes | None = None, state: bytes | None = None) -> bytes:
        """The BATCH body from its pre-encoded parts (keys in sorted order)."""
        if samples is None:  # (the common bodies in one %-format each)
            return b'{"micro_per_step":%d}' % micro_per_step if state is None else \
                b'{"micro_per_step":%d,"state":%b}' % (micro_per_step, state)
        return b'{"micro_per_step":%d,"samples":%b%b}' % (
            micro_per_step, samples, b"" if state is None else b',"state":' + state)

    def frames(self, *, step: int, micro: int, request_id: int, body: bytes,
               arrays: Mapping[str, np.ndarray], pack_below: int = 0) -> list[Any]:
        """The message's frames; with `pack_below` (a receiver that asked for packed frames: GET `packed`),
        arrays that lie back to back in one numpy buffer (a micro-batch's ids, labels and position ids
        from the producer's step block) go in one frame when it stays under `pack_below` bytes."""
        bufs: list[Any] = [None]
        keys = []
        for name, array in arrays.items():
            # (a plain contiguous array of a wire dtype is what `_wire_array` would return as it is)
            if type(array) is not np.ndarray or array.dtype not in _WIRE_DTYPES or not array.flags.c_contiguous:
                array = _wire_array(name, array)
            keys.append((name, array.dtype, array.shape))
            # The array itself: a C-contiguous buffer whose bytes are the frame (pyzmq takes any contiguous
            # buffer, by its byte length); a flat uint8 view of it cost two numpy calls per array.
            bufs.append(array if array.size else b"")
        key = tuple(keys)
        specs = self._specs.get(key)
        if specs is None:  # the arrays' JSON, kept per (names, dtypes, shapes): few distinct ones a run
            if len(self._specs) >= self.SPECS_KEPT:
                self._specs.clear()
            specs = self._specs[key] = json_bytes(
                [{"dtype": dt.str, "name": name, "shape": [int(x) for x in shape]} for name, dt, shape in keys])
        bufs[0] = self._header.frame(arrays=specs, body=body, step=step, micro=micro, request_id=request_id)
        return _packed(bufs, pack_below) if pack_below and len(bufs) > 2 else bufs


def _packed(bufs: list[Any], limit: int) -> list[Any]:
    """`bufs` (header, then one buffer per array) with the leading run of arrays that share one C-contiguous
    owner and follow each other in its memory, if they end under `limit` bytes, as one uint8 view of that
    range: the same bytes in fewer frames (`decode` maps arrays to frames by their sizes). Anything else as
    it was: a run of one, a run with an empty array or a gap, and a read-only buffer (its address is taken
    through a writable ctypes view, 0.2 us against the 0.8-0.9 of `ctypes.data` or `__array_interface__`)."""
    first = bufs[1]
    if type(first) is not np.ndarray:
        return bufs
    base = first.base
    if type(base) is not np.ndarray or not base.flags.c_contiguous:
        return bufs
    try:
        start = _addressof(_char_at(first))
        end, j = start + first.nbytes, 2  # one pass: bufs[1:j] is the run so far, each where the one before ends
        for b in bufs[2:]:
            if type(b) is not np.ndarray or b.base is not base:
                break
            n = b.nbytes
            if not n or _addressof(_char_at(b)) != end:
                return bufs
            end += n
            j += 1
        if j < 3 or end - start >= limit:
            return bufs
        return [bufs[0], _ndarray((end - start,), _UINT8, base, start - _addressof(_char_at(base))), *bufs[j:]]
    except (TypeError, ValueError):  # a read-only or empty buffer: sent as it is
        return bufs


_addressof = ctypes.addressof
_char_at = ctypes.c_char.from_buffer
_UINT8 = np.dtype(np.uint8)
_ndarray = np.ndarray
