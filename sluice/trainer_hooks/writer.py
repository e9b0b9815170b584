"""The save path: stage the states, write the shards, commit the manifest, publish under the fence.

::

    stage      state_dict() of every stateful; async mode clones tensors to host memory;
               fenced (data) states and the RNG states become JSON bytes
    write      staging/g<G>-s<S>/: one shard per logical key and rank (torch.save, JSON, or
               DCP files), each counted and BLAKE3-hashed while written, fsynced together
    coverage   every expected logical key has its shard(s); sizes on disk match
    manifest   manifest.json written last into the staging folder (the commit record),
               and manifest.mac beside it when an HMAC key is configured
    publish    under the run lock, only if run.json still says generation G:
               rename staging/g<G>-s<S> -> ckpt/s<S>-g<G>, fsync, move `latest`

With W > 1 ranks: rank 0 prepares the staging folder; every rank writes its
shards (replicated statefuls only on rank 0, the others as ``<key>-r<rank>``)
plus a ``rank-<r>.json`` list of what it wrote; after a barrier rank 0
assembles the manifest and publishes; the outcome is broadcast so every rank
raises or commits alike.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError, FencedError, SluiceError
from sluice.trainer_hooks.config import RNG_KEY, Context, SaveReport
from sluice.trainer_hooks.durable import fsync_dir, fsync_file, write_atomic
from sluice.trainer_hooks.layout import MANIFEST_NAME, CheckpointManifest, ShardEntry, ckpt_name, staging_name
from sluice.trainer_hooks.retention import GcReport, collect_garbage
from sluice.trainer_hooks.state import capture_rng, data_summary, encode_json_state
from sluice.trainer_hooks.torchio import clone_to_host, write_dcp, write_shard, write_torch_shard

log = logging.getLogger("sluice.trainer_hooks")


@dataclass
class Staged:
    """One save between `stage` and publish: the states, and what staging them cost."""

    step: int
    generation: int
    t_call: float
    torch_states: dict[str, Any]  # name -> state dict (cloned in async mode)
    json_states: dict[str, bytes]  # name -> JSON bytes (rng, fenced statefuls)
    data_summary: dict[str, Any] | None
    data_seconds: float
    exposed_s: float = 0.0
    blocked_s: float = 0.0

    @property
    def data_bytes(self) -> int:
        return sum(len(v) for k, v in self.json_states.items() if k != RNG_KEY)


class Writer:
    """Writes and publishes checkpoints of `torch_names` (torch states) and `fenced_names` (JSON states)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config, self.coll, self.paths, self.record = ctx.config, ctx.coll, ctx.paths, ctx.record
        self.statefuls, self.fenced_names, self.signer = ctx.statefuls, ctx.fenced_names, ctx.signer
        self.last_gc: GcReport | None = None
        self._host_copy: dict[str, Any] = {}  # the staged host copy of the last async save

    def replicated(self) -> set[str]:
        """Statefuls identical on every rank (written once, by rank 0)."""
        return {n for n in self.statefuls if n in self.config.replicated and n not in self.fenced_names}

    # ------------------------------------------------------------------ stage
    def stage(self, step: int, generation: int, t_call: float, *, clone: bool) -> Staged:
        torch_states: dict[str, Any] = {}
        json_states: dict[str, bytes] = {}
        summary = None
        data_seconds = 0.0
        for name, obj in self.statefuls.items():
            if name in self.fenced_names:
                t0 = time.perf_counter()
                state = obj.state_dict()
                json_states[name] = encode_json_state(state, f"fenced stateful {name!r}")
                if summary is None:
                    summary = data_summary(name, state)
                data_seconds += time.perf_counter() - t0
            else:
                state = obj.state_dict()
                torch_states[name] = clone_to_host(state, self._host_copy.get(name)) if clone else state
        json_states[RNG_KEY] = encode_json_state(capture_rng(), "RNG state")
        if clone:
            self._host_copy = torch_states  # reused by the next save, after this drain ends
        return Staged(step, generation, t_call, torch_states, json_states, summary, data_seconds)

    # ------------------------------------------------------------------ write + publish
    def write_and_publish(self, staged: Staged) -> SaveReport:
        """Write this rank's shards, then (rank 0) verify coverage, write the manifest and publish."""
        step, generation = staged.step, staged.generation
        name = ckpt_name(step, generation)
        stage_dir = self.paths.staging / staging_name(generation, step)
        coll = self.coll
        error: BaseException | None = None
        shards: list[ShardEntry] = []
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
                shards, data_seconds = self._write_rank_shards(stage_dir, staged)
            except BaseException as exc:
                error = exc
        outcome = coll.agree_ok(error is None)  # every rank learns whether all ranks wrote
        manifest: CheckpointManifest | None = None
        status = 0
        if coll.rank == 0:
            try:
                if error is not None:
                    raise error
                if not outcome:
                    raise CheckpointError(f"checkpoint of step {step}: another rank failed to write its shards")
                if coll.world > 1:
                    shards = self._gather_rank_lists(stage_dir)
                manifest = self._commit(stage_dir, staged, shards, name)
                status = 1
            except FencedError as exc:
                error, status = exc, 2
            except BaseException as exc:
                error, status = exc, 0
            if status != 1:
                shutil.rmtree(stage_dir, ignore_errors=True)
        status = coll.broadcast_int(status)
        if status != 1:
            if error is None:  # a rank other than 0: rank 0 holds the reason
                raise (FencedError if status == 2 else CheckpointError)(
                    f"checkpoint of step {step} in {self.paths.root} was not published (see rank 0's error)")
            self._raise_write_error(error, step, generation)
        t_done = time.perf_counter()
        total = manifest.total_bytes if manifest is not None else sum(s.bytes for s in shards)
        report = SaveReport(
            step=step, generation=generation, mode="async" if self.config.async_save else "sync", durable=True,
            exposed_pause_s=staged.exposed_s if self.config.async_save else t_done - staged.t_call,
            blocked_s=staged.blocked_s, durability_lag_s=t_done - staged.t_call, bytes=total,
            data_bytes=staged.data_bytes, data_seconds=data_seconds, name=name,
        )
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

    def _raise_write_error(self, error: BaseException, step: int, generation: int) -> None:
        if isinstance(error, SluiceError) or not isinstance(error, Exception):
            raise error
        # A newer writer may have taken over while we wrote, and its GC may have
        # collected our (now stale) staging folder under us: that is a fence,
        # not a storage fault, and the caller must hear it as one.
        try:
            current = self.record.generation()
        except (OSError, SluiceError):
            current = generation
        if current != generation:
            raise FencedError(
                f"checkpoint of step {step} in {self.paths.root} refused: this writer holds generation "
                f"{generation}, the run record says {current} (a newer writer took over while this one "
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

    def _shard_rank(self, key: str) -> int | None:
        """The rank a shard of `key` is listed under: None when one shard serves every rank."""
        if self.coll.world == 1 or key in self.replicated():
            return None
        return self.coll.rank

    def _write_rank_shards(self, stage_dir: Path, staged: Staged) -> tuple[list[ShardEntry], float]:
        shards: list[ShardEntry] = []
        data_seconds = staged.data_seconds
        coll = self.coll
        if self.config.format == "torch":
            for key, state in staged.torch_states.items():
                rank = self._shard_rank(key)
                if coll.rank != 0 and rank is None:
                    continue
                shards.append(write_torch_shard(stage_dir, key, _file(key, rank, ".pt"), state, rank))
        else:
            shards += write_dcp(stage_dir, staged.torch_states)
        for key, payload in staged.json_states.items():
            t0 = time.perf_counter()
            rank = self._shard_rank(key)
            shards.append(write_shard(stage_dir, key, _file(key, rank, ".json"), "json", rank,
                                      lambda fh, p=payload: fh.write(p)))
            if key in self.fenced_names:
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
        return shards, data_seconds

    def _gather_rank_lists(self, stage_dir: Path) -> list[ShardEntry]:
        shards: list[ShardEntry] = []
        for rank in range(self.coll.world):
            path = stage_dir / f"rank-{rank}.json"
            try:
                entries = json.loads(path.read_bytes())
                shards += [ShardEntry(**e) for e in entries]
            except (OSError, ValueError, TypeError) as exc:
                raise CheckpointError(f"staged checkpoint {stage_dir}: rank {rank}'s shard list is unreadable ({exc})") from exc
            path.unlink()
        return shards

    def _commit(self, stage_dir: Path, staged: Staged, shards: list[ShardEntry], name: str) -> CheckpointManifest:
        """Coverage check, manifest (written last), fenced publish and `latest` (rank 0 only)."""
        step, generation = staged.step, staged.generation
        json_keys = set(staged.json_states)
        if self.config.format == "dcp":
            keys = tuple(sorted(json_keys | {"dcp"}))
        else:
            keys = tuple(sorted(set(self.statefuls) | {RNG_KEY}))
        # The writer's retention travels with the checkpoint, so `sluice ckpt gc`
        # applies the run's own policy by default.
        extra: dict[str, Any] = {"retention": {"keep_last": self.config.keep_last,
                                               "keep_every": self.config.keep_every},
                                 "fenced": sorted(self.fenced_names)}
        if self.config.format == "dcp":
            extra["dcp_keys"] = sorted(staged.torch_states)
        if self.coll.world > 1:
            extra.update(world_size=self.coll.world, replicated=sorted(self.replicated()))
        manifest = CheckpointManifest(
            step=step, generation=generation, format=self.config.format, keys=keys, shards=tuple(shards),
            created_unix_ns=time.time_ns(), run_id=self.config.run_id, data=staged.data_summary, extra=extra,
        )
        missing = manifest.coverage_problems()
        if missing:
            raise CheckpointError(f"staged checkpoint {stage_dir}: {'; '.join(missing)}")
        blob = manifest.to_bytes()
        write_atomic(stage_dir / MANIFEST_NAME, blob)
        if self.signer is not None:
            self.signer.sign_into(stage_dir, blob)
        with self.record.fenced(generation, what=f"publish of step {step}"):
            final = self.paths.ckpt / name
            if final.exists():
                raise CheckpointError(f"checkpoint {final} already exists; generation {generation} saved step {step} twice")
            os.replace(stage_dir, final)
            fsync_dir(self.paths.ckpt)
            fsync_dir(self.paths.staging)
            write_atomic(self.paths.latest, (name + "\n").encode("ascii"))
        return manifest


def _file(key: str, rank: int | None, suffix: str) -> str:
    return f"{key}{suffix}" if rank is None else f"{key}-r{rank}{suffix}"
