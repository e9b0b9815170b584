"""A ``torch.save`` file read without pickle: tensors and plain containers only.

A checkpoint whose manifest is not signed with the run's key is only as
trustworthy as the folder's permissions, so sluice reads its torch shards (and
DCP's non-tensor values, which are small ``torch.save`` files too) without any
unpickler, not even torch's ``weights_only`` one (which has had holes of its
own). `load_plain` opens the zip that ``torch.save`` writes, interprets its
``data.pkl`` with `safepickle.PickleReader`, and builds each tensor from the raw
bytes of its storage entry:

    tensors       _rebuild_tensor_v2/v3 over typed or untyped storages of any
                  plain dtype, _rebuild_parameter, views (offset, stride) checked
                  to lie inside their storage
    containers    dict, OrderedDict (with a module state dict's `_metadata`),
                  list, tuple, set (a subset of what weights_only reads)
    values        None, bool, int, float, complex, str, bytes, bytearray,
                  torch.Size, torch.device, dtypes

Anything else (sparse, quantized or subclassed tensors, numpy objects, any
other class) is refused with `UnsafePickle` naming it; signing the run
(`hmac_key_file`) lets restore read such a shard with
``torch.load(weights_only=True)`` instead. Storage entries must be stored
uncompressed with exactly the bytes their tensors need, so a small file cannot
expand into a large allocation.
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sluice.trainer_hooks.safepickle import Global, PickleReader, UnsafePickle

_MAX_PICKLE_BYTES = 256 << 20
_STORAGE_DTYPES = {  # legacy typed storage class -> dtype
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


class _StorageType:
    """A storage class named by the pickle: typed (a dtype) or untyped (None: bytes)."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype


class _Storage:
    """One storage entry's bytes as a flat tensor of `dtype` (uint8 for an untyped storage)."""

    def __init__(self, flat: Any, typed: bool) -> None:
        self.flat, self.typed = flat, typed

    def view(self, dtype: Any) -> Any:
        if self.typed:
            if dtype is not None and dtype != self.flat.dtype:
                raise UnsafePickle(f"a {dtype} tensor over a {self.flat.dtype} storage")
            return self.flat
        if dtype is None or self.flat.numel() % max(dtype.itemsize, 1):
            raise UnsafePickle(f"an untyped storage of {self.flat.numel()} bytes read as {dtype}")
        return self.flat.view(dtype)


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if type(v) not in (tuple, list) or len(v) > 64 or any(type(d) is not int or d < 0 for d in v):
        raise UnsafePickle(f"{what} {str(v)[:80]} is not a tuple of at most 64 non-negative integers")
    return tuple(v)


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
             dtype: Any = None, metadata: Any = None) -> Any:
    import torch

    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0 \
            or type(requires_grad) is not bool or hooks or metadata:
        raise UnsafePickle("a tensor with backward hooks, metadata or malformed storage arguments")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise UnsafePickle(f"tensor dtype {str(dtype)[:80]}")
    size, stride = _ints(size, "tensor size"), _ints(stride, "tensor stride")
    flat = storage.view(dtype)
    if len(size) != len(stride):
        raise UnsafePickle(f"tensor size {list(size)} and stride {list(stride)} differ in length")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= flat.numel():
        raise UnsafePickle(f"a tensor view (offset {offset}, size {list(size)}, stride {list(stride)}) "
                           f"outside its storage of {flat.numel()} elements")
    t = torch.as_strided(flat, size, stride, offset) if flat.numel() else torch.empty(size, dtype=flat.dtype)
    return t.requires_grad_() if requires_grad else t


def _arity(low: int, high: int, fn: Any) -> Any:
    def reduce(args: tuple) -> Any:
        if not low <= len(args) <= high:
            raise UnsafePickle(f"{getattr(fn, '__name__', fn)} with {len(args)} arguments")
        return fn(*args)
    return reduce


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                metadata: Any = None) -> Any:
    return _rebuild(storage, offset, size, stride, requires_grad, hooks, None, metadata)


def _parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> Any:
    import torch

    if not isinstance(data, torch.Tensor) or type(requires_grad) is not bool or hooks or state:
        raise UnsafePickle("a Parameter with hooks, state or non-tensor data")
    return torch.nn.Parameter(data, requires_grad=requires_grad)


def _ordered_build(obj: Any, state: Any) -> None:  # a module state dict's `_metadata` (versions of its modules)
    if type(state) is not dict or set(state) - {"_metadata"} or type(state.get("_metadata", {})) not in (
            dict, OrderedDict):
        raise UnsafePickle("an OrderedDict with attributes other than _metadata")
    if "_metadata" in state:
        obj._metadata = state["_metadata"]


def _one(kind: type, *allowed: type) -> Global:
    def reduce(args: tuple) -> Any:
        if len(args) > 1 or (args and type(args[0]) not in allowed):
            raise UnsafePickle(f"{kind.__name__} of {str(args)[:80]}")
        return kind(*args)
    return Global(reduce=reduce)


@functools.cache
def _table() -> dict[str, Global]:
    import torch

    def size(args: tuple) -> Any:
        if len(args) != 1:
            raise UnsafePickle("torch.Size with extra arguments")
        return torch.Size(_ints(args[0], "torch.Size"))

    def device(args: tuple) -> Any:
        if not 1 <= len(args) <= 2 or type(args[0]) is not str or (len(args) == 2 and type(args[1]) is not int):
            raise UnsafePickle(f"torch.device of {str(args)[:80]}")
        return torch.device(*args)

    def encode(args: tuple) -> bytes:  # protocol 2 pickles bytes as _codecs.encode(text, "latin1")
        if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
            raise UnsafePickle("_codecs.encode other than of a latin1 string")
        return args[0].encode("latin1")

    table = {
        "collections OrderedDict": Global(reduce=_arity(0, 0, OrderedDict), build=_ordered_build, bare_ok=True),
        "torch._utils _rebuild_tensor_v2": Global(reduce=_arity(6, 7, _rebuild_v2)),
        "torch._utils _rebuild_tensor_v3": Global(reduce=_arity(7, 8, _rebuild)),
        "torch._utils _rebuild_parameter": Global(reduce=_arity(3, 3, _parameter)),
        "torch._utils _rebuild_parameter_with_state": Global(reduce=_arity(4, 4, _parameter)),
        "torch Size": Global(reduce=size),
        "torch device": Global(reduce=device),
        "_codecs encode": Global(reduce=encode),
        "torch.storage UntypedStorage": Global(value=_StorageType(None)),
    }
    for module in ("builtins", "__builtin__"):
        table[f"{module} set"] = _one(set, list, tuple)
        table[f"{module} bytearray"] = _one(bytearray, bytes)
        table[f"{module} complex"] = Global(reduce=_arity(1, 2, _complex))
    for name, dtype in _STORAGE_DTYPES.items():
        table[f"torch {name}"] = Global(value=_StorageType(getattr(torch, dtype)))
    for name in dir(torch):
        if isinstance(getattr(torch, name), torch.dtype):
            table[f"torch {name}"] = Global(value=getattr(torch, name))
    return table


def _complex(real: Any, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise UnsafePickle(f"complex of {str((real, imag))[:80]}")
    return complex(real, imag)


def load_plain(source: str | Path | bytes, map_location: str = "cpu") -> Any:
    """The object a ``torch.save`` file holds, built without pickle; UnsafePickle names what is refused."""
    import torch

    try:
        fh: Any = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")  # noqa: SIM115
    except OSError as exc:
        raise UnsafePickle(f"cannot be opened ({exc.strerror})") from None
    with fh:
        try:
            zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise UnsafePickle(f"not a torch.save zip file ({exc})") from None
        names = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(names) != 1:
            raise UnsafePickle("not a torch.save zip file (no single <archive>/data.pkl)")
        prefix = names[0][: -len("data.pkl")]
        order = _read_entry(zf, fh, prefix + "byteorder", 16, required=False)
        order = None if order is None else order.numpy().tobytes()
        if order not in (None, b"little"):
            raise UnsafePickle(f"byte order {order!r}; only little-endian files are read")
        storages: dict[str, _Storage] = {}

        def persistent(pid: Any) -> _Storage:
            if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" \
                    or not isinstance(pid[1], _StorageType) or type(pid[2]) is not str or type(pid[4]) is not int:
                raise UnsafePickle(f"persistent ID {str(pid)[:80]}")
            stype, key, numel = pid[1], pid[2], pid[4]
            if key not in storages:
                dtype = stype.dtype if stype.dtype is not None else torch.uint8
                raw = _read_entry(zf, fh, f"{prefix}data/{key}", numel * dtype.itemsize, exact=True)
                storages[key] = _Storage(raw.view(dtype), typed=stype.dtype is not None)
            return storages[key]

        data = _read_entry(zf, fh, names[0], _MAX_PICKLE_BYTES).numpy().tobytes()
        obj = PickleReader(_table(), persistent=persistent).load(data)
    return obj if map_location == "cpu" else _to(obj, torch.device(map_location))


def _read_entry(zf: zipfile.ZipFile, fh: Any, name: str, limit: int, *, exact: bool = False,
                required: bool = True) -> Any:
    """The bytes of one stored (uncompressed) entry as a uint8 tensor, read straight into it, CRC checked."""
    import torch

    try:
        info = zf.getinfo(name)
    except KeyError:
        if required:
            raise UnsafePickle(f"entry {name} is missing") from None
        return None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > limit or (exact and info.file_size != limit):
        raise UnsafePickle(f"entry {name}: {info.file_size} bytes (compression {info.compress_type}), "
                           f"expected {'exactly' if exact else 'at most'} {limit} stored bytes")
    # zipfile would read the entry into bytes and a tensor needs a writable copy of them: reading
    # into an uninitialised tensor from the entry's offset leaves one copy and no zero-filling.
    fh.seek(info.header_offset)
    head = fh.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise UnsafePickle(f"entry {name}: no local header at offset {info.header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    fh.seek(info.header_offset + 30 + name_len + extra_len)
    buf = torch.empty(info.file_size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    if (fh.readinto(view) if info.file_size else 0) != info.file_size or zlib.crc32(view) != info.CRC:
        raise UnsafePickle(f"entry {name}: truncated, or its CRC differs")
    return buf


def _to(obj: Any, device: Any) -> Any:
    """`obj` with every tensor moved to `device` (what torch.load's map_location does)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if type(obj) in (dict, OrderedDict):
        out = type(obj)((k, _to(v, device)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_to(v, device) for v in obj)
    return obj
