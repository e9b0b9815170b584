"""CheckpointManager: model, optimizer, RNG and data state committed together.

A checkpoint is a distributed commit (DESIGN.md section 7)::

    save(step)
      stage      state_dict() of every stateful; async mode clones tensors to host memory
      write      staging/g<G>-s<S>/: one shard per logical key (torch.save, JSON, or DCP files),
                 each counted and BLAKE3-hashed while written, fsynced
      verify     every expected logical key has a shard; sizes on disk match
      manifest   manifest.json written last into the staging folder (the commit record)
      publish    under the run lock, only if run.json still says generation G:
                 rename staging/g<G>-s<S> -> ckpt/s<S>-g<G>, fsync, move `latest`
      on_commit  on_commit(step, G): the data client sends COMMIT to its daemon
      gc         bounded retention + debris collection

    restore()
      acquire    bump the run record's generation: G' = G + 1 (fences the old writer)
      choose     newest committed checkpoint whose shards verify, within the rollback window;
                 damaged ones are logged, reported and retired
      identity   refuse a data state from another dataset or run spec (both values named)
      load       model/optimizer via torch.load(weights_only=True) (or dcp.load), RNG from JSON
      data       on_restore(G') first, then data.load_state_dict(state): the client sends
                 RESTORE(G', lane states) to its daemon with the new generation it was just told

Statefuls are named objects with ``state_dict()`` / ``load_state_dict()``
(torch's Stateful protocol). The one under `data_key` (default ``"data"``) is the
data client: its state is JSON (lane states of strings and integers) and is
stored as its own JSON shard, never pickled. The manager never imports
``sluice.loaderd``.

Async mode: `save` stages an immutable host copy and returns after that (the
exposed pause C); a background thread drains it to storage. The backlog is one
drain: a save that arrives while a drain runs either waits (``policy="block"``,
the wait is part of C) or is dropped (``policy="skip"``, counted in
`skipped_saves` and logged). ``on_commit`` of an async save is delivered on the
caller's thread at the next `save`/`poll`/`wait` (ZeroMQ sockets are not
thread-safe, so the client's COMMIT must be sent from the trainer's thread).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import os
import shutil
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from sluice.errors import CheckpointError, FencedError, SluiceError
from sluice.trainer_hooks.durable import HashingWriter, fsync_dir, fsync_file, hash_file, write_atomic
from sluice.trainer_hooks.layout import (
    MANIFEST_NAME,
    CheckpointManifest,
    Paths,
    ShardEntry,
    ckpt_name,
    staging_name,
)
from sluice.trainer_hooks.retention import GcReport, collect_garbage
from sluice.trainer_hooks.runrecord import RunRecord
from sluice.trainer_hooks.state import (
    capture_rng,
    check_identity,
    data_summary,
    decode_json_state,
    encode_json_state,
    restore_rng,
)
from sluice.trainer_hooks.verify import CheckpointInfo, load_manifest, scan, verify_one

log = logging.getLogger("sluice.trainer_hooks")

RNG_KEY = "rng"
# A checkpoint choice travels between ranks as one int64: step * 2**24 + generation.
_STEP_SCALE = 1 << 24
_NOTHING = -1  # no checkpoint to restore
_FAILED = -2  # rank 0 raised


class _Collective:
    """Tensor-only collectives over a torch.distributed group (nothing is pickled).

    With no group (one process) every operation is the identity.
    """

    def __init__(self, group: Any | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world, self._src = 0, 1, 0
        else:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            self._src = dist.get_global_rank(group, 0)

    @classmethod
    def detect(cls, process_group: Any | None) -> _Collective:
        """The given group, else the default group if torch.distributed runs with > 1 rank."""
        if process_group is not None:
            return cls(process_group)
        dist = sys.modules.get("torch.distributed")  # never import torch.distributed just to look
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.group.WORLD)
        return cls(None)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def broadcast_int(self, value: int) -> int:
        if self.world == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=self._src, group=self.group)
        return int(t.item())

    def agree_ok(self, ok: bool) -> bool:
        """True iff `ok` on every rank."""
        if self.world == 1:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())


def merge_data_states(states: list[Any], where: str) -> dict[str, Any]:
    """One data state holding the lanes of every rank's state (for a resized restore).

    Each state is a dict with a ``lanes`` object; every other top-level field
    (dataset ID, run-spec digest, step, schema) must agree, and a lane held by
    two ranks must hold the same value. Each client then serves its own lanes.
    """
    if not states or not all(isinstance(s, dict) and isinstance(s.get("lanes"), dict) for s in states):
        raise CheckpointError(f"{where}: data states cannot be merged for a resize (each needs a 'lanes' object)")
    first = {k: v for k, v in states[0].items() if k != "lanes"}
    lanes: dict[str, Any] = {}
    for i, state in enumerate(states):
        rest = {k: v for k, v in state.items() if k != "lanes"}
        if rest != first:
            diff = sorted(k for k in set(rest) | set(first) if rest.get(k) != first.get(k))
            raise CheckpointError(f"{where}: data states of rank 0 and rank {i} differ in {diff}")
        for lane, value in state["lanes"].items():
            if lane in lanes and lanes[lane] != value:
                raise CheckpointError(f"{where}: lane {lane} differs between ranks")
            lanes[lane] = value
    return {**first, "lanes": dict(sorted(lanes.items(), key=lambda kv: (len(kv[0]), kv[0])))}


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How a CheckpointManager saves, keeps and restores.

    every: save every N steps (int), ``"auto"`` (Young's interval sqrt(2*C*M) in
    seconds from the measured exposed pause C and `mtbf_s` M), or None (only
    explicit `save` calls).
    """

    every: int | Literal["auto"] | None = None
    mtbf_s: float | None = None
    keep_last: int = 3
    keep_every: int = 0
    rollback_window: int = 3  # damaged checkpoints restore may step over before giving up
    async_save: bool = False
    policy: Literal["block", "skip"] = "block"
    format: Literal["torch", "dcp"] = "torch"
    data_key: str = "data"
    gc_max_deletions: int = 16
    run_id: str | None = None
    map_location: str = "cpu"
    # With several ranks: statefuls equal on every rank (data-parallel replicas),
    # written once by rank 0; all others are written per rank as <key>-r<rank>.
    replicated: tuple[str, ...] = ("model", "optim")

    def __post_init__(self) -> None:
        where = "checkpoint config"
        if self.every == "auto":
            if self.mtbf_s is None or not self.mtbf_s > 0:
                raise CheckpointError(f"{where}: every='auto' needs mtbf_s > 0 (mean time between failures, seconds)")
        elif self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1):
            raise CheckpointError(f"{where}: every must be a positive integer, 'auto' or None, got {self.every!r}")
        if self.rollback_window < 0:
            raise CheckpointError(f"{where}: rollback_window must be >= 0, got {self.rollback_window!r}")
        for name in ("keep_last", "gc_max_deletions"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"{where}: {name} must be >= 1, got {getattr(self, name)!r}")
        if self.keep_every < 0:
            raise CheckpointError(f"{where}: keep_every must be >= 0, got {self.keep_every!r}")
        if self.policy not in ("block", "skip"):
            raise CheckpointError(f"{where}: policy must be 'block' or 'skip', got {self.policy!r}")
        if self.format not in ("torch", "dcp"):
            raise CheckpointError(f"{where}: format must be 'torch' or 'dcp', got {self.format!r}")
        if self.data_key == RNG_KEY or not self.data_key or "/" in self.data_key:
            raise CheckpointError(f"{where}: data_key {self.data_key!r} is reserved or not a plain name")


@dataclass(frozen=True, kw_only=True)
class SaveReport:
    """What one save cost.

    exposed_pause_s: seconds the training thread was stopped (C); for a blocked
    async save this includes the wait for the previous drain.
    durability_lag_s: seconds from the save call until the checkpoint was
    published (None while an async drain runs, or for a skipped save).
    """

    step: int
    generation: int
    mode: Literal["sync", "async"]
    skipped: bool = False
    durable: bool = False
    exposed_pause_s: float = 0.0
    blocked_s: float = 0.0
    durability_lag_s: float | None = None
    bytes: int = 0
    data_bytes: int = 0
    data_seconds: float = 0.0
    name: str | None = None

    def to_obj(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, kw_only=True)
class RestoreReport:
    """What restore found: the checkpoint used (None: nothing to restore) and what it skipped."""

    generation: int
    restored: str | None
    step: int | None
    skipped: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, problems) of damaged checkpoints
    retired: tuple[str, ...] = ()
    seconds: float = 0.0
    data_state: Any = None

    def to_obj(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "restored": self.restored,
            "step": self.step,
            "skipped": [{"name": n, "problems": list(p)} for n, p in self.skipped],
            "retired": list(self.retired),
            "seconds": self.seconds,
        }


def _clone_to_host(obj: Any, reuse: Any = None) -> Any:
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
        items = ((k, _clone_to_host(v, prev.get(k))) for k, v in obj.items())
        return dict(items) if type(obj) is dict else type(obj)(items)
    if isinstance(obj, (list, tuple)):
        prev_seq = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        out = [_clone_to_host(v, r) for v, r in zip(obj, prev_seq)]
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
        from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

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
    """DCP adapter: a JSON state carried as one uint8 tensor, so DCP never pickles it."""

    def __init__(self, nbytes: int = 0, payload: bytes | None = None) -> None:
        """`payload` for a save; `nbytes` (from the manifest) sizes the buffer DCP loads into."""
        import torch

        self.payload = payload
        self.loaded: Any = None
        self._buf = torch.zeros(nbytes, dtype=torch.uint8)

    def state_dict(self) -> dict[str, Any]:
        import torch

        if self.payload is not None:
            return {"json": torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)}
        return {"json": self._buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = decode_json_state(bytes(state_dict["json"].numpy().tobytes()), "DCP JSON state")


@dataclass
class _Staged:
    step: int
    generation: int
    t_call: float
    torch_states: dict[str, Any]  # name -> state dict (cloned in async mode)
    json_states: dict[str, bytes]  # name -> JSON bytes (rng, data)
    data_summary: dict[str, Any] | None
    data_seconds: float
    exposed_s: float = 0.0
    blocked_s: float = 0.0


class CheckpointManager:
    """Save and restore named statefuls as one fenced, verified checkpoint in `root`.

    Typical use::

        data = sluice.client.CheckpointedData(client)
        mgr = CheckpointManager(dir, {"model": model, "optim": opt, "data": data},
                                config=CheckpointConfig(every=50, keep_last=3),
                                on_commit=data.on_commit, on_restore=data.on_restore)
        report = mgr.restore(expected_dataset_id=ds, expected_runspec_digest=spec.digest)
        data.begin(report.generation, fresh=report.step is None)
        start = 0 if report.step is None else report.step + 1
        for step in range(start, steps):
            train_step()
            mgr.maybe_save(step)
        mgr.close()

    on_commit(step, generation) runs after a checkpoint is durable; on_restore(generation)
    runs after the new generation is acquired and before data.load_state_dict().
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        statefuls: Mapping[str, Any],
        *,
        config: CheckpointConfig | None = None,
        on_commit: Callable[[int, int], Any] | None = None,
        on_restore: Callable[[int], Any] | None = None,
        history: int = 64,
        process_group: Any | None = None,
    ) -> None:
        self.config = config or CheckpointConfig()
        self._coll = _Collective.detect(process_group)
        if self._coll.world > 1 and (self.config.async_save or self.config.format != "torch"):
            raise CheckpointError(
                f"checkpoint config: with {self._coll.world} ranks only format='torch' with async_save=False is "
                f"supported (collectives from a drain thread, and DCP across ranks, are not implemented)"
            )
        self.paths = Paths(Path(root))
        self.record = RunRecord(self.paths.root)
        for name, obj in statefuls.items():
            if name == RNG_KEY or not name or "/" in name or name.startswith("."):
                raise CheckpointError(f"stateful name {name!r} is reserved or not a plain file name")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise CheckpointError(f"stateful {name!r} ({type(obj).__name__}) lacks state_dict()/load_state_dict()")
        self.statefuls = dict(statefuls)
        self.on_commit = on_commit
        self.on_restore = on_restore
        self.generation: int | None = None
        self.history: deque[SaveReport] = deque(maxlen=history)
        self.skipped_saves = 0
        self.last_gc: GcReport | None = None
        self._drain: threading.Thread | None = None
        self._drain_error: BaseException | None = None
        self._pending_commits: deque[tuple[int, int]] = deque(maxlen=4)
        self._lock = threading.Lock()
        self._last_save_start: float | None = None
        self._pauses: deque[float] = deque(maxlen=5)
        self._host_copy: dict[str, Any] = {}  # the staged host copy of the last async save

    # ------------------------------------------------------------------ generation
    def begin(self) -> int:
        """Acquire a new generation for a fresh run (restore() does this itself)."""
        self.generation = self._shared(lambda: self.record.acquire(), "acquire a generation")
        log.info("checkpoint writer in %s acquired generation %d", self.paths.root, self.generation)
        return self.generation

    def _require_generation(self) -> int:
        if self.generation is None:
            self.begin()
        assert self.generation is not None
        return self.generation

    # ------------------------------------------------------------------ cadence
    @property
    def interval_s(self) -> float | None:
        """Young's interval sqrt(2*C*M) for every='auto' (None before C is measured)."""
        if self.config.every != "auto" or not self._pauses:
            return None
        cost = sum(self._pauses) / len(self._pauses)
        return math.sqrt(2.0 * cost * float(self.config.mtbf_s or 0.0))

    def should_save(self, step: int) -> bool:
        """Whether the cadence asks for a save at `step` (with several ranks, every rank calls this)."""
        every = self.config.every
        if every is None:
            return False
        if every == "auto":
            # A time-based decision could differ between ranks and deadlock the
            # collective save: rank 0 decides for everyone (one int64 broadcast).
            return bool(self._coll.broadcast_int(int(self._auto_due()) if self._coll.rank == 0 else 0))
        return step % every == 0

    def _auto_due(self) -> bool:
        if self._last_save_start is None:
            return True  # measure C once
        interval = self.interval_s
        return interval is None or time.perf_counter() - self._last_save_start >= interval

    def maybe_save(self, step: int) -> SaveReport | None:
        """save(step) if the cadence says so (also delivers pending async commits)."""
        if self.should_save(step):
            return self.save(step)
        self.poll()
        return None

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> SaveReport:
        """Checkpoint every stateful at `step`; see the module docstring for the protocol.

        Raises FencedError if a newer writer took over, CheckpointError if the
        write failed (the previous checkpoint and `latest` are unchanged), and
        re-raises the error of a failed earlier async drain.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
        t_call = time.perf_counter()
        self.poll()
        generation = self._require_generation()
        mode: Literal["sync", "async"] = "async" if self.config.async_save else "sync"
        blocked = 0.0
        if self._drain is not None and self._drain.is_alive():
            if self.config.policy == "skip":
                self.skipped_saves += 1
                log.warning("checkpoint step %d skipped: the previous save is still draining (policy=skip, %d skipped)",
                            step, self.skipped_saves)
                report = SaveReport(step=step, generation=generation, mode=mode, skipped=True,
                                    exposed_pause_s=time.perf_counter() - t_call)
                self.history.append(report)
                return report
            t_block = time.perf_counter()
            self._drain.join()
            blocked = time.perf_counter() - t_block
            log.info("checkpoint step %d waited %.3f s for the previous drain (policy=block)", step, blocked)
            self.poll()
        self._last_save_start = t_call
        staged = self._stage(step, generation, t_call, clone=self.config.async_save)
        staged.blocked_s = blocked
        if not self.config.async_save:
            report = self._write_and_publish(staged)
            self._pauses.append(report.exposed_pause_s)
            self._deliver_commits()
            return report
        staged.exposed_s = time.perf_counter() - t_call
        self._pauses.append(staged.exposed_s)
        self._drain = threading.Thread(target=self._drain_main, args=(staged,), name=f"sluice-ckpt-drain-{step}",
                                       daemon=True)
        self._drain.start()
        report = SaveReport(step=step, generation=generation, mode="async", exposed_pause_s=staged.exposed_s,
                            blocked_s=blocked, data_bytes=len(staged.json_states.get(self.config.data_key, b"")),
                            data_seconds=staged.data_seconds)
        return report

    def _stage(self, step: int, generation: int, t_call: float, *, clone: bool) -> _Staged:
        torch_states: dict[str, Any] = {}
        json_states: dict[str, bytes] = {}
        summary = None
        data_seconds = 0.0
        for name, obj in self.statefuls.items():
            if name == self.config.data_key:
                t0 = time.perf_counter()
                state = obj.state_dict()
                json_states[name] = encode_json_state(state, f"data stateful {name!r}")
                summary = data_summary(name, state)
                data_seconds = time.perf_counter() - t0
            else:
                state = obj.state_dict()
                torch_states[name] = _clone_to_host(state, self._host_copy.get(name)) if clone else state
        json_states[RNG_KEY] = encode_json_state(capture_rng(), "RNG state")
        if clone:
            self._host_copy = torch_states  # reused by the next save, after this drain ends
        return _Staged(step, generation, t_call, torch_states, json_states, summary, data_seconds)

    def _drain_main(self, staged: _Staged) -> None:
        try:
            report = self._write_and_publish(staged)
        except BaseException as exc:  # surfaced on the trainer thread at the next call
            with self._lock:
                self._drain_error = exc
            log.error("async checkpoint of step %d failed: %s", staged.step, exc)
            return
        del report

    def _write_and_publish(self, staged: _Staged) -> SaveReport:
        """Write this rank's shards, then (rank 0) verify coverage, write the manifest and publish.

        With a process group of W > 1 ranks: rank 0 prepares the staging folder;
        every rank writes its shards (replicated statefuls only on rank 0,
        per-rank ones as ``<key>-r<rank>``) plus a ``rank-<r>.json`` list of what
        it wrote; after a barrier rank 0 assembles the manifest and publishes;
        the outcome is broadcast so every rank raises or commits alike.
        """
        step, generation = staged.step, staged.generation
        name = ckpt_name(step, generation)
        stage_dir = self.paths.staging / staging_name(generation, step)
        coll = self._coll
        error: BaseException | None = None
        shards: list[ShardEntry] = []
        extra: dict[str, Any] = {}
        data_seconds = staged.data_seconds
        if coll.rank == 0:
            try:
                self.paths.staging.mkdir(parents=True, exist_ok=True)
                self.paths.ckpt.mkdir(parents=True, exist_ok=True)
                if stage_dir.exists():
                    shutil.rmtree(stage_dir)  # our own leftover from a failed attempt at this step
                stage_dir.mkdir()
            except BaseException as exc:
                error = exc
        coll.barrier()
        if coll.rank != 0 and not stage_dir.is_dir():
            error = CheckpointError(f"staging folder {stage_dir} was not created by rank 0")
        if error is None:
            try:
                shards, extra, data_seconds = self._write_rank_shards(stage_dir, staged)
            except BaseException as exc:
                error = exc
        outcome = coll.agree_ok(error is None)  # every rank learns whether all ranks wrote
        manifest: CheckpointManifest | None = None
        if coll.rank == 0:
            try:
                if error is not None:
                    raise error
                if not outcome:
                    raise CheckpointError(f"checkpoint of step {step}: another rank failed to write its shards")
                if coll.world > 1:
                    shards = self._gather_rank_lists(stage_dir)
                    extra = {**extra, "world_size": coll.world, "replicated": sorted(self._replicated())}
                manifest = self._commit(stage_dir, staged, shards, extra, name)
                status = 1
            except FencedError as exc:
                error, status = exc, 2
            except BaseException as exc:
                error, status = exc, 0
            if status != 1:
                shutil.rmtree(stage_dir, ignore_errors=True)
        else:
            status = 0
        status = coll.broadcast_int(status)
        if status != 1:
            if error is None:  # a rank other than 0: rank 0 holds the reason
                raise (FencedError if status == 2 else CheckpointError)(
                    f"checkpoint of step {step} in {self.paths.root} was not published (see rank 0's error)")
            self._raise_write_error(error, step)
        t_done = time.perf_counter()
        total = manifest.total_bytes if manifest is not None else sum(s.bytes for s in shards)
        report = SaveReport(
            step=step, generation=generation, mode="async" if self.config.async_save else "sync", durable=True,
            exposed_pause_s=staged.exposed_s if self.config.async_save else t_done - staged.t_call,
            blocked_s=staged.blocked_s, durability_lag_s=t_done - staged.t_call, bytes=total,
            data_bytes=len(staged.json_states.get(self.config.data_key, b"")), data_seconds=data_seconds, name=name,
        )
        with self._lock:
            self.history.append(report)
            self._pending_commits.append((step, generation))
        log.info("checkpoint %s published in %s (%d bytes, lag %.3f s)", name, self.paths.root, report.bytes,
                 report.durability_lag_s)
        if coll.rank == 0:
            try:
                self.last_gc = collect_garbage(self.paths.root, keep_last=self.config.keep_last,
                                               keep_every=self.config.keep_every,
                                               max_deletions=self.config.gc_max_deletions)
            except (OSError, SluiceError) as exc:  # GC failure never fails a published save
                log.warning("checkpoint gc in %s failed: %s", self.paths.root, exc)
        return report

    def _raise_write_error(self, error: BaseException, step: int) -> None:
        if isinstance(error, SluiceError) or not isinstance(error, Exception):
            raise error
        # A newer writer may have taken over while we wrote, and its GC may have
        # collected our (now stale) staging folder under us: that is a fence,
        # not a storage fault, and the caller must hear it as one.
        try:
            current = self.record.generation()
        except (OSError, SluiceError):
            current = self.generation
        if current != self.generation:
            raise FencedError(
                f"checkpoint of step {step} in {self.paths.root} refused: this writer holds generation "
                f"{self.generation}, the run record says {current} (a newer writer took over while this one "
                f"was writing: {error}); nothing was published"
            ) from error
        # torch.save's zip writer turns a failed write (ENOSPC, EFBIG) into a
        # RuntimeError whose context is the OSError: name the OS error.
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        raise CheckpointError(
            f"checkpoint of step {step} in {self.paths.root} failed while writing ({cause or error}); "
            f"the previous checkpoint and `latest` are unchanged"
        ) from error

    def _replicated(self) -> set[str]:
        """Statefuls identical on every rank (written once, by rank 0)."""
        return {n for n in self.statefuls if n in self.config.replicated and n != self.config.data_key}

    def _shard_file(self, key: str, suffix: str) -> str:
        rank = self._coll.rank
        if self._coll.world == 1 or key in self._replicated():
            return f"{key}{suffix}"
        return f"{key}-r{rank}{suffix}"

    def _write_rank_shards(self, stage_dir: Path, staged: _Staged) -> tuple[list[ShardEntry], dict[str, Any], float]:
        shards: list[ShardEntry] = []
        extra: dict[str, Any] = {}
        data_seconds = staged.data_seconds
        coll = self._coll
        if self.config.format == "torch":
            import torch

            for key, state in staged.torch_states.items():
                if coll.rank != 0 and key in self._replicated():
                    continue
                shards.append(self._write_shard(stage_dir, key, self._shard_file(key, ".pt"), "torch",
                                                lambda fh, s=state: torch.save(s, fh)))
        else:
            extra = self._write_dcp(stage_dir, staged, shards)
        for key, payload in staged.json_states.items():
            if self.config.format == "dcp" and key == self.config.data_key:
                continue  # carried inside the DCP state dict
            t0 = time.perf_counter()
            shards.append(self._write_shard(stage_dir, key, self._shard_file(key, ".json"), "json",
                                            lambda fh, p=payload: fh.write(p)))
            if key == self.config.data_key:
                data_seconds += time.perf_counter() - t0
        # One pass of fsyncs after all shards are written: the journal commits
        # once for most of them instead of once per shard.
        for shard in shards:
            if shard.kind != "dcp":  # FileSystemWriter(sync_files=True) fsynced those
                fsync_file(stage_dir / shard.file)
        if coll.world > 1:
            write_atomic(stage_dir / f"rank-{coll.rank}.json",
                         json.dumps([s.to_obj() for s in shards]).encode("ascii"))
        fsync_dir(stage_dir)
        for shard in shards:
            size = (stage_dir / shard.file).stat().st_size
            if size != shard.bytes:
                raise CheckpointError(f"staged shard {stage_dir / shard.file}: {size} bytes on disk, wrote {shard.bytes}")
        return shards, extra, data_seconds

    def _gather_rank_lists(self, stage_dir: Path) -> list[ShardEntry]:
        shards: list[ShardEntry] = []
        for rank in range(self._coll.world):
            path = stage_dir / f"rank-{rank}.json"
            try:
                entries = json.loads(path.read_bytes())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"staged checkpoint {stage_dir}: rank {rank}'s shard list is unreadable ({exc})") from exc
            shards += [ShardEntry(**e) for e in entries]
            path.unlink()
        return shards

    def _commit(self, stage_dir: Path, staged: _Staged, shards: list[ShardEntry], extra: dict[str, Any],
                name: str) -> CheckpointManifest:
        """Coverage check, manifest (written last), fenced publish and `latest` (rank 0 only)."""
        step, generation = staged.step, staged.generation
        present = {s.key for s in shards}
        if self.config.format == "dcp":
            keys = tuple(sorted((set(staged.json_states) - {self.config.data_key}) | {"dcp"}))
            covered = present | set(extra.get("dcp_keys", ())) if "dcp" in present else present
        else:
            keys = tuple(sorted(set(self.statefuls) | {RNG_KEY}))
            covered = present
        missing = [k for k in sorted(set(self.statefuls) | {RNG_KEY} | set(keys)) if k not in covered]
        if self._coll.world > 1:
            for key in sorted(set(self.statefuls) | {RNG_KEY}):
                if key not in self._replicated():
                    count = sum(1 for s in shards if s.key == key)
                    if count != self._coll.world:
                        missing.append(f"{key} ({count} of {self._coll.world} ranks)")
        if missing:
            raise CheckpointError(f"staged checkpoint {stage_dir}: no shard for logical keys {missing}")
        # The writer's retention travels with the checkpoint, so `sluice ckpt gc`
        # applies the run's own policy by default.
        extra = {**extra, "retention": {"keep_last": self.config.keep_last, "keep_every": self.config.keep_every}}
        manifest = CheckpointManifest(
            step=step, generation=generation, format=self.config.format, keys=keys, shards=tuple(shards),
            created_unix_ns=time.time_ns(), run_id=self.config.run_id, data=staged.data_summary, extra=extra,
        )
        write_atomic(stage_dir / MANIFEST_NAME, manifest.to_bytes())
        with self.record.fenced(generation, what=f"publish of step {step}"):
            final = self.paths.ckpt / name
            if final.exists():
                raise CheckpointError(f"checkpoint {final} already exists; generation {generation} saved step {step} twice")
            os.replace(stage_dir, final)
            fsync_dir(self.paths.ckpt)
            fsync_dir(self.paths.staging)
            write_atomic(self.paths.latest, (name + "\n").encode("ascii"))
        return manifest

    @staticmethod
    def _write_shard(folder: Path, key: str, file: str, kind: str, write: Callable[[Any], Any]) -> ShardEntry:
        writer = HashingWriter(folder / file)
        try:
            write(writer)
            writer.close(fsync=False)  # fsynced together with the other shards
        except BaseException:
            writer.abort()
            raise
        return ShardEntry(key=key, file=file, kind=kind, bytes=writer.bytes, blake3=writer.hexdigest)

    def _write_dcp(self, stage_dir: Path, staged: _Staged, shards: list[ShardEntry]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        dcp_dir = stage_dir / "dcp"
        state: dict[str, Any] = dict(staged.torch_states)
        data_key = self.config.data_key
        if data_key in staged.json_states:
            # The data client rides inside the DCP state dict as a Stateful whose
            # JSON state is one uint8 tensor (DCP would pickle plain objects).
            state[data_key] = _JsonTensor(payload=staged.json_states[data_key])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir), sync_files=True))
        fsync_dir(dcp_dir)
        for rel, (digest, nbytes) in sorted(
            (p.relative_to(stage_dir).as_posix(), hash_file(p)) for p in dcp_dir.rglob("*") if p.is_file()
        ):
            shards.append(ShardEntry(key="dcp", file=rel, kind="dcp", bytes=nbytes, blake3=digest[3:]))
        return {"dcp_keys": sorted(state), "dcp_data_bytes": len(staged.json_states.get(data_key, b""))}

    # ------------------------------------------------------------------ async plumbing
    def poll(self) -> None:
        """Raise a failed drain's error; deliver on_commit for drains that finished."""
        with self._lock:
            err, self._drain_error = self._drain_error, None
        if err is not None:
            if isinstance(err, SluiceError):
                raise err
            raise CheckpointError(f"async checkpoint drain failed: {err!r}") from err
        self._deliver_commits()

    def _deliver_commits(self) -> None:
        while True:
            with self._lock:
                if not self._pending_commits:
                    return
                step, generation = self._pending_commits.popleft()
            if self.on_commit is not None:
                self.on_commit(step, generation)

    def wait(self) -> SaveReport | None:
        """Wait for a running drain, deliver its commit, and return the newest durable report."""
        if self._drain is not None:
            self._drain.join()
        self.poll()
        for report in reversed(self.history):
            if report.durable:
                return report
        return None

    def close(self) -> None:
        """Finish any drain (raising its error)."""
        self.wait()

    # ------------------------------------------------------------------ restore
    def restore(
        self,
        *,
        step: int | None = None,
        expected_dataset_id: str | None = None,
        expected_runspec_digest: str | None = None,
    ) -> RestoreReport:
        """Acquire a new generation and load the newest checkpoint that verifies.

        `step` picks a specific older checkpoint instead (an explicit rollback);
        checkpoints above the one restored are retired (moved to DIR/retired/,
        invisible to later restores, removed by GC). Returns a report with
        `restored=None` when the folder holds no checkpoint (fresh start).
        Raises CheckpointError when checkpoints exist but none within the
        rollback window verifies, and StateError when the data state names
        another dataset or run spec than expected.

        With a process group, every rank calls restore(): rank 0 acquires the
        generation and chooses the checkpoint, the choice is broadcast, and each
        rank loads its own shards.
        """
        if self._drain is not None:
            self.wait()
        t0 = time.perf_counter()
        generation = self._shared(lambda: self.record.acquire(), "acquire a generation")
        self.generation = generation
        skipped: list[tuple[str, tuple[str, ...]]] = []

        def choose() -> int:
            infos = scan(self.paths.root)
            if step is not None:
                infos = [i for i in infos if i.step <= step]
            window = self.config.rollback_window
            for info in infos[: window + 1]:  # the newest plus at most `window` older ones
                verify_one(info)
                if info.verified:
                    return info.step * _STEP_SCALE + info.generation
                log.error("checkpoint %s in %s is damaged or incomplete, skipping: %s", info.name, self.paths.root,
                          "; ".join(info.problems))
                skipped.append((info.name, tuple(info.problems)))
            if skipped:
                details = " | ".join(f"{n}: {'; '.join(p)}" for n, p in skipped)
                raise CheckpointError(
                    f"no checkpoint in {self.paths.root} verifies within the rollback window of {window}: {details}"
                )
            return _NOTHING

        picked = self._shared(choose, "choose a checkpoint")
        if picked == _NOTHING:
            log.info("no checkpoint in %s: fresh start at generation %d", self.paths.root, generation)
            return RestoreReport(generation=generation, restored=None, step=None, seconds=time.perf_counter() - t0)
        folder = self.paths.ckpt / ckpt_name(picked // _STEP_SCALE, picked % _STEP_SCALE)
        man = load_manifest(folder)
        chosen = CheckpointInfo(folder.name, folder, man.step, man.generation, man, verified=True)
        where = f"checkpoint {chosen.path}"
        check_identity(man.data, where, dataset_id=expected_dataset_id, runspec_digest=expected_runspec_digest)
        expected = set(self.statefuls) | {RNG_KEY}
        holds = set(man.keys) | set(man.extra.get("dcp_keys", ()))
        missing = sorted(expected - holds)
        if missing:
            raise CheckpointError(f"{where}: holds keys {sorted(holds)}, this manager needs {missing} too")
        if man.format == "torch":
            data_state, rng_file = self._load_torch_format(chosen, man)
        elif man.format == "dcp":
            data_state, rng_file = self._load_dcp(chosen, man), f"{RNG_KEY}.json"
        else:
            raise CheckpointError(f"{where}: unknown format {man.format!r}")
        restore_rng(decode_json_state((chosen.path / rng_file).read_bytes(), f"{where}/{rng_file}"),
                    f"{where}/{rng_file}")
        retired: list[str] = []
        self._shared(lambda: retired.extend(self._retire_above(generation, chosen)) or 0, "retire newer checkpoints")
        if self.on_restore is not None:
            self.on_restore(generation)
        data_key = self.config.data_key
        if data_key in self.statefuls and data_state is not None:
            self.statefuls[data_key].load_state_dict(data_state)
        report = RestoreReport(generation=generation, restored=chosen.name, step=chosen.step, skipped=tuple(skipped),
                               retired=tuple(retired), seconds=time.perf_counter() - t0, data_state=data_state)
        log.info("restored %s from %s at generation %d (%.3f s, skipped %s)", chosen.name, self.paths.root,
                 generation, report.seconds, [n for n, _ in skipped])
        return report

    def _shared(self, fn: Callable[[], int], what: str) -> int:
        """Run `fn` on rank 0 and broadcast its integer result; an error on rank 0 is raised on every rank."""
        coll = self._coll
        value, error = _FAILED, None
        if coll.rank == 0:
            try:
                value = int(fn())
            except BaseException as exc:
                error = exc
        value = coll.broadcast_int(value)
        if error is not None:
            raise error
        if value == _FAILED:
            raise CheckpointError(f"checkpoint folder {self.paths.root}: rank 0 failed to {what} (see its error)")
        return value

    def _load_torch_format(self, chosen: CheckpointInfo, man: CheckpointManifest) -> tuple[Any, str]:
        """Load torch.save shards (weights_only) into the statefuls; return (data state, rng file)."""
        import torch

        where = f"checkpoint {chosen.path}"
        rank, world = self._coll.rank, self._coll.world
        saved_world = int(man.extra.get("world_size", 1))
        replicated = set(man.extra.get("replicated", ()))
        src = rank % saved_world  # a resized run takes per-rank torch/RNG state round-robin

        def file_of(key: str, suffix: str) -> str:
            return f"{key}{suffix}" if saved_world == 1 or key in replicated else f"{key}-r{src}{suffix}"

        data_key = self.config.data_key
        for name, obj in self.statefuls.items():
            if name == data_key:
                continue
            file = file_of(name, ".pt")
            try:
                state = torch.load(chosen.path / file, map_location=self.config.map_location, weights_only=True)
            except Exception as exc:  # torch raises UnpicklingError/RuntimeError on refused content
                raise CheckpointError(f"{where}: shard {file} cannot be loaded safely ({exc})") from exc
            obj.load_state_dict(state)
        data_state = None
        if data_key in self.statefuls:
            if saved_world == 1 or saved_world == world:
                file = file_of(data_key, ".json")
                data_state = decode_json_state((chosen.path / file).read_bytes(), f"{where}/{file}")
            else:
                data_state = merge_data_states(
                    [decode_json_state((chosen.path / f"{data_key}-r{r}.json").read_bytes(),
                                       f"{where}/{data_key}-r{r}.json") for r in range(saved_world)],
                    where)
        return data_state, file_of(RNG_KEY, ".json")

    def _load_dcp(self, chosen: CheckpointInfo, man: CheckpointManifest) -> Any:
        """Load via dcp.load; only after every DCP file matched its BLAKE3 (DCP unpickles its metadata)."""
        import torch.distributed.checkpoint as dcp

        data_key = self.config.data_key
        state: dict[str, Any] = {n: o for n, o in self.statefuls.items() if n != data_key}
        adapter = None
        if data_key in self.statefuls:
            adapter = _JsonTensor(nbytes=int(man.extra.get("dcp_data_bytes", 0)))
            state[data_key] = adapter
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(chosen.path / "dcp")))
        except Exception as exc:
            raise CheckpointError(f"checkpoint {chosen.path}: dcp.load failed ({exc})") from exc
        return adapter.loaded if adapter is not None else None

    def _retire_above(self, generation: int, chosen: CheckpointInfo) -> list[str]:
        """Move committed folders ordered above `chosen` to retired/ and point `latest` at it."""
        retired: list[str] = []
        with self.record.fenced(generation, what=f"restore of {chosen.name}"):
            above = [i for i in scan(self.paths.root) if (i.step, i.generation) > (chosen.step, chosen.generation)]
            if above:
                dest = self.paths.root / "retired"
                dest.mkdir(exist_ok=True)
                for info in above:
                    os.replace(info.path, dest / f"{info.name}.{time.time_ns()}")
                    retired.append(info.name)
                fsync_dir(self.paths.ckpt)
                fsync_dir(dest)
            write_atomic(self.paths.latest, (chosen.name + "\n").encode("ascii"))
        if retired:
            log.warning("restore of %s retired newer checkpoints %s (moved to %s/retired)", chosen.name, retired,
                        self.paths.root)
        return retired
