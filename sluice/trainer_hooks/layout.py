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
    """One file of a checkpoint: its logical key, file name, byte count, BLAKE3 and the rank that wrote it.

    `rank` is None for a shard every rank shares (a replicated stateful, the
    single process of a one-rank run, DCP files). Restore loads exactly the
    file of its (key, rank) entry, never a name it computes itself.
    """

    key: str  # logical key: "model", "optim", "rng", "data", "dcp"
    file: str  # path relative to the checkpoint folder
    kind: str  # "torch" (torch.save), "json", "dcp" (torch.distributed.checkpoint file)
    bytes: int
    blake3: str
    rank: int | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"key": self.key, "file": self.file, "kind": self.kind, "bytes": self.bytes,
                               "blake3": self.blake3}
        if self.rank is not None:
            obj["rank"] = self.rank
        return obj


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
        """Parse and validate every field (types, ranges, shard paths); CheckpointError naming the field."""
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({exc})") from exc
        except RecursionError:  # json nests one Python frame per level: 100k levels is an attack, not a manifest
            raise CheckpointError(f"{where}: manifest is nested too deeply to be a checkpoint manifest") from None
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where}: manifest is not a JSON object")
        if obj.get("schema") != MANIFEST_SCHEMA:
            raise CheckpointError(f"{where}: manifest schema {obj.get('schema')!r:.80}, expected {MANIFEST_SCHEMA!r}")
        extra = _field(obj, "extra", dict, where, optional=True) or {}
        shards_obj = _field(obj, "shards", list, where)
        shards = tuple(_shard(s, f"{where}: shards[{i}]") for i, s in enumerate(shards_obj))
        man = cls(
            step=_count(obj, "step", where),
            generation=_count(obj, "generation", where),
            format=_choice(obj, "format", FORMATS, where),
            keys=tuple(_name(k, f"{where}: keys[{i}]") for i, k in enumerate(_field(obj, "keys", list, where))),
            shards=shards,
            created_unix_ns=_count(obj, "created_unix_ns", where),
            run_id=_field(obj, "run_id", str, where, optional=True),
            data=_data_summary(obj.get("data"), f"{where}: data"),
            extra=_check_extra(extra, f"{where}: extra"),
        )
        files = [s.file for s in shards]
        if len(set(files)) != len(files):
            dup = sorted({f for f in files if files.count(f) > 1})
            raise CheckpointError(f"{where}: shard files {dup} are listed more than once")
        return man

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def world_size(self) -> int:
        return int(self.extra.get("world_size", 1))

    def holder(self, key: str) -> int | None:
        """The rank whose shard of `key` holds it: None when one shard serves every rank."""
        return None if self.world_size == 1 or key in self.extra.get("replicated", ()) else 0

    def shard_for(self, key: str, rank: int | None) -> ShardEntry | None:
        """The one shard listed for (key, rank), or None if the manifest lists none."""
        return next((s for s in self.shards if s.key == key and s.rank == rank and s.kind != "dcp"), None)

    def coverage_problems(self) -> list[str]:
        """What this manifest fails to list for a restore: every key with one shard per rank that needs one."""
        problems: list[str] = []
        world = self.world_size
        for key in self.keys:
            entries = [s for s in self.shards if s.key == key]
            if key == "dcp" or any(s.kind == "dcp" for s in entries):
                if not entries:
                    problems.append(f"key {key!r}: no shard in the manifest")
                continue
            want: list[int | None] = [None] if self.holder(key) is None else list(range(world))
            got = sorted((s.rank for s in entries), key=lambda r: -1 if r is None else r)
            if got != want:
                shown = "no shard" if not got else f"shards for ranks {got}"
                problems.append(f"key {key!r}: {shown} in the manifest, a restore needs ranks {want}"
                                if want != [None] else f"key {key!r}: {shown} in the manifest, needs exactly one")
        return problems

FORMATS = ("torch", "dcp")
SHARD_KINDS = ("torch", "json", "dcp")
MAX_WORLD = 1 << 20  # more ranks than any job runs: a bigger number is damage, not a job
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def _field(obj: dict[str, Any], name: str, kind: type, where: str, *, optional: bool = False) -> Any:
    value = obj.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{where}: field {name!r} must be a {kind.__name__}, got {value!r:.80}")
    return value


def _count(obj: dict[str, Any], name: str, where: str, *, low: int = 0, high: int = (1 << 63) - 1) -> int:
    value = _field(obj, name, int, where)
    if not low <= value <= high:
        raise CheckpointError(f"{where}: field {name!r} must be in [{low}, {high}], got {value!r}")
    return value


def _choice(obj: dict[str, Any], name: str, allowed: tuple[str, ...], where: str) -> str:
    value = obj.get(name)
    if value not in allowed:
        raise CheckpointError(f"{where}: field {name!r} must be one of {list(allowed)}, got {value!r:.80}")
    return value


def is_plain_name(value: Any) -> bool:
    """A logical key usable as a file name: letters, digits, '_', '.', '-', not starting with '.' or '-'."""
    return isinstance(value, str) and bool(_NAME.match(value))


def _name(value: Any, where: str) -> str:
    if not is_plain_name(value):
        raise CheckpointError(f"{where}: {value!r:.80} is not a logical key (a plain name)")
    return value


def _shard(s: Any, where: str) -> ShardEntry:
    if not isinstance(s, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    file = _field(s, "file", str, where)
    # A shard path is relative and stays inside the checkpoint folder.
    if not file or file.startswith("/") or ".." in Path(file).parts or "\\" in file or "\x00" in file:
        raise CheckpointError(f"{where}: shard file {file!r:.80} escapes the checkpoint folder")
    digest = _field(s, "blake3", str, where)
    if not _HEX64.match(digest):
        raise CheckpointError(f"{where}: blake3 {digest!r:.80} is not 64 lowercase hex digits")
    rank = s.get("rank")
    if rank is None:
        # Manifests written before the field named per-rank shards <key>-r<rank>.<ext>.
        m = re.fullmatch(re.escape(str(s.get("key"))) + r"-r(\d{1,7})\.(?:pt|json)", file)
        rank = int(m.group(1)) if m else None
    else:
        rank = _count(s, "rank", where, high=MAX_WORLD - 1)
    return ShardEntry(key=_name(s.get("key"), f"{where}: key"), file=file,
                      kind=_choice(s, "kind", SHARD_KINDS, where), bytes=_count(s, "bytes", where),
                      blake3=digest, rank=rank)


def _data_summary(value: Any, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: must be an object or null, got {value!r:.80}")
    for name in ("key", "dataset_id", "runspec_digest"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise CheckpointError(f"{where}: field {name!r} must be a string or null, got {value[name]!r:.80}")
    step = value.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < -1):
        raise CheckpointError(f"{where}: field 'step' must be an integer >= -1 or null, got {step!r:.80}")
    return value


def _check_extra(extra: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields restore reads from `extra`, checked before anything divides or indexes by them."""
    if "world_size" in extra:
        _count(extra, "world_size", where, low=1, high=MAX_WORLD)
    for name in ("replicated", "dcp_keys"):
        if name in extra:
            items = _field(extra, name, list, where)
            for i, item in enumerate(items):
                _name(item, f"{where}: {name}[{i}]")
    if "dcp_data_bytes" in extra:
        _count(extra, "dcp_data_bytes", where)
    if "retention" in extra:
        retention = _field(extra, "retention", dict, where)
        for name in ("keep_last", "keep_every"):
            if name in retention:
                _count(retention, name, f"{where}: retention")
    return extra
