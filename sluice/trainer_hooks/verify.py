"""Reading committed checkpoints: list, verify, choose the one to restore.

A checkpoint is *committed* iff ``ckpt/s<S>-g<G>/manifest.json`` parses and
names step S and generation G; it *verifies* iff every shard the manifest lists
exists with exactly its byte count and BLAKE3 digest and every logical key the
manifest promises has at least one shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import hash_file
from sluice.trainer_hooks.layout import MANIFEST_NAME, CheckpointManifest, Paths, parse_ckpt_name


@dataclass
class CheckpointInfo:
    """One folder under ckpt/: its manifest (if committed) and the problems found."""

    name: str
    path: Path
    step: int
    generation: int
    manifest: CheckpointManifest | None
    problems: list[str] = field(default_factory=list)
    verified: bool | None = None  # None: shards not checked (list without verify)

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    def to_obj(self) -> dict:
        man = self.manifest
        return {
            "name": self.name,
            "step": self.step,
            "generation": self.generation,
            "committed": self.committed,
            "verified": self.verified,
            "problems": list(self.problems),
            "format": man.format if man else None,
            "bytes": man.total_bytes if man else None,
            "shards": len(man.shards) if man else None,
            "data": man.data if man else None,
            "created_unix_ns": man.created_unix_ns if man else None,
        }


def load_manifest(folder: Path) -> CheckpointManifest:
    """Parse and cross-check the manifest of one ckpt/ folder; CheckpointError on any problem."""
    parsed = parse_ckpt_name(folder.name)
    where = f"checkpoint {folder}"
    if parsed is None:
        raise CheckpointError(f"{where}: folder name is not s<step>-g<generation>")
    try:
        data = (folder / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no {MANIFEST_NAME} (never committed)") from None
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read {MANIFEST_NAME} ({exc.strerror})") from exc
    man = CheckpointManifest.from_bytes(data, f"{where}/{MANIFEST_NAME}")
    if (man.step, man.generation) != parsed:
        raise CheckpointError(
            f"{where}: manifest says step {man.step} generation {man.generation}, "
            f"the folder name says step {parsed[0]} generation {parsed[1]}"
        )
    return man


def verify_shards(folder: Path, man: CheckpointManifest) -> list[str]:
    """Problems with the shards of a committed checkpoint (empty list: it verifies)."""
    problems: list[str] = []
    for shard in man.shards:
        path = folder / shard.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"shard {shard.file} (key {shard.key}): missing")
            continue
        if size != shard.bytes:
            problems.append(f"shard {shard.file} (key {shard.key}): {size} bytes, manifest says {shard.bytes}")
            continue
        digest = hash_file(path).hex
        if digest != shard.blake3:
            problems.append(
                f"shard {shard.file} (key {shard.key}): BLAKE3 {digest[:16]}..., manifest says {shard.blake3[:16]}..."
            )
    present = {s.key for s in man.shards}
    for key in man.keys:
        if key not in present:
            problems.append(f"key {key!r}: no shard in the manifest")
    return problems


def scan(root: str | Path, *, verify: bool = False) -> list[CheckpointInfo]:
    """Every s<step>-g<gen> folder under ckpt/, newest (highest step, then generation) first."""
    paths = Paths(Path(root))
    out: list[CheckpointInfo] = []
    if not paths.ckpt.is_dir():
        return out
    for entry in paths.ckpt.iterdir():
        parsed = parse_ckpt_name(entry.name)
        if parsed is None or not entry.is_dir():
            continue
        info = CheckpointInfo(entry.name, entry, parsed[0], parsed[1], None)
        try:
            info.manifest = load_manifest(entry)
        except CheckpointError as exc:
            info.problems.append(str(exc))
            info.verified = False
        if verify and info.manifest is not None:
            info.problems = verify_shards(entry, info.manifest)
            info.verified = not info.problems
        out.append(info)
    out.sort(key=lambda i: (i.step, i.generation), reverse=True)
    return out


def verify_one(info: CheckpointInfo) -> CheckpointInfo:
    """Verify the shards of `info` in place and return it."""
    if info.manifest is not None and info.verified is None:
        info.problems = verify_shards(info.path, info.manifest)
        info.verified = not info.problems
    return info
