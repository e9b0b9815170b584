"""DCP's ``.metadata`` read without pickle and checked against the manifest before DCP sees it.

`read_dcp_metadata` reads ``dcp/.metadata`` with `safepickle.PickleReader`,
which admits only the classes torch's DCP metadata is made of (``Metadata``,
``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, ``_StorageInfo``),
``torch.Size``, dtypes, the strided layout and plain containers. The result is
then checked field by field: every storage entry names a DCP file the manifest
lists and stays inside it, every chunk lies inside its tensor, and the tensors
together hold no more bytes than the listed files (so a forged size cannot make
a drill allocate terabytes). Anything else is refused with CheckpointError
naming the checkpoint and the reason; `dcp.load` is then given the checked
object and never opens ``.metadata`` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path, PurePosixPath
from typing import Any

import blake3

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import read_small
from sluice.trainer_hooks.layout import CheckpointManifest
from sluice.trainer_hooks.safepickle import Global, PickleReader, UnsafePickle

METADATA_FILE = "dcp/.metadata"
MAX_METADATA_BYTES = 256 << 20  # ~100 bytes per tensor chunk: millions of chunks
_MAX_DIMS = 64


def _fill_dataclass(cls: type) -> Global:
    """NEWOBJ (+ BUILD(dict)) of a dataclass: exactly its fields, defaults for the missing ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = {n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    def new() -> Any:
        obj = object.__new__(cls)
        for f in fields.values():
            if f.name not in required:  # torch's own defaults and factories (list, the default dtype)
                v = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                object.__setattr__(obj, f.name, v)  # MetadataIndex is a frozen dataclass
        return obj

    def build(obj: Any, state: Any) -> None:
        if type(state) is not dict or any(type(k) is not str for k in state):
            raise UnsafePickle(f"{cls.__name__}: state is not a dict of field names")
        unknown, missing = sorted(set(state) - set(fields)), sorted(required - set(state))
        if unknown or missing:
            raise UnsafePickle(f"{cls.__name__}: unknown field(s) {unknown}, missing field(s) {missing}")
        for k, v in state.items():
            object.__setattr__(obj, k, v)

    return Global(new=new, build=build, bare_ok=not required)


@functools.cache
def _table() -> dict[str, Global]:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata as m

    encodings = {e.value: e for e in m._MEM_FORMAT_ENCODING}
    formats = {m._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
               m._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
               m._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format}

    def props(obj: Any, state: Any) -> None:  # TensorProperties pickles a 5-tuple (its __getstate__)
        if type(state) is not tuple or len(state) != 5 or state[3] not in formats:
            raise UnsafePickle("TensorProperties: state is not (dtype, layout, requires_grad, format, pin_memory)")
        for name, v in zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), state, strict=True):
            object.__setattr__(obj, name, formats[v] if name == "memory_format" else v)

    def size(args: tuple) -> Any:
        if len(args) != 1 or type(args[0]) not in (list, tuple) or len(args[0]) > _MAX_DIMS \
                or any(type(d) is not int or not 0 <= d < 1 << 62 for d in args[0]):
            raise UnsafePickle(f"torch.Size of {str(args)[:80]}")
        return torch.Size(args[0])

    def layout(args: tuple) -> Any:
        if args != ("torch.strided",):
            raise UnsafePickle(f"layout {str(args)[:80]} (only torch.strided tensors are read)")
        return torch.strided

    def encoding(args: tuple) -> Any:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in encodings:
            raise UnsafePickle(f"_MEM_FORMAT_ENCODING of {str(args)[:80]}")
        return encodings[args[0]]

    def path(args: tuple) -> str:  # StorageMeta.checkpoint_id: kept as a string, never used to open anything
        if any(type(a) is not str for a in args):
            raise UnsafePickle("a path of non-strings")
        return str(PurePosixPath(*args))

    table = {f"{cls.__module__} {cls.__name__}": _fill_dataclass(cls) for cls in (
        m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata, m.MetadataIndex,
        m.StorageMeta, filesystem._StorageInfo)}
    table[f"{m.__name__} TensorProperties"] = Global(new=lambda: object.__new__(m.TensorProperties), build=props)
    table[f"{m.__name__} _MEM_FORMAT_ENCODING"] = Global(reduce=encoding)
    table["torch Size"] = Global(reduce=size)
    table["torch.serialization _get_layout"] = Global(reduce=layout)
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        table[f"pathlib {cls}"] = Global(reduce=path)
    for name in dir(torch):
        if isinstance(getattr(torch, name), torch.dtype):
            table[f"torch {name}"] = Global(value=getattr(torch, name))
    return table


def dcp_files(man: CheckpointManifest) -> dict[str, int]:
    """The DCP data files the manifest lists (name inside dcp/ -> bytes), .metadata excluded."""
    return {s.file[len("dcp/"):]: s.bytes for s in man.shards
            if s.kind == "dcp" and s.file.startswith("dcp/") and s.file != METADATA_FILE}


def read_dcp_metadata(folder: Path, man: CheckpointManifest) -> Any:
    """The checked DCP Metadata of the checkpoint in `folder`; CheckpointError naming why it is refused."""
    where = f"checkpoint {folder}: {METADATA_FILE}"
    entry = next((s for s in man.shards if s.file == METADATA_FILE and s.kind == "dcp"), None)
    if entry is None:
        raise CheckpointError(f"{where}: not listed in the manifest of a DCP checkpoint")
    if entry.bytes > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where}: {entry.bytes} bytes, more than the {MAX_METADATA_BYTES} read")
    data = read_small(folder / METADATA_FILE, MAX_METADATA_BYTES, f"checkpoint {folder}:")
    if data is None:
        raise CheckpointError(f"{where}: missing")
    # The digest was checked when the checkpoint was chosen; these are the bytes actually parsed.
    if len(data) != entry.bytes or blake3.blake3(data).hexdigest() != entry.blake3:
        raise CheckpointError(f"{where}: changed since the manifest was written (size or BLAKE3 differs)")
    try:
        md = PickleReader(_table()).load(data)
        _check(md, dcp_files(man))
    except UnsafePickle as exc:
        raise CheckpointError(f"{where}: refused, not plain DCP metadata ({exc}); it is never unpickled") from None
    return md


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise UnsafePickle(what)


def _is_size(v: Any, dims: int | None = None) -> bool:
    import torch

    return type(v) is torch.Size and (dims is None or len(v) == dims)


def _check(md: Any, files: dict[str, int]) -> None:
    """Field-by-field check of a Metadata built by the reader (types, references, bounds)."""
    import torch
    from torch.distributed.checkpoint import filesystem, metadata as m

    _need(type(md) is m.Metadata, f"the file holds a {type(md).__name__}, not a DCP Metadata")
    sdm = md.state_dict_metadata
    _need(type(sdm) is dict, "state_dict_metadata is not a dict")
    tensor_bytes = 0
    for fqn, item in sdm.items():
        _need(type(fqn) is str, f"state_dict_metadata key {fqn!r:.80} is not a string")
        if type(item) is m.BytesStorageMetadata:
            continue
        _need(type(item) is m.TensorStorageMetadata, f"{fqn}: a {type(item).__name__}, not tensor or bytes metadata")
        p = item.properties
        _need(type(p) is m.TensorProperties and isinstance(p.dtype, torch.dtype) and p.layout is torch.strided
              and type(p.requires_grad) is bool and type(p.pin_memory) is bool, f"{fqn}: malformed tensor properties")
        _need(_is_size(item.size) and type(item.chunks) is list and item.chunks, f"{fqn}: malformed size or chunks")
        for c in item.chunks:
            _need(type(c) is m.ChunkStorageMetadata and _is_size(c.offsets, len(item.size))
                  and _is_size(c.sizes, len(item.size))
                  and all(o + s <= d for o, s, d in zip(c.offsets, c.sizes, item.size, strict=True)),
                  f"{fqn}: a chunk outside the tensor's size {list(item.size)}")
        tensor_bytes += math.prod(item.size) * p.dtype.itemsize
    _need(tensor_bytes <= sum(files.values()),
          f"its tensors would hold {tensor_bytes} bytes, the DCP files the manifest lists hold {sum(files.values())}")
    storage = md.storage_data
    _need(type(storage) is dict, "storage_data is not a dict")
    for index, info in storage.items():
        _need(type(index) is m.MetadataIndex and index.fqn in sdm
              and (index.offset is None or _is_size(index.offset))
              and (index.index is None or type(index.index) is int), f"a storage key {index!r:.120} names no entry")
        _need(type(info) is filesystem._StorageInfo, f"{index.fqn}: storage info is a {type(info).__name__}")
        size = files.get(info.relative_path) if type(info.relative_path) is str else None
        _need(size is not None, f"{index.fqn}: file {str(info.relative_path)!r:.80} is not a DCP file of the manifest")
        _need(type(info.offset) is int and type(info.length) is int and 0 <= info.offset
              and 0 <= info.length and info.offset + info.length <= size,
              f"{index.fqn}: bytes [{info.offset}, +{info.length}) lie outside {info.relative_path} ({size} bytes)")
        _need(not info.transform_descriptors, f"{index.fqn}: stream transforms {info.transform_descriptors!r:.80} "
                                              "(sluice writes none)")
    meta = md.storage_meta
    ids = () if meta is None else (meta.checkpoint_id, meta.save_id, meta.load_id)
    _need(meta is None or (type(meta) is m.StorageMeta and type(meta.modules) is list
                           and all(v is None or type(v) is str for v in ids)), "malformed storage_meta")
    _need(md.planner_data is None or type(md.planner_data) is dict, "planner_data is not a dict")
    _need(md.version is None or type(md.version) is str, "version is not a string")
