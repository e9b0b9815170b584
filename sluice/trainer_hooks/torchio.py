"""torch and torch.distributed.checkpoint (DCP) I/O of checkpoint shards.

Nothing here ever runs pickle's full unpickler (`load_torch_value`): a
``torch.save`` file vouched for by an unsigned manifest is read by torchzip.py
without any unpickler (tensors and plain containers only); one vouched for by a
manifest signed with the run's key by ``torch.load(weights_only=True)``.

* `torch` format: one ``torch.save`` file per stateful (per rank for the
  non-replicated ones), read back as above; a shard the reader refuses is a
  CheckpointError naming it.
* `dcp` format: every torch stateful in one ``dcp.save`` folder; its files are
  BLAKE3-hashed after DCP wrote them and verified before they are read. DCP's
  own ``.metadata`` (a pickle) is read by dcpmeta.py without pickle and handed
  to ``dcp.load`` checked; DCP's non-tensor values (small ``torch.save`` files)
  are read as above (`_dcp_classes`), never with the ``weights_only=False`` of
  DCP's default planner.

JSON states (RNG, fenced statefuls) never pass through here: they are JSON
shards in both formats. torch is imported inside the functions, so the CLI
and the client never pay for it.
"""

from __future__ import annotations

import functools
import io
import re
import warnings
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import HashingWriter, fsync_dir, hash_file
from sluice.trainer_hooks.layout import CheckpointManifest, ShardEntry
from sluice.trainer_hooks.safepickle import UnsafePickle
from sluice.trainer_hooks.state import decode_json_state
from sluice.trainer_hooks.torchzip import load_plain


def clone_to_host(obj: Any, reuse: Any = None) -> Any:
    """A deep copy of a state dict with every tensor copied into host memory.

    `reuse` is the previous staged copy (free once its drain finished): a tensor
    of the same shape and dtype there is overwritten in place instead of
    allocating a new one, which avoids page-faulting fresh memory on every save.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (isinstance(reuse, torch.Tensor) and reuse.shape == src.shape and reuse.dtype == src.dtype
                and reuse.device.type == "cpu"):
            return reuse.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        prev = reuse if isinstance(reuse, dict) else {}
        items = ((k, clone_to_host(v, prev.get(k))) for k, v in obj.items())
        return dict(items) if type(obj) is dict else type(obj)(items)
    if isinstance(obj, (list, tuple)):
        prev_seq = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        out = [clone_to_host(v, r) for v, r in zip(obj, prev_seq)]
        return out if isinstance(obj, list) else tuple(out)
    return obj  # ints, floats, strings, None: immutable


class ModelOptimState:
    """A Stateful over (model, optimizer) for the DCP format.

    Uses torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict,
    which key the optimizer state by parameter name and create its state tensors
    before a load (a plain ``optimizer.state_dict()`` of a fresh optimizer has no
    state entries, so DCP would silently load nothing into it).
    """

    def __init__(self, model: Any, optimizer: Any | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])


class _JsonTensor:
    """Reads a JSON state that an older sluice stored inside the DCP folder as one uint8 tensor."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.loaded: Any = None
        self._buf = torch.zeros(nbytes, dtype=torch.uint8)

    def state_dict(self) -> dict[str, Any]:
        return {"json": self._buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = decode_json_state(bytes(state_dict["json"].numpy().tobytes()), "DCP JSON state")


def write_torch_shard(folder: Path, key: str, file: str, state: Any, rank: int | None) -> ShardEntry:
    """torch.save `state` into folder/file while counting and hashing its bytes (fsync left to the caller)."""
    import torch

    return write_shard(folder, key, file, "torch", rank, lambda fh: torch.save(state, fh))


def write_shard(folder: Path, key: str, file: str, kind: str, rank: int | None, write: Any) -> ShardEntry:
    """Run `write(file_object)` on a new file, hashing as it goes; the entry the manifest lists for it."""
    writer = HashingWriter(folder / file)
    try:
        write(writer)
        writer.close(fsync=False)  # fsynced together with the other shards
    except BaseException:
        writer.abort()
        raise
    return ShardEntry(key=key, file=file, kind=kind, bytes=writer.bytes, blake3=writer.hexdigest, rank=rank)


def write_dcp(stage_dir: Path, states: dict[str, Any]) -> list[ShardEntry]:
    """dcp.save every torch state into stage_dir/dcp; one `dcp` shard entry per file DCP wrote."""
    import torch.distributed.checkpoint as dcp

    dcp_dir = stage_dir / "dcp"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(dict(states), storage_writer=dcp.FileSystemWriter(str(dcp_dir), sync_files=True))
    fsync_dir(dcp_dir)
    return [ShardEntry(key="dcp", file=rel, kind="dcp", bytes=h.size, blake3=h.hex)
            for rel, h in sorted(
                (p.relative_to(stage_dir).as_posix(), hash_file(p)) for p in dcp_dir.rglob("*") if p.is_file())]


def load_torch_value(source: Path | bytes, map_location: str, signed: bool) -> Any:
    """A torch.save file's object: ``torch.load(weights_only=True)`` when the manifest that vouches for
    it is signed with the run's key, else sluice's reader that runs no unpickler at all (torchzip.py).
    Raises whatever the reader raises (UnsafePickle, or torch's errors)."""
    import torch

    if not signed:
        return load_plain(source, map_location)
    return torch.load(source if isinstance(source, Path) else io.BytesIO(source), map_location=map_location,
                      weights_only=True)


def load_torch_shard(path: Path, map_location: str, where: str, signed: bool = False) -> Any:
    """One torch shard (see load_torch_value); CheckpointError naming the shard when it is refused or broken."""
    try:
        return load_torch_value(path, map_location, signed)
    except UnsafePickle as exc:
        raise CheckpointError(f"{where}: shard {path.name} cannot be loaded safely ({exc}; {UNSIGNED_HINT})") \
            from None
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError/EOFError on refused or broken content
        raise CheckpointError(f"{where}: shard {path.name} cannot be loaded safely ({type(exc).__name__}: "
                              f"{_brief(exc)})") from exc


UNSIGNED_HINT = ("an unsigned checkpoint is read without any unpickler and may hold only tensors and plain "
                 "containers; sign the run (hmac_key_file) to read more with torch.load(weights_only=True)")


def _dcp_load(folder: Path, man: CheckpointManifest, state: dict[str, Any], signed: bool) -> None:
    """dcp.load `state` in place from folder/dcp without any full unpickling; CheckpointError on any failure.

    torch wraps a failure inside dcp.load in CheckpointException, a BaseException:
    it is caught here too, so a bad checkpoint is one restore can skip.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from sluice.trainer_hooks.dcpmeta import read_dcp_metadata

    metadata = read_dcp_metadata(folder, man)
    reader, planner = _dcp_classes()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, storage_reader=reader(folder / "dcp", metadata), planner=planner(signed))
    except CheckpointException as exc:
        causes = [f"{type(e).__name__}: {_brief(e)}" for e, _ in exc.failures.values()]
        for e, _ in exc.failures.values():
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise e from None
        reason = "; ".join(causes) or repr(exc)
        raise CheckpointError(f"checkpoint {folder}: dcp.load failed ({reason})") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint {folder}: dcp.load failed ({type(exc).__name__}: {_brief(exc)})") \
            from exc


def _brief(exc: BaseException) -> str:
    """The line of a torch error that says what was wrong, without its ANSI escapes.

    torch's weights_only refusal spans many lines and opens with advice to retry
    with weights_only=False; the cause is its "WeightsUnpickler error:" line.
    """
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    cause = next((ln for ln in lines if "WeightsUnpickler error:" in ln), lines[0] if lines else "")
    return cause.split("WeightsUnpickler error:", 1)[-1].strip()[:300]


def load_dcp(folder: Path, man: CheckpointManifest, statefuls: dict[str, Any], legacy_json: dict[str, int],
             signed: bool = False) -> dict[str, Any]:
    """dcp.load into `statefuls` in place; returns the JSON states of `legacy_json` (name -> bytes)
    that an older sluice kept inside the DCP folder. Only call after every DCP file verified."""
    from sluice.trainer_hooks.dcpmeta import dcp_files

    held = sum(dcp_files(man).values())
    for name, nbytes in legacy_json.items():  # the manifest's claim, allocated below: bounded by the files
        if nbytes > held:
            raise CheckpointError(f"checkpoint {folder}: the manifest says the DCP files hold {nbytes} bytes of "
                                  f"{name!r} state, they hold {held} bytes in all")
    state: dict[str, Any] = dict(statefuls)
    adapters = {name: _JsonTensor(nbytes) for name, nbytes in legacy_json.items()}
    state.update(adapters)
    _dcp_load(folder, man, state, signed)
    return {name: a.loaded for name, a in adapters.items()}


def load_dcp_flat(folder: Path, man: CheckpointManifest, signed: bool = False) -> dict[str, Any]:
    """Every value of a DCP checkpoint by its flat key (tensors allocated from the checked metadata);
    what a drill and `sluice ckpt verify` load without a model to load into."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from sluice.trainer_hooks.dcpmeta import read_dcp_metadata

    metadata = read_dcp_metadata(folder, man)  # bounds the allocation below by the files' bytes
    state: dict[str, Any] = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for fqn, md in metadata.state_dict_metadata.items()}
    _dcp_load(folder, man, state, signed)
    return state


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """(CheckedReader, WeightsOnlyPlanner): defined on first use, so importing this module never imports torch."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class CheckedReader(FileSystemReader):
        """FileSystemReader that returns metadata read and checked by dcpmeta.py instead of unpickling .metadata."""

        def __init__(self, path: Path, metadata: Any) -> None:
            super().__init__(str(path))
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:  # DCP's fall-back to per-rank metadata: sluice writes none
                raise CheckpointError("per-rank DCP metadata is not read")
            if self._metadata.storage_meta is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values go through load_torch_value (never weights_only=False)."""

        def __init__(self, signed: bool) -> None:
            super().__init__()
            self.signed = signed

        def load_bytes(self, read_item: Any, value: Any) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            try:
                obj = load_torch_value(value.getvalue(), "cpu", self.signed)
            except UnsafePickle as exc:
                raise CheckpointError(f"DCP value {read_item.dest_index.fqn}: {exc}; {UNSIGNED_HINT}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return CheckedReader, WeightsOnlyPlanner


