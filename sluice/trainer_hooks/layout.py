"""On-disk layout of a checkpoint folder and the checkpoint manifest (commit record).

```
DIR/run.json                    run record: current generation (runrecord.py)
DIR/run.lock                    POSIX record lock guarding run.json, publish and `latest`
DIR/staging/g<G>-s<S>/          a writer of generation G stages step S here (never read)
DIR/ckpt/s<S:012d>-g<G:06d>/    published: shards + manifest.json (written last)
DIR/latest                      pointer file: "s<S>-g<G>\n", replaced atomically
```

A folder under ``ckpt/`` is *committed* iff its ``manifest.json`` parses and
names the same step and generation as the folder. The manifest lists every
shard (logical key, file, bytes, BLAKE3); a checkpoint *verifies* iff every
listed file exists with exactly those bytes and that digest, and no expected
key is missing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError

MANIFEST_SCHEMA = "sluice.ckpt/1"
MANIFEST_NAME = "manifest.json"
_CKPT_RE = re.compile(r"^s(\d{1,18})-g(\d{1,18})$")
_STAGING_RE = re.compile(r"^g(\d{1,18})-s(\d{1,18})(?:\.\d+)?$")


def ckpt_name(step: int, generation: int) -> str:
    return f"s{step:012d}-g{generation:06d}"


def staging_name(generation: int, step: int) -> str:
    return f"g{generation}-s{step}"


def parse_ckpt_name(name: str) -> tuple[int, int] | None:
    """`s<step>-g<gen>` -> (step, generation), None if the name is not one."""
    m = _CKPT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_staging_name(name: str) -> tuple[int, int] | None:
    """`g<gen>-s<step>` -> (generation, step), None if the name is not one."""
    m = _STAGING_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def run(self) -> Path:
        return self.root / "run.json"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def latest(self) -> Path:
        return self.root / "latest"


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One file of a checkpoint: its logical key, file name, byte count and BLAKE3."""

    key: str  # logical key: "model", "optim", "rng", "data", "dcp"
    file: str  # path relative to the checkpoint folder
    kind: str  # "torch" (torch.save), "json", "dcp" (torch.distributed.checkpoint file)
    bytes: int
    blake3: str

    def to_obj(self) -> dict[str, Any]:
        return {"key": self.key, "file": self.file, "kind": self.kind, "bytes": self.bytes, "blake3": self.blake3}


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    """The commit record of one checkpoint (``manifest.json``).

    `data` summarises the data state when the data stateful provided one:
    ``{"key", "step", "dataset_id", "runspec_digest"}`` (absent values are null).
    """

    step: int
    generation: int
    format: str  # "torch" | "dcp"
    keys: tuple[str, ...]  # logical keys this checkpoint must contain
    shards: tuple[ShardEntry, ...]
    created_unix_ns: int
    run_id: str | None = None
    data: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        obj = {
            "schema": MANIFEST_SCHEMA,
            "step": self.step,
            "generation": self.generation,
            "format": self.format,
            "keys": list(self.keys),
            "shards": [s.to_obj() for s in self.shards],
            "created_unix_ns": self.created_unix_ns,
            "run_id": self.run_id,
            "data": self.data,
            "extra": self.extra,
        }
        return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode("ascii") + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> CheckpointManifest:
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where}: manifest is not a JSON object")
        if obj.get("schema") != MANIFEST_SCHEMA:
            raise CheckpointError(f"{where}: manifest schema {obj.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
        try:
            shards = tuple(
                ShardEntry(key=str(s["key"]), file=str(s["file"]), kind=str(s["kind"]), bytes=int(s["bytes"]),
                           blake3=str(s["blake3"]))
                for s in obj["shards"]
            )
            man = cls(
                step=int(obj["step"]),
                generation=int(obj["generation"]),
                format=str(obj["format"]),
                keys=tuple(str(k) for k in obj["keys"]),
                shards=shards,
                created_unix_ns=int(obj["created_unix_ns"]),
                run_id=obj.get("run_id"),
                data=obj.get("data"),
                extra=dict(obj.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: manifest field missing or of the wrong type ({exc!r})") from exc
        for s in shards:
            # A shard path is relative and stays inside the checkpoint folder.
            if s.file.startswith("/") or ".." in Path(s.file).parts or not s.file:
                raise CheckpointError(f"{where}: shard file {s.file!r} escapes the checkpoint folder")
        return man

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def bytes_of(self, key: str) -> int:
        return sum(s.bytes for s in self.shards if s.key == key)
