"""The run spec (TOML): how one training run consumes a manifest.

```toml
run_id = "r1"
seed = 1234
lanes = 8
global_batch = 16      # packed sequences per optimizer step, a multiple of lanes
micro_batch = 4        # sequences per micro-batch per replica
resume = "exact"       # exact | exact-elastic | coverage | distributional
order = "global"       # global (feistel-v1) | block (block-shuffle-v1) | none
block_window = 4       # shards per shuffle window for order = "block"
max_steps = 0          # 0 = unbounded
```

Its digest (`RunSpec.digest`, BLAKE3 of the canonical JSON) is recorded in every
data state, so a state from another run spec is refused on restore.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.errors import SpecError

RESUME_CONTRACTS = ("exact", "exact-elastic", "coverage", "distributional")
ORDERS = ("global", "block", "none")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    run_id: str
    seed: int
    lanes: int
    global_batch: int
    micro_batch: int
    resume: str = "exact"
    order: str = "global"
    block_window: int = 4
    max_steps: int = 0

    def __post_init__(self) -> None:
        where = f"run spec {self.run_id!r}"
        if not self.run_id or not all(c.isalnum() or c in "-_." for c in self.run_id):
            raise SpecError(f"{where}: run_id must be non-empty letters, digits, '-', '_' or '.'")
        for name in ("lanes", "global_batch", "micro_batch", "block_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{where}: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise SpecError(f"{where}: seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.global_batch % self.lanes:
            raise SpecError(
                f"{where}: global_batch={self.global_batch} is not a multiple of lanes={self.lanes}; "
                f"each step takes global_batch/lanes sequences from every lane"
            )
        if self.resume not in RESUME_CONTRACTS:
            raise SpecError(f"{where}: resume {self.resume!r} is not one of {', '.join(RESUME_CONTRACTS)}")
        if self.order not in ORDERS:
            raise SpecError(f"{where}: order {self.order!r} is not one of {', '.join(ORDERS)}")
        if self.max_steps < 0:
            raise SpecError(f"{where}: max_steps must be >= 0")

    @property
    def per_lane(self) -> int:
        """Sequences each lane contributes to one global step."""
        return self.global_batch // self.lanes

    def check_replicas(self, replicas: int) -> None:
        """Raise SpecError unless `replicas` divides the lanes and the batch splits into micro-batches."""
        if replicas < 1 or self.lanes % replicas:
            raise SpecError(
                f"run spec {self.run_id!r}: {replicas} replicas do not divide lanes={self.lanes}"
            )
        per_replica = self.global_batch // replicas
        if per_replica % self.micro_batch:
            raise SpecError(
                f"run spec {self.run_id!r}: {per_replica} sequences per replica per step are not a "
                f"multiple of micro_batch={self.micro_batch} (replicas={replicas})"
            )

    def to_obj(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        from sluice.manifest.canonical import canonical_bytes, digest_id

        return digest_id(canonical_bytes({"schema": "sluice.runspec/1", **self.to_obj()}))

    @classmethod
    def from_obj(cls, obj: dict[str, Any], where: str = "run spec") -> RunSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise SpecError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")
        for key in ("run_id", "seed", "lanes", "global_batch", "micro_batch"):
            if key not in obj:
                raise SpecError(f"{where}: missing key {key!r}")
        try:
            return cls(**obj)
        except TypeError as exc:
            raise SpecError(f"{where}: {exc}") from exc
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from exc


def load_runspec(path: str | os.PathLike[str]) -> RunSpec:
    p = Path(path)
    try:
        obj = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecError(f"run spec {p}: no such file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"run spec {p}: not valid TOML ({exc})") from exc
    return RunSpec.from_obj(obj, where=f"run spec {p}")
