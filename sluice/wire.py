"""The sluice wire format: the one module both loaderd and the client import.

Every message is a ZeroMQ multipart message (the daemon's ROUTER adds and strips
the peer identity frame; nothing else is added)::

    frame 0      header: UTF-8 JSON object, at most `Limits.max_header_bytes`
    frame 1..n   raw little-endian array bytes of header["arrays"], in that
                 order: one frame per entry, or several back to back in a
                 frame ("packed", for a client whose GET asks: `decode`
                 maps arrays to frames by their sizes)

The header (protocol `PROTOCOL_VERSION` = 1) always has these keys::

    {"proto": 1, "kind": "GET", "run_id": "r1", "dataset_id": "b3:...",
     "generation": 3, "replica": 0, "step": 12, "micro": 1, "request_id": 7,
     "instance": "", "arrays": [{"name": "input_ids", "dtype": "<i4",
     "shape": [4, 128]}], "body": {...kind-specific...}}

Arrays are sent with ``copy=False`` (ZeroMQ keeps a reference to the numpy
buffer) and received as numpy views on the received frames with
``np.frombuffer``: no byte is copied on either side after the kernel. Only the
dtypes in `DTYPES` exist on the wire; a frame's length must equal
``prod(shape) * itemsize`` exactly.

Nothing here unpickles or evaluates anything: the header is parsed by
``json.loads`` and checked field by field (or, with msgspec installed, by one
typed decode that accepts exactly what those checks accept); arrays are raw
bytes with a whitelisted dtype. Every defect raises `WireError` carrying one of the codes in
`ERROR_CODES`, so the daemon can answer with an ERROR message and count it.
docs/protocol.md documents every kind, field and code; tests/test_wire.py holds
golden header fixtures so a format change cannot slip through.
"""

# Why this module is over 450 lines: it is the whole wire contract, read as one
# document (header, frames, limits, error codes and the exceptions they map to,
# the step digest, the run token); both sides import it and nothing else.

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import numpy as np

from sluice import batcharrays
from sluice.errors import (  # WireError lives there with every other exception; re-exported here
    DaemonError,
    ExhaustedError,
    FencedError,
    InternalError,
    SluiceError,
    SourceReadError,
    StateError,
    WireError,
)

PROTOCOL_VERSION = 1

# Message kinds. Client -> daemon requests and the daemon's replies.
HELLO = "HELLO"
HELLO_OK = "HELLO_OK"
GET = "GET"
BATCH = "BATCH"
RESTORE = "RESTORE"
RESTORE_OK = "RESTORE_OK"
COMMIT = "COMMIT"
COMMIT_OK = "COMMIT_OK"
STATS = "STATS"
STATS_OK = "STATS_OK"
ERROR = "ERROR"

REQUEST_KINDS = (HELLO, GET, RESTORE, COMMIT, STATS)
REPLY_KINDS = (HELLO_OK, BATCH, RESTORE_OK, COMMIT_OK, STATS_OK, ERROR)
KINDS = REQUEST_KINDS + REPLY_KINDS

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

# The only dtypes on the wire (numpy dtype strings, explicitly little-endian).
DTYPES = ("<i4", "<u4", "<i8", "<u2", "|u1", "<f4")

HEADER_KEYS = (
    "proto", "kind", "run_id", "dataset_id", "generation", "replica", "step", "micro",
    "request_id", "instance", "arrays", "body",
)

# The arrays of a BATCH, in order, and those of the step digest, in its order: declared in sluice/batcharrays.py.
BATCH_ARRAYS = batcharrays.NAMES
ARRAY_ORDER = batcharrays.DIGESTED



def arrays_digest(arrays_in_order: Sequence[Mapping[str, Any]]) -> str:
    """Hex BLAKE3 over each mapping's arrays in ARRAY_ORDER, as little-endian int32.

    The micro-batches digest that `sluice plan`, `sluice peek` and the tests
    compare (docs/protocol.md).
    """
    import blake3

    h = blake3.blake3()
    for arrays in arrays_in_order:
        for name in ARRAY_ORDER:
            h.update(np.ascontiguousarray(arrays[name], dtype="<i4").tobytes())
    return h.hexdigest()


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


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Receiver-side bounds; anything beyond them is refused before parsing.

    Defaults fit the daemon receiving requests (headers only; RESTORE carries
    lane states in its header). Clients use `Limits.for_client()`.
    """

    max_header_bytes: int = 4 << 20
    max_frames: int = 8
    max_frame_bytes: int = 4 << 20

    @classmethod
    def for_client(cls) -> Limits:
        return cls(max_header_bytes=16 << 20, max_frames=16, max_frame_bytes=1 << 31)


@dataclass(frozen=True, kw_only=True)
class Header:
    """The parsed frame-0 header; `body` holds the kind-specific fields."""

    kind: str
    run_id: str = ""
    dataset_id: str = ""
    generation: int = 0
    replica: int = -1
    step: int = -1
    micro: int = -1
    request_id: int = 0
    instance: str = ""
    body: Mapping[str, Any] = field(default_factory=dict)
    arrays: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def to_obj(self) -> dict[str, Any]:
        return {
            "proto": PROTOCOL_VERSION,
            "kind": self.kind,
            "run_id": self.run_id,
            "dataset_id": self.dataset_id,
            "generation": self.generation,
            "replica": self.replica,
            "step": self.step,
            "micro": self.micro,
            "request_id": self.request_id,
            "instance": self.instance,
            "arrays": [{"name": n, "dtype": d, "shape": list(s)} for n, d, s in self.arrays],
            "body": dict(self.body),
        }


@dataclass(frozen=True)
class Message:
    """A received message: its header and numpy views on the array frames."""

    header: Header
    arrays: dict[str, np.ndarray]

    @property
    def kind(self) -> str:
        return self.header.kind

    @property
    def body(self) -> Mapping[str, Any]:
        return self.header.body


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
        self._mid = b"".join((b',"dataset_id":', j(dataset_id), b',"generation":', j(generation),
                              b',"instance":', j(instance), b',"kind":', j(kind), b',"micro":'))
        self._mid2 = b"".join((b',"proto":', j(PROTOCOL_VERSION), b',"replica":', j(replica), b',"request_id":'))
        self._mid3 = b"".join((b',"run_id":', j(run_id), b',"step":'))

    def frame(self, *, arrays: bytes, body: bytes, step: int, micro: int, request_id: int) -> bytes:
        """The header's bytes; `arrays` and `body` are their JSON (compact, keys sorted)."""
        return b"".join((b'{"arrays":', arrays, b',"body":', body, self._mid, str(int(micro)).encode(), self._mid2,
                         str(int(request_id)).encode(), self._mid3, str(int(step)).encode(), b"}"))


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
        parts = [b'{"micro_per_step":', str(int(micro_per_step)).encode()]
        if samples is not None:
            parts += (b',"samples":', samples)
        if state is not None:
            parts += (b',"state":', state)
        parts.append(b"}")
        return b"".join(parts)

    def frames(self, *, step: int, micro: int, request_id: int, body: bytes,
               arrays: Mapping[str, np.ndarray], pack_below: int = 0) -> list[Any]:
        """The message's frames; with `pack_below` (a receiver that asked for packed frames: GET `packed`),
        arrays that lie back to back in one numpy buffer (a micro-batch's ids, labels and position ids
        from the producer's step block) go in one frame when it stays under `pack_below` bytes."""
        bufs: list[Any] = [None]
        keys = []
        for name, array in arrays.items():
            # (a plain contiguous array of a wire dtype is what `_wire_array` would return as it is)
            a = array if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype in _WIRE_DTYPES \
                else _wire_array(name, array)
            keys.append((name, a.dtype, a.shape))
            # The array itself: a C-contiguous buffer whose bytes are the frame (pyzmq takes any contiguous
            # buffer, by its byte length); a flat uint8 view of it cost two numpy calls per array.
            bufs.append(a if a.size else b"")
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
    it was (a read-only buffer too: its address is taken through a writable ctypes view, 0.2 us against the
    0.8-0.9 of `ctypes.data` or `__array_interface__`)."""
    first = bufs[1]
    base = first.base if type(first) is np.ndarray else None
    if type(base) is not np.ndarray or not base.flags.c_contiguous:
        return bufs
    j = 2
    while j < len(bufs) and type(bufs[j]) is np.ndarray and bufs[j].base is base:
        j += 1
    if j < 3:
        return bufs
    try:
        start = end = _addressof(_char_at(first))
        for b in bufs[1:j]:
            if b.nbytes == 0 or _addressof(_char_at(b)) != end:
                return bufs
            end += b.nbytes
        if end - start >= limit:
            return bufs
        return [bufs[0], _ndarray((end - start,), _UINT8, base, start - _addressof(_char_at(base))), *bufs[j:]]
    except (TypeError, ValueError):  # a read-only or empty buffer: sent as it is
        return bufs


_addressof = ctypes.addressof
_char_at = ctypes.c_char.from_buffer
_UINT8 = np.dtype(np.uint8)


def _int(obj: dict[str, Any], key: str, lo: int = -(2**62)) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < 2**62:
        raise WireError(E_MALFORMED, f"header field {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def _str(obj: dict[str, Any], key: str, limit: int = 256) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or len(v) > limit:
        raise WireError(E_MALFORMED, f"header field {key!r} must be a string of at most {limit} characters")
    return v


def parse_header(data: bytes | memoryview, limits: Limits) -> Header:
    """Parse and validate frame 0; raises WireError with a code."""
    return _parse_header(data, limits)[0]


# Array layouts (name, dtype, numpy dtype, shape, byte size, listed before) of validated "arrays" values, keyed by
# their exact JSON bytes. A BATCH header starts with them (keys sorted: `BatchHeaders`), and a run sends few
# distinct ones (cu_seqlens' length varies), so a receiver parses and checks each one once instead of per
# message. Bounded: cleared at SPECS_KEPT, like the sender's `BatchHeaders` cache.
_SPECS: dict[bytes, tuple[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[Any, ...]]] = {}
_SPECS_KEPT = 1024
# An "arrays" value longer than this is checked every time, never kept: a valid one is about 150 bytes per
# array (at most 15), but JSON allows any whitespace, so without it a stranger's 16 MiB headers could make
# 1024 kept values hold 16 GiB (tests/test_attack_wire_specs.py). Kept values hold at most 16 MiB in all.
_SPEC_KEY_BYTES = 16 << 10
_ARRAYS_HEAD = b'{"arrays":'
_BODY_KEY = b',"body":'


def _parse_header(data: bytes | memoryview, limits: Limits) -> tuple[Header, tuple[Any, ...]]:
    """`parse_header`, plus each array's (name, dtype, shape, bytes, listed before) for `decode`.

    Fast path: a header ``{"arrays":X,"body":...}`` whose X (exact bytes) was
    validated before skips X; the rest is parsed and checked as always. Any
    other form, or a rest that does not parse alone or names "arrays" again,
    takes the full path, so what is refused and the error are unchanged.
    """
    if len(data) > limits.max_header_bytes:
        raise WireError(E_OVERSIZED, f"header of {len(data)} bytes exceeds the limit of {limits.max_header_bytes}")
    raw = bytes(data)
    cut = raw.find(_BODY_KEY) if raw.startswith(_ARRAYS_HEAD) else -1
    kept = _SPECS.get(raw[len(_ARRAYS_HEAD):cut]) if cut > 0 else None
    if kept is not None and len(kept[0]) <= limits.max_frames - 1:
        if _REST is not None:  # the rest decoded and checked in one typed pass, or left to the path below
            try:
                rest = _REST.decode(b"{" + raw[cut + 1:])
            except Exception:  # noqa: BLE001 - whatever it refuses, the checks below decide (or raise)
                rest = None
            if rest is not None:
                header = _NEW_HEADER(Header)
                header.__dict__.update(kind=rest.kind, run_id=rest.run_id, dataset_id=rest.dataset_id,
                                       generation=rest.generation, replica=rest.replica, step=rest.step,
                                       micro=rest.micro, request_id=rest.request_id, instance=rest.instance,
                                       body=rest.body, arrays=kept[0])
                return header, kept[1]
        try:
            obj = _json_value("{" + raw[cut + 1:].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            obj = None  # the full path raises the error
        if isinstance(obj, dict) and "arrays" not in obj:
            _check_top(obj)  # what the full path checks before the arrays
            return _checked(obj, kept[0]), kept[1]
    try:
        obj = _json_value(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(E_MALFORMED, f"header is not UTF-8 JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise WireError(E_MALFORMED, f"header must be a JSON object, got {type(obj).__name__}")
    _check_top(obj)
    raw_arrays = obj.get("arrays", [])
    if not isinstance(raw_arrays, list) or len(raw_arrays) > limits.max_frames - 1:
        raise WireError(E_TOO_MANY_FRAMES if isinstance(raw_arrays, list) else E_MALFORMED,
                        f"header field 'arrays' must be a list of at most {limits.max_frames - 1} entries")
    specs = []
    for i, spec in enumerate(raw_arrays):
        if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
            raise WireError(E_MALFORMED, f"arrays[{i}] must be an object with exactly name, dtype, shape")
        name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
        if not isinstance(name, str) or not name or len(name) > 64:
            raise WireError(E_MALFORMED, f"arrays[{i}].name must be a non-empty string")
        if dtype not in DTYPES:
            raise WireError(E_BAD_ARRAY, f"arrays[{i}] ({name}): dtype {dtype!r} is not one of {DTYPES}")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
            raise WireError(E_BAD_ARRAY, f"arrays[{i}] ({name}): shape {shape!r} must be a list of <= 8 sizes")
        specs.append((name, dtype, tuple(shape)))
    spec_t = tuple(specs)
    seen: set[str] = set()
    layout = []
    for name, dtype, shape in spec_t:
        dt = np.dtype(dtype)
        layout.append((name, dtype, dt, shape, math.prod(shape) * dt.itemsize, name in seen))
        seen.add(name)
    header = _checked(obj, spec_t)
    if 0 < cut <= len(_ARRAYS_HEAD) + _SPEC_KEY_BYTES:  # remember X only if it is exactly the arrays value
        key = raw[len(_ARRAYS_HEAD):cut]                   # just validated, type for type (2.0 == 2 == True
        try:                                                # in Python; a duplicated "arrays" key could differ)
            same = json.dumps(_DECODER.decode(key.decode("utf-8"))) == json.dumps(raw_arrays)
        except (UnicodeDecodeError, ValueError, RecursionError):
            same = False
        if same:
            if len(_SPECS) >= _SPECS_KEPT:
                _SPECS.clear()
            _SPECS[key] = (spec_t, tuple(layout))
    return header, tuple(layout)


def _check_top(obj: dict[str, Any]) -> None:
    proto = obj.get("proto")
    if proto != PROTOCOL_VERSION or isinstance(proto, bool):
        raise WireError(E_VERSION, f"protocol version {proto!r} is not supported; this side speaks {PROTOCOL_VERSION}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise WireError(E_UNKNOWN_KIND, f"unknown message kind {kind!r}; known kinds are {', '.join(KINDS)}")
    if not _HEADER_KEY_SET.issuperset(obj):
        raise WireError(E_MALFORMED, f"unknown header fields {sorted(set(obj) - _HEADER_KEY_SET)}")
    if not isinstance(obj.get("body", {}), dict):
        raise WireError(E_MALFORMED, "header field 'body' must be an object")


def _checked(obj: dict[str, Any], specs: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Header:
    """The Header of a parsed object (`_check_top` passed) whose arrays are `specs` (validated)."""
    # Every field given, each checked above: the frozen dataclass's __init__ would set them one
    # `object.__setattr__` call at a time (a fifth of a header's decode, on both sides, per message).
    header = _NEW_HEADER(Header)
    header.__dict__.update(
        kind=obj["kind"],
        run_id=_str(obj, "run_id"),
        dataset_id=_str(obj, "dataset_id"),
        generation=_int(obj, "generation", 0),
        replica=_int(obj, "replica", -1),
        step=_int(obj, "step", -1),
        micro=_int(obj, "micro", -1),
        request_id=_int(obj, "request_id", 0),
        instance=_str(obj, "instance"),
        body=obj.get("body", {}),
        arrays=specs,
    )
    return header


_NEW_HEADER = object.__new__


def _refuse_constant(text: str) -> Any:
    raise ValueError(f"{text} is not allowed in a header")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)

try:  # optional (the "fast" extra): a BATCH header (a 1.3 kB data state) in 4 us against the stdlib's 10
    from msgspec.json import decode as _msgspec_decode
except ImportError:  # pragma: no cover - the stdlib decoder alone
    _msgspec_decode = None


def _json_value(text: str) -> Any:
    """`_DECODER.decode(text)`'s value, or its exception.

    With msgspec installed its decoder parses first: for what it accepts it
    gives the stdlib's values (ints of any size up to the stdlib's digit
    limit, floats correctly rounded, the last of duplicated keys, the same
    nesting limit; tests/test_wire_fast_json.py); what it refuses (NaN,
    Infinity, numbers out of a float's range, lone surrogate escapes, any
    malformed text) goes to the stdlib decoder, which decides or raises as
    before.
    """
    if _msgspec_decode is not None:
        try:
            return _msgspec_decode(text)
        except Exception:  # noqa: BLE001 - whatever it refuses, the stdlib decoder decides (or raises)
            pass
    return _DECODER.decode(text)


_HEADER_KEY_SET = frozenset(HEADER_KEYS)

# A header's fields after "arrays" as one typed msgspec decode (the "fast" extra): each field's type and
# bounds are `_check_top`'s and `_checked`'s (ints not bools, within `_int`'s bounds; strings of at most
# 256 code points; a known kind; proto the integer 1; body an object), unknown fields (a second "arrays"
# included) refused, UTF-8 checked, the last of duplicated keys kept, as the stdlib's decoder does. It only
# accepts: whatever it refuses (a float proto, a long string, NaN, a lone surrogate) goes to
# `_json_value` and the checks, which decide or raise as before (tests/test_wire_typed_header.py). A BATCH
# header's rest in ~4 us against ~6.6 (parse 5, checks 1.6), a GET's in ~1 us against ~3.
try:
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - the stdlib decoder alone
    _REST = None
else:
    def _bounded_int(lo: int) -> Any:
        return Annotated[int, _msgspec.Meta(ge=lo, lt=2**62)]

    _Text = Annotated[str, _msgspec.Meta(max_length=256)]

    class _Rest(_msgspec.Struct, forbid_unknown_fields=True):
        proto: Literal[1]  # type: ignore[valid-type]
        kind: Literal[KINDS]  # type: ignore[valid-type]
        run_id: _Text
        dataset_id: _Text
        generation: _bounded_int(0)  # type: ignore[valid-type]
        replica: _bounded_int(-1)  # type: ignore[valid-type]
        step: _bounded_int(-1)  # type: ignore[valid-type]
        micro: _bounded_int(-1)  # type: ignore[valid-type]
        request_id: _bounded_int(0)  # type: ignore[valid-type]
        instance: _Text
        body: dict[str, Any] = _msgspec.field(default_factory=dict)

    _REST = _msgspec.json.Decoder(_Rest)


def _buffer(frame: Any) -> Any:
    """`frame` as a sized buffer whose len() is its byte count: bytes and zmq.Frames as they are."""
    if type(frame) is bytes or getattr(type(frame), "buffer", None) is not None:  # (zmq.Frame: its class has it)
        return frame
    view = memoryview(frame)  # anything else as bytes (an array `BatchHeaders.frames` made): len() in bytes
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Validate and decode a multipart message (without the ROUTER identity frame).

    `frames` are zmq.Frame objects (received with ``copy=False``) or bytes. The
    returned arrays are numpy views on the frames' buffers, not copies; they stay
    valid as long as the arrays are referenced.
    """
    if not frames:
        raise WireError(E_TRUNCATED, "empty message (no header frame)")
    if len(frames) > limits.max_frames:
        raise WireError(E_TOO_MANY_FRAMES, f"{len(frames)} frames exceed the limit of {limits.max_frames}")
    # A zmq.Frame is a buffer itself (its `.buffer` would make a memoryview per frame); numpy arrays are
    # made on it with one `np.ndarray` call (`np.frombuffer` + `reshape`: two arrays), holding it as `base`.
    bufs = [_buffer(f) for f in frames]
    for i in range(1, len(bufs)):
        n = len(bufs[i])
        if n > limits.max_frame_bytes:
            raise WireError(E_OVERSIZED, f"frame {i} of {n} bytes exceeds the limit of {limits.max_frame_bytes}")
    header, layout = _parse_header(bufs[0], limits)
    if len(frames) - 1 > len(layout) or (len(frames) == 1 and layout):
        raise WireError(
            E_TRUNCATED,
            f"{header.kind}: header lists {len(layout)} arrays but {len(frames) - 1} array frames arrived",
        )
    arrays: dict[str, np.ndarray] = {}
    if len(frames) - 1 == len(layout):  # one frame per array
        for (name, dtype, dt, shape, need, repeated), buf in zip(layout, bufs[1:], strict=True):
            if len(buf) != need:
                raise WireError(E_TRUNCATED, f"{header.kind}: array {name!r} {dtype}{list(shape)} needs {need} "
                                             f"bytes, frame has {len(buf)}")
            if repeated:
                raise WireError(E_MALFORMED, f"{header.kind}: array {name!r} listed twice")
            arrays[name] = _ndarray(shape, dt, buf) if need else np.zeros(shape, dtype=dt)
    else:
        _unpack(header, layout, bufs, arrays)
    message = _NEW_MESSAGE(Message)  # every field given: the frozen __init__'s `object.__setattr__` calls skipped
    message.__dict__.update(header=header, arrays=arrays)
    return message


_ndarray = np.ndarray
_NEW_MESSAGE = object.__new__


def _unpack(header: Header, layout: tuple[Any, ...], bufs: list[Any], arrays: dict[str, np.ndarray]) -> None:
    """Packed frames (`BatchHeaders.frames(pack_below=...)`): a frame of n bytes holds the next arrays in
    order, at least one, then more while their sizes sum under n; they must sum to n exactly, and every
    array must be in a frame. (One array per frame is the case where each frame holds one.)"""
    last = len(bufs) - 1
    i, buf, size, off = 0, None, 0, 0  # frame 0 (the header) as a full frame: the first array opens frame 1
    for name, dtype, dt, shape, need, repeated in layout:
        if off == size:  # this frame is full: the next array opens the next frame
            if i == last:
                raise WireError(E_TRUNCATED, f"{header.kind}: header lists {len(layout)} arrays but the "
                                             f"{last} array frames end before {name!r}")
            i += 1
            buf = bufs[i]
            size, off = len(buf), 0
        if repeated:
            raise WireError(E_MALFORMED, f"{header.kind}: array {name!r} listed twice")
        if off + need > size:
            raise WireError(E_TRUNCATED, f"{header.kind}: array {name!r} {dtype}{list(shape)} needs {need} bytes "
                                         f"at offset {off} of frame {i}, which has {size}")
        arrays[name] = _ndarray(shape, dt, buf, off) if need else np.zeros(shape, dtype=dt)
        off += need
    if off != size or i != last:
        raise WireError(E_TRUNCATED, f"{header.kind}: frame {i} of {size} bytes holds {off} bytes of the arrays "
                                     f"the header lists, and {last - i} array frames follow it")


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


# -- the run token ----------------------------------------------------------------
# A per-run capability (docs/hardening.md): the launcher writes a secret to a
# 0600 file, loaderd reads it with --token-file, and clients send it as
# body["token"] of every request. The daemon compares it in constant time and
# answers UNAUTHORIZED otherwise. It is never echoed, logged or sent back.
TOKEN_ENV = "SLUICE_TOKEN"
TOKEN_USER = "sluice"  # ZMTP PLAIN user name; the token is the password (loaderd/endpoint.py)
TOKEN_MAX_CHARS = 256


def check_token(token: str, where: str) -> str:
    """`token` if it is 16..256 printable ASCII characters without spaces; SpecError naming `where` otherwise."""
    from sluice.errors import SpecError

    if not isinstance(token, str) or not 16 <= len(token) <= TOKEN_MAX_CHARS or not all(
            33 <= ord(c) < 127 for c in token):
        raise SpecError(f"{where}: a run token must be 16 to {TOKEN_MAX_CHARS} printable ASCII characters "
                        "without spaces (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return token


def read_token_file(path: str) -> str:
    """The token in `path` (one line); refuses a file of another user, one other users can read, a link, a
    FIFO or a folder (`fsutil.read_secret_file`), or a malformed token: SpecError naming the file."""
    from sluice.errors import SpecError
    from sluice.fsutil import read_secret_file

    raw = read_secret_file(path, "token file", TOKEN_MAX_CHARS + 2)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SpecError(f"token file {path}: not ASCII text") from None
    return check_token(text, f"token file {path}")


def token_matches(expected: str, given: Any) -> bool:
    """Constant-time comparison of the run token with what a request carried."""
    import hmac

    if not isinstance(given, str) or len(given) > TOKEN_MAX_CHARS:
        return False
    return hmac.compare_digest(expected.encode("ascii"), given.encode("utf-8", "replace"))


def to_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """numpy views -> torch tensors sharing memory (torch imported lazily); numpy if torch is absent."""
    try:
        import torch
    except ImportError:  # torch is optional for the client
        return dict(arrays)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}
