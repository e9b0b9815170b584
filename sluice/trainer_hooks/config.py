"""What a CheckpointManager is told (`CheckpointConfig`) and what it reports (`SaveReport`, `RestoreReport`).

Frozen, keyword-only dataclasses: a bad value is refused at construction with
the field and the value named, never later in the middle of a save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from sluice.errors import CheckpointError

if TYPE_CHECKING:
    from sluice.trainer_hooks.collective import Collective
    from sluice.trainer_hooks.layout import Paths
    from sluice.trainer_hooks.runrecord import RunRecord
    from sluice.trainer_hooks.signing import Signer

RNG_KEY = "rng"  # the logical key of the RNG states; no stateful may take this name


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How a CheckpointManager saves, keeps and restores.

    every: save every N steps (int), ``"auto"`` (Young's interval sqrt(2*C*M) in
    seconds from the measured exposed pause C and `mtbf_s` M), or None (only
    explicit `save` calls).
    hmac_key_file: a file outside the checkpoint folder holding a secret key; with
    it, every manifest is signed (HMAC-SHA256, ``manifest.mac``) and restore skips
    a checkpoint whose signature is missing or wrong.
    """

    every: int | Literal["auto"] | None = None
    mtbf_s: float | None = None
    keep_last: int = 3
    keep_every: int = 0
    rollback_window: int = 3  # damaged checkpoints restore may step over before giving up
    async_save: bool = False
    policy: Literal["block", "skip"] = "block"
    format: Literal["torch", "dcp"] = "torch"
    gc_max_deletions: int = 16
    run_id: str | None = None
    map_location: str = "cpu"
    # With several ranks: statefuls equal on every rank (data-parallel replicas),
    # written once by rank 0; all others are written per rank as <key>-r<rank>.
    replicated: tuple[str, ...] = ("model", "optim")
    hmac_key_file: str | os.PathLike[str] | None = None

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

    @classmethod
    def from_options(cls, config: CheckpointConfig | None, options: dict[str, Any]) -> CheckpointConfig:
        """`config`, or one built from keyword options (``every=500``); both at once is an error."""
        if config is not None and options:
            raise CheckpointError(f"checkpoint config: pass either config= or options {sorted(options)}, not both")
        if config is not None:
            return config
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise CheckpointError(f"checkpoint config: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True, kw_only=True)
class SaveReport:
    """What one save cost.

    exposed_pause_s: seconds the training thread was stopped (C); for a blocked
    async save this includes the wait for the previous drain.
    durability_lag_s: seconds from the save call until the checkpoint was
    published (None while an async drain runs, or for a skipped save).
    data_seconds: seconds spent on the fenced (data) states: state_dict() and
    their JSON encoding and write.
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
    """What restore found: the checkpoint used (None: nothing to restore) and what it skipped.

    `start` is the first step to train: the restored step + 1, or 0 for a fresh start.
    """

    generation: int
    restored: str | None
    step: int | None
    skipped: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, problems) of damaged checkpoints
    retired: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def start(self) -> int:
        return 0 if self.step is None else self.step + 1

    def to_obj(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "restored": self.restored,
            "step": self.step,
            "start": self.start,
            "skipped": [{"name": n, "problems": list(p)} for n, p in self.skipped],
            "retired": list(self.retired),
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class Context:
    """What the writer and the restorer of one manager share: its config, ranks, folder and statefuls."""

    config: CheckpointConfig
    coll: Collective
    paths: Paths
    record: RunRecord
    statefuls: dict[str, Any]
    fenced_names: tuple[str, ...]  # the statefuls that speak FencedStateful (JSON states)
    signer: Signer | None
