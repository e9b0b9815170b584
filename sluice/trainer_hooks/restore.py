"""The restore path: choose a checkpoint, read it whole, then apply it.

::

    choose   (rank 0) newest committed checkpoint whose manifest parses, validates,
             carries a good MAC (with a key) and whose listed shards match their
             sizes and BLAKE3 digests, within the rollback window
    read     (every rank) exactly the files the manifest lists for this rank:
             torch shards without any unpickler (torch.load(weights_only=True) under a
             signed manifest; torchio.load_torch_value), or dcp.load with DCP's metadata
             read without pickle (dcpmeta.py), JSON states, RNG states checked field by
             field, the saved ranks' data states merged after a resize. A checkpoint any
             rank cannot read (any error but a refusal of another dataset, run spec or
             trainer, torch's BaseException CheckpointException included) is skipped, with
             its reason logged and reported, and the next older one is tried (same window)
    apply    fence(G), check_resize(S, W) after a resize (the client refuses one under
             `resume = "exact"`), and reset(state) on every fenced stateful (the daemon refuses
             a state of another dataset or run spec) before the model is touched, then
             load_state_dict on the others, then the RNG states
    retire   (rank 0) checkpoints above the restored one move to DIR/retired/, `latest`
             points at the restored one

Nothing is applied before every rank read its part of the chosen checkpoint;
an error while applying is raised on every rank (never a split where one rank
trains and another does not).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError, CheckpointMismatch, StateError
from sluice.trainer_hooks.config import RNG_KEY, Context, RestoreReport
from sluice.trainer_hooks.durable import fsync_dir, write_atomic
from sluice.trainer_hooks.layout import CheckpointManifest, ckpt_name
from sluice.trainer_hooks.state import RngState, check_identity, parse_rng
from sluice.trainer_hooks.verify import (CheckpointInfo, load_checkpoint_manifest, read_fenced_state, read_json_shard,
                                         scan, verify_one)

log = logging.getLogger("sluice.trainer_hooks")

_NOTHING = -1  # no checkpoint to restore (the step rank 0 broadcasts)
# Errors while reading a checkpoint that stop the restore instead of skipping to an older one:
# a checkpoint of another trainer or dataset (no older one fits either) and interrupts.
_STOP = (CheckpointMismatch, StateError, KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass
class _Loaded:
    """One checkpoint read into memory for this rank, not yet applied."""

    folder: Path
    manifest: CheckpointManifest
    torch_states: dict[str, Any]
    fenced_states: dict[str, Any]
    rng: RngState


class Restorer:
    """Restores `statefuls` (of which `fenced_names` speak FencedStateful) from the checkpoints in `paths`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config, self.coll, self.paths, self.record = ctx.config, ctx.coll, ctx.paths, ctx.record
        self.statefuls, self.fenced_names, self.signer = ctx.statefuls, ctx.fenced_names, ctx.signer

    def restore(self, generation: int, *, step: int | None = None, expected_dataset_id: str | None = None,
                expected_runspec_digest: str | None = None) -> RestoreReport:
        """Restore the newest good checkpoint (at or below `step`) under `generation`; see the module docstring."""
        t0 = time.perf_counter()
        coll, root = self.coll, self.paths.root
        skipped: list[tuple[str, tuple[str, ...]]] = []
        candidates = self._candidates(step) if coll.rank == 0 else []
        window = self.config.rollback_window
        chosen_generation = [0]

        def choose() -> int:
            """The step of the next candidate that verifies (its generation in chosen_generation)."""
            while candidates and len(skipped) <= window:
                info = candidates.pop(0)
                try:
                    verify_one(info)
                except Exception as exc:  # an unreadable shard (EACCES, EIO) is a damaged checkpoint too
                    info.verified, info.problems = False, [f"cannot be verified ({type(exc).__name__}: {exc})"]
                if info.verified:
                    chosen_generation[0] = info.generation
                    return info.step
                self._skip(info.name, tuple(info.problems), skipped)
            if skipped:
                details = " | ".join(f"{n}: {'; '.join(p)}" for n, p in skipped)
                raise CheckpointError(f"no checkpoint in {root} verifies within the rollback window of {window}: "
                                      f"{details}")
            return _NOTHING

        while True:
            picked = coll.shared(choose, "choose a checkpoint", str(root))  # a step, then its generation
            if picked == _NOTHING:
                self._apply_fresh(generation)
                log.info("no checkpoint in %s: fresh start at generation %d", root, generation)
                return RestoreReport(generation=generation, restored=None, step=None, seconds=time.perf_counter() - t0)
            folder = self.paths.ckpt / ckpt_name(picked, coll.broadcast_int(chosen_generation[0]))
            loaded, damage, fatal = None, None, None
            try:
                loaded = self._read(folder, expected_dataset_id, expected_runspec_digest)
            except _STOP as exc:  # sound but not this trainer's (an older one will not fit either), or an interrupt
                fatal = exc
            except CheckpointError as exc:  # this checkpoint is damaged: try the next older one
                damage = exc
            except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
                # Anything else a checkpoint's bytes made a reader raise is damage too:
                # skipping to the previous good checkpoint is the whole point of a rollback window.
                damage = CheckpointError(f"checkpoint {folder} cannot be loaded ({type(exc).__name__}: "
                                         f"{str(exc).strip()[:300]})")
            coll.all_or_raise(fatal, f"read checkpoint {folder.name}")
            if coll.agree_ok(damage is None):
                break
            reason = str(damage) if damage is not None else "another rank could not load its shards (see its log)"
            if coll.rank == 0:
                self._skip(folder.name, (reason,), skipped)
            else:
                log.error("checkpoint %s in %s cannot be loaded, skipping: %s", folder.name, root, reason)
        assert loaded is not None
        error: BaseException | None = None
        try:
            self._apply(loaded, generation)
        except BaseException as exc:
            error = exc
        coll.all_or_raise(error, f"restore checkpoint {folder.name}")
        man = loaded.manifest
        retired: list[str] = []

        def retire() -> int:
            retired.extend(self._retire_above(generation, man))
            return len(retired)

        coll.shared(retire, "retire newer checkpoints", str(root))
        report = RestoreReport(generation=generation, restored=folder.name, step=man.step, skipped=tuple(skipped),
                               retired=tuple(retired), seconds=time.perf_counter() - t0)
        log.info("restored %s from %s at generation %d (%.3f s, skipped %s)", folder.name, root, generation,
                 report.seconds, [n for n, _ in skipped])
        return report

    def _candidates(self, step: int | None) -> list[CheckpointInfo]:
        infos = scan(self.paths.root, signer=self.signer)
        return [i for i in infos if step is None or i.step <= step]

    def _skip(self, name: str, problems: tuple[str, ...], skipped: list[tuple[str, tuple[str, ...]]]) -> None:
        log.error("checkpoint %s in %s is damaged, incomplete or cannot be loaded, skipping: %s", name,
                  self.paths.root, "; ".join(problems))
        skipped.append((name, problems))

    # ------------------------------------------------------------------ read
    def _read(self, folder: Path, dataset_id: str | None, runspec_digest: str | None) -> _Loaded:
        """Everything this rank needs from `folder`, loaded from exactly the files its manifest lists."""
        man = load_checkpoint_manifest(folder, self.signer)
        where = f"checkpoint {folder}"
        check_identity(man.data, where, dataset_id=dataset_id, runspec_digest=runspec_digest)
        needs = set(self.statefuls) | {RNG_KEY}
        holds = set(man.keys) | set(man.extra.get("dcp_keys", ()))
        missing = sorted(needs - holds)
        if missing:
            raise CheckpointMismatch(f"{where}: holds keys {sorted(holds)}, this manager needs {missing} too")
        rank, world = self.coll.rank, self.coll.world
        src = rank % man.world_size  # a resized run takes per-rank torch/RNG state round-robin

        def holder(key: str) -> int | None:
            return None if man.holder(key) is None else src

        torch_states: dict[str, Any] = {}
        fenced: dict[str, Any] = {}
        legacy: dict[str, int] = {}  # fenced states an older sluice kept inside the DCP folder
        for name in self.statefuls:
            if name in self.fenced_names:
                if name in man.keys:
                    fenced[name] = read_fenced_state(folder, man, name, rank, world)
                else:
                    legacy[name] = int(man.extra.get("dcp_data_bytes", 0))
            elif man.format == "torch":
                torch_states[name] = self._load_torch(folder, man, name, holder(name))
        rng = parse_rng(read_json_shard(folder, man, RNG_KEY, holder(RNG_KEY)), f"{where}/rng")
        if man.format == "dcp":
            from sluice.trainer_hooks.torchio import load_dcp

            dcp_states = {n: o for n, o in self.statefuls.items() if n not in self.fenced_names}
            fenced.update(load_dcp(folder, man, dcp_states, legacy, signed=self.signer is not None))
        return _Loaded(folder, man, torch_states, fenced, rng)

    def _load_torch(self, folder: Path, man: CheckpointManifest, name: str, rank: int | None) -> Any:
        from sluice.trainer_hooks.torchio import load_torch_shard

        shard = man.shard_for(name, rank)
        if shard is None or shard.kind != "torch":
            raise CheckpointError(f"checkpoint {folder}: the manifest lists no torch shard for key {name!r} "
                                  f"rank {rank}")
        # signed: load_checkpoint_manifest checked the MAC with the run's key, so these are the writer's bytes
        return load_torch_shard(folder / shard.file, self.config.map_location, f"checkpoint {folder}",
                                signed=self.signer is not None)

    # ------------------------------------------------------------------ apply
    def _apply(self, loaded: _Loaded, generation: int) -> None:
        saved, world = loaded.manifest.world_size, self.coll.world
        for name in self.fenced_names:
            self.statefuls[name].fence(generation)
        if saved != world:  # each fenced stateful knows its resume contract (the client: the run spec's)
            for name in self.fenced_names:
                self.statefuls[name].check_resize(saved, world)
        for name in self.fenced_names:
            self.statefuls[name].reset(loaded.fenced_states[name])
        for name, state in loaded.torch_states.items():
            self.statefuls[name].load_state_dict(state)
        loaded.rng.apply()

    def _apply_fresh(self, generation: int) -> None:
        error: BaseException | None = None
        try:
            for name in self.fenced_names:
                self.statefuls[name].fence(generation)
                self.statefuls[name].reset(None)
        except BaseException as exc:
            error = exc
        self.coll.all_or_raise(error, "start the data over")

    def _retire_above(self, generation: int, chosen: CheckpointManifest) -> list[str]:
        """Move committed folders ordered above `chosen` to retired/ and point `latest` at it."""
        retired: list[str] = []
        name = ckpt_name(chosen.step, chosen.generation)
        with self.record.fenced(generation, what=f"restore of {name}"):
            above = [i for i in scan(self.paths.root) if (i.step, i.generation) > (chosen.step, chosen.generation)]
            if above:
                dest = self.paths.root / "retired"
                dest.mkdir(exist_ok=True)
                for info in above:
                    os.replace(info.path, dest / f"{info.name}.{time.time_ns()}")
                    retired.append(info.name)
                fsync_dir(self.paths.ckpt)
                fsync_dir(dest)
            write_atomic(self.paths.latest, (name + "\n").encode("ascii"))
        if retired:
            log.warning("restore of %s retired newer checkpoints %s (moved to %s/retired)", name, retired,
                        self.paths.root)
        return retired
