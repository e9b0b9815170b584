"""torch and torch.distributed.checkpoint (DCP) I/O of checkpoint shards.

* `torch` format: one ``torch.save`` file per stateful (per rank for the
  non-replicated ones), read back with ``torch.load(weights_only=True)``: a
  shard holding anything but tensors and plain containers is refused.
* `dcp` format: every torch stateful in one ``dcp.save`` folder; its files are
  BLAKE3-hashed after DCP wrote them and verified before ``dcp.load`` (which
  unpickles DCP's own metadata file).

JSON states (RNG, fenced statefuls) never pass through here: they are JSON
shards in both formats. torch is imported inside the functions, so the CLI
and the client never pay for it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import HashingWriter, fsync_dir, hash_file
from sluice.trainer_hooks.layout import ShardEntry
from sluice.trainer_hooks.state import decode_json_state


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


def load_torch_shard(path: Path, map_location: str, where: str) -> Any:
    """torch.load(weights_only=True); CheckpointError naming the shard when torch refuses or fails."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError/EOFError on refused or broken content
        raise CheckpointError(f"{where}: shard {path.name} cannot be loaded safely ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def load_dcp(folder: Path, statefuls: dict[str, Any], legacy_json: dict[str, int]) -> dict[str, Any]:
    """dcp.load into `statefuls` in place; returns the JSON states of `legacy_json` (name -> bytes)
    that an older sluice kept inside the DCP folder. Only call after every DCP file verified."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = dict(statefuls)
    adapters = {name: _JsonTensor(nbytes) for name, nbytes in legacy_json.items()}
    state.update(adapters)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder / "dcp")))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {folder}: dcp.load failed ({type(exc).__name__}: {exc})") from exc
    return {name: a.loaded for name, a in adapters.items()}
