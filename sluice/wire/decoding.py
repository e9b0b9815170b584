"""The receiving side of the wire format: `decode` validates a multipart message against the receiver's
`Limits` and returns its header and numpy views on its array frames (one frame per array, or packed);
`parse_header` checks frame 0 field by field (or, with msgspec installed, by one typed decode that
accepts exactly what those checks accept), keeping the array layouts it has validated. Every defect
raises `WireError` with a code of `errorcodes`. Nothing is unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np

from sluice.errors import WireError
from sluice.wire.errorcodes import (
    E_BAD_ARRAY,
    E_MALFORMED,
    E_OVERSIZED,
    E_TOO_MANY_FRAMES,
    E_TRUNCATED,
    E_UNKNOWN_KIND,
    E_VERSION,
)
from sluice.wire.protocol import BATCH, DTYPES, HEADER_KEYS, KINDS, PROTOCOL_VERSION, Header, Limits, Message


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
    _REST = _BATCH = None
else:
    def _bounded_int(lo: int) -> Any:
        return Annotated[int, _msgspec.Meta(ge=lo, lt=2**62)]

    _Text = Annotated[str, _msgspec.Meta(max_length=256)]

    class _Fields(_msgspec.Struct, forbid_unknown_fields=True):
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

    class _Rest(_Fields):
        body: dict[str, Any] = _msgspec.field(default_factory=dict)

    class _BatchBody(_msgspec.Struct, forbid_unknown_fields=True):
        """A BATCH body as the daemon writes it (`BatchHeaders.body`); the data state left undecoded."""

        micro_per_step: int
        samples: _msgspec.UnsetType | list[str] = _msgspec.UNSET
        state: _msgspec.UnsetType | _msgspec.Raw = _msgspec.UNSET

    class BatchFields(_Fields):
        """A BATCH header as `decode_batch` reads it: `_Rest`'s fields, the arrays' JSON (`arrays`) and the body."""

        kind: Literal["BATCH"]  # type: ignore[valid-type]
        arrays: _msgspec.Raw
        body: _BatchBody

    _REST = _msgspec.json.Decoder(_Rest)
    _BATCH = _msgspec.json.Decoder(BatchFields)


def decode_batch(frames: Sequence[Any], limits: Limits) -> tuple[Any, bytes | None, dict[str, np.ndarray]] | None:
    """A BATCH message in one typed pass (msgspec, the "fast" extra): its header fields (`BatchFields`), its
    body's data state as JSON bytes (None when absent) and numpy views on its arrays; None for anything else.

    The client's receive path: it takes only what `decode` accepts and reads as the same values (the
    header fields of `_Rest`'s types and bounds, a body of exactly micro_per_step, samples as strings and
    state, arrays whose JSON `_parse_header` validated and kept, a state that is ASCII: msgspec checks the
    JSON it skips but not its UTF-8), and whatever it does not take (another kind, an odd field, arrays
    not seen yet, no msgspec) returns None, for `decode` to decide or raise as always. Arrays are built
    by `decode`'s own code, so frames that do not match the header raise the same WireError.
    The state, left as bytes, is JSON that `json_value` decodes (tests/test_wire_batch_fast.py).
    """
    if _BATCH is None or not 1 < len(frames) <= limits.max_frames or len(frames[0]) > limits.max_header_bytes:
        return None
    try:
        fields = _BATCH.decode(frames[0])
    except Exception:  # noqa: BLE001 - whatever it refuses, `decode` decides (or raises)
        return None
    kept = _SPECS.get(bytes(fields.arrays))
    if kept is None or len(kept[0]) > limits.max_frames - 1:
        return None
    state = fields.body.state
    if state is not _msgspec.UNSET:
        state = bytes(state)
        if not state.isascii():
            return None
    else:
        state = None
    bufs = [_buffer(f) for f in frames]
    for buf in bufs[1:]:
        if len(buf) > limits.max_frame_bytes:
            return None
    return fields, state, _arrays(BATCH, kept[1], bufs)


def json_value(data: bytes) -> Any:
    """The value of JSON `data` as `decode` reads a header's (msgspec, else the stdlib's decoder); ValueError
    (or RecursionError, UnicodeDecodeError) when it is not JSON."""
    return _json_value(data.decode("utf-8"))


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
    arrays = _arrays(header.kind, layout, bufs)
    message = _NEW_MESSAGE(Message)  # every field given: the frozen __init__'s `object.__setattr__` calls skipped
    message.__dict__.update(header=header, arrays=arrays)
    return message


_ndarray = np.ndarray
_NEW_MESSAGE = object.__new__


def decode_header(frames: Sequence[Any], limits: Limits) -> Header:
    """``decode(frames, limits).header``: the same checks and errors, without making the `Message` and its
    arrays dict for a message of one frame (a request: the daemon reads each GET's header only)."""
    if len(frames) != 1 or limits.max_frames < 1:
        return decode(frames, limits).header
    header, layout = _parse_header(_buffer(frames[0]), limits)
    if layout:  # (`decode`'s refusal of a header that lists arrays no frame carries)
        raise WireError(E_TRUNCATED, f"{header.kind}: header lists {len(layout)} arrays but 0 array frames arrived")
    return header


def _arrays(kind: str, layout: tuple[Any, ...], bufs: list[Any]) -> dict[str, np.ndarray]:
    """The arrays of a message of `kind` whose header lists `layout`, as numpy views on `bufs[1:]` (its frames'
    buffers): one frame per array, or packed (`_unpack`); WireError if the frames do not hold exactly them."""
    if len(bufs) - 1 > len(layout) or (len(bufs) == 1 and layout):
        raise WireError(E_TRUNCATED, f"{kind}: header lists {len(layout)} arrays but {len(bufs) - 1} array frames "
                                     "arrived")
    arrays: dict[str, np.ndarray] = {}
    if len(bufs) - 1 == len(layout):  # one frame per array
        for (name, dtype, dt, shape, need, repeated), buf in zip(layout, bufs[1:], strict=True):
            if len(buf) != need:
                raise WireError(E_TRUNCATED, f"{kind}: array {name!r} {dtype}{list(shape)} needs {need} "
                                             f"bytes, frame has {len(buf)}")
            if repeated:
                raise WireError(E_MALFORMED, f"{kind}: array {name!r} listed twice")
            arrays[name] = _ndarray(shape, dt, buf) if need else np.zeros(shape, dtype=dt)
    else:
        _unpack(kind, layout, bufs, arrays)
    return arrays


def _unpack(kind: str, layout: tuple[Any, ...], bufs: list[Any], arrays: dict[str, np.ndarray]) -> None:
    """Packed frames (`BatchHeaders.frames(pack_below=...)`): a frame of n bytes holds the next arrays in
    order, at least one, then more while their sizes sum under n; they must sum to n exactly, and every
    array must be in a frame. (One array per frame is the case where each frame holds one.)"""
    last = len(bufs) - 1
    i, buf, size, off = 0, None, 0, 0  # frame 0 (the header) as a full frame: the first array opens frame 1
    for name, dtype, dt, shape, need, repeated in layout:
        if off == size:  # this frame is full: the next array opens the next frame
            if i == last:
                raise WireError(E_TRUNCATED, f"{kind}: header lists {len(layout)} arrays but the "
                                             f"{last} array frames end before {name!r}")
            i += 1
            buf = bufs[i]
            size, off = len(buf), 0
        if repeated:
            raise WireError(E_MALFORMED, f"{kind}: array {name!r} listed twice")
        if off + need > size:
            raise WireError(E_TRUNCATED, f"{kind}: array {name!r} {dtype}{list(shape)} needs {need} bytes "
                                         f"at offset {off} of frame {i}, which has {size}")
        arrays[name] = _ndarray(shape, dt, buf, off) if need else np.zeros(shape, dtype=dt)
        off += need
    if off != size or i != last:
        raise WireError(E_TRUNCATED, f"{kind}: frame {i} of {size} bytes holds {off} bytes of the arrays "
                                     f"the header lists, and {last - i} array frames follow it")


def to_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """numpy views -> torch tensors sharing memory (torch imported lazily); numpy if torch is absent."""
    try:
        import torch
    except ImportError:  # torch is optional for the client
        return dict(arrays)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}
