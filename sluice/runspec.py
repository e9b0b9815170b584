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

Its digest (`RunSpec.digest`, BLAKE3 of the canonical JSON of every field but
`resume`, plus the order algorithm's version) is recorded in every data state, so a state from another run spec is
refused on restore. `resume` is the restore's promise: only "exact" refuses a
change of data-parallel size (`sluice.datastate.check_resize`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.datastate import RESUME_CONTRACTS
from sluice.errors import SpecError
from sluice.manifest.inputs import MAX_SPEC_BYTES, parse_toml, read_input

# The version of each order's algorithm (its name in docs/logical.md). Part of the
# run-spec digest, so a checkpoint made with an older order algorithm is refused
# rather than silently resumed on a different stream; bump it whenever an order's
# output changes. The order implementations (loaderd/logical/order.py) take their
# names, which also key their permutations, from here.
ORDER_VERSIONS = {"global": "feistel-v1", "block": "block-shuffle-v1", "none": "none"}
ORDERS = tuple(ORDER_VERSIONS)

# Upper bounds, checked when the spec is read, so a typo fails at once instead
# of running out of memory (or overflowing an int32) minutes later.
MAX_RUN_ID = 128  # characters
MAX_LANES = 1 << 16  # every lane holds its own cursors and packer state
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step
MAX_BLOCK_WINDOW = 1 << 20  # shards per shuffle window
MAX_STEPS = 1 << 53  # exact in a JSON number everywhere
# Tokens in one global step (global_batch * seq_len) are held at once by `plan`
# and index int32 arrays: 2**28 tokens is 1 GiB per int32 array.
MAX_TOKENS_PER_STEP = 1 << 28

# Fields left out of the digest: `resume` is a promise about restores, not part of
# what the stream is, so a run saved under "exact" can resume on another number of
# ranks after its spec switches to "exact-elastic" (the advice ResizeRefused gives).
_NOT_HASHED = frozenset({"resume"})

_UPPER = {"lanes": MAX_LANES, "global_batch": MAX_GLOBAL_BATCH, "micro_batch": MAX_GLOBAL_BATCH,
          "block_window": MAX_BLOCK_WINDOW}


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
        if not isinstance(self.run_id, str):
            raise SpecError(f"run_id must be a string, got {self.run_id!r:.80}")
        if not self.run_id or len(self.run_id) > MAX_RUN_ID or not all(
            c.isascii() and (c.isalnum() or c in "-_.") for c in self.run_id
        ):
            shown = repr(self.run_id[:40]) + ("..." if len(self.run_id) > 40 else "")
            raise SpecError(f"run_id {shown} must be 1 to {MAX_RUN_ID} ASCII letters, digits, '-', '_' or '.'")
        for name, upper in _UPPER.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
                raise SpecError(f"{where}: {name} must be an integer in [1, {upper}], got {value!r:.80}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise SpecError(f"{where}: seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.global_batch % self.lanes:
            raise SpecError(
                f"{where}: global_batch={self.global_batch} is not a multiple of lanes={self.lanes}; "
                f"each step takes global_batch/lanes sequences from every lane"
            )
        if self.micro_batch > self.global_batch:
            raise SpecError(f"{where}: micro_batch={self.micro_batch} is larger than global_batch={self.global_batch}")
        if self.resume not in RESUME_CONTRACTS:
            raise SpecError(f"{where}: resume {self.resume!r} is not one of {', '.join(RESUME_CONTRACTS)}")
        if self.order not in ORDERS:
            raise SpecError(f"{where}: order {self.order!r} is not one of {', '.join(ORDERS)}")
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool) or not 0 <= self.max_steps <= MAX_STEPS:
            raise SpecError(f"{where}: max_steps must be an integer in [0, 2**53] (0 = unbounded), got {self.max_steps!r:.80}")

    def check_seq_len(self, seq_len: int, where: str = "") -> None:
        """Raise SpecError if one global step (global_batch x seq_len tokens) exceeds MAX_TOKENS_PER_STEP."""
        tokens = self.global_batch * seq_len
        if tokens > MAX_TOKENS_PER_STEP:
            raise SpecError(
                f"{where or f'run spec {self.run_id!r}'}: global_batch={self.global_batch} x the manifest's "
                f"seq_len={seq_len} = {tokens} tokens per step, more than the limit of {MAX_TOKENS_PER_STEP}"
            )

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

        shaping = {k: v for k, v in self.to_obj().items() if k not in _NOT_HASHED}
        return digest_id(canonical_bytes({"schema": "sluice.runspec/1", **shaping,
                                          "order_version": ORDER_VERSIONS[self.order]}))

    @classmethod
    def from_obj(cls, obj: dict[str, Any], where: str = "run spec") -> RunSpec:
        if not isinstance(obj, dict):
            raise SpecError(f"{where}: expected a table of keys, got {type(obj).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(obj) - known)
        if unknown:
            hint = " (this is a dataset spec; the run spec is its own file)" if "sources" in unknown else ""
            raise SpecError(f"{where}: unknown keys {unknown}{hint}; known keys are {sorted(known)}")
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
    """Read and validate a run spec file; raises SpecError naming the file and the field."""
    p = Path(path)
    obj = parse_toml(read_input(p, "run spec", MAX_SPEC_BYTES, SpecError), f"run spec {p}", SpecError)
    return RunSpec.from_obj(obj, where=f"run spec {p}")
