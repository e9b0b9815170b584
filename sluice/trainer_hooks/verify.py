"""Reading committed checkpoints: list, verify, choose the one to restore.

A checkpoint is *committed* iff ``ckpt/s<S>-g<G>/manifest.json`` parses and
names step S and generation G; it *verifies* iff every shard the manifest lists
exists with exactly its byte count and BLAKE3 digest and every logical key the
manifest promises has its shard for every rank that needs one (and, with a
key, ``manifest.mac`` is the HMAC of the manifest bytes: signing.py). A
*deep* check also loads every shard as restore would (torch shards without
any unpickler, or with ``weights_only=True`` under a checked MAC; JSON shards
parsed, RNG states checked field by field, the ranks' data states merged, DCP's
metadata read without pickle and checked, then every DCP value loaded): what
restore would load, without applying it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from typing import Any

from sluice.errors import CheckpointError, StateError
from sluice.trainer_hooks.config import RNG_KEY
from sluice.trainer_hooks.durable import hash_file, read_small
from sluice.trainer_hooks.layout import MANIFEST_NAME, CheckpointManifest, Paths, parse_ckpt_name
from sluice.trainer_hooks.signing import Signer
from sluice.trainer_hooks.state import decode_json_state, merge_data_states, parse_rng


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


MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists shards, not data: 16 MiB is thousands of ranks


def load_checkpoint_manifest(folder: Path, signer: Signer | None = None) -> CheckpointManifest:
    """Parse and cross-check the manifest of one ckpt/ folder (and its MAC, given a signer);
    CheckpointError on any problem."""
    parsed = parse_ckpt_name(folder.name)
    where = f"checkpoint {folder}"
    if parsed is None:
        raise CheckpointError(f"{where}: folder name is not s<step>-g<generation>")
    data = read_small(folder / MANIFEST_NAME, MAX_MANIFEST_BYTES, f"{where}:")
    if data is None:
        raise CheckpointError(f"{where}: no {MANIFEST_NAME} (never committed)")
    if signer is not None:
        signer.check(folder, data)
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
    inside = folder.resolve()
    for shard in man.shards:
        path = folder / shard.file
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"shard {shard.file} (key {shard.key}): missing")
            continue
        # A FIFO would block the digest forever, a symlink or a linked folder would make
        # restore read a file the writer never wrote: only regular files inside the folder.
        if not stat.S_ISREG(st.st_mode) or inside not in path.resolve().parents:
            problems.append(f"shard {shard.file} (key {shard.key}): not a regular file inside the checkpoint folder")
            continue
        size = st.st_size
        if size != shard.bytes:
            problems.append(f"shard {shard.file} (key {shard.key}): {size} bytes, manifest says {shard.bytes}")
            continue
        digest = hash_file(path).hex
        if digest != shard.blake3:
            problems.append(
                f"shard {shard.file} (key {shard.key}): BLAKE3 {digest[:16]}..., manifest says {shard.blake3[:16]}..."
            )
    return problems + man.coverage_problems()


def scan(root: str | Path, *, verify: bool = False, signer: Signer | None = None) -> list[CheckpointInfo]:
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
            info.manifest = load_checkpoint_manifest(entry, signer)
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


def read_json_shard(folder: Path, man: CheckpointManifest, key: str, rank: int | None) -> Any:
    """The decoded JSON of the shard the manifest lists for (key, rank)."""
    where = f"checkpoint {folder}"
    shard = man.shard_for(key, rank)
    if shard is None or shard.kind != "json":
        raise CheckpointError(f"{where}: the manifest lists no JSON shard for key {key!r} rank {rank}")
    try:
        data = (folder / shard.file).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{where}: shard {shard.file} cannot be read ({exc.strerror})") from exc
    return decode_json_state(data, f"{where}/{shard.file}")


def read_fenced_state(folder: Path, man: CheckpointManifest, key: str, rank: int, world: int) -> Any:
    """The fenced state of `key` for `rank` of `world`: its own shard, or every saved rank's merged on a resize."""
    saved = man.world_size
    if man.holder(key) is None:
        return read_json_shard(folder, man, key, None)
    if saved == world:
        return read_json_shard(folder, man, key, rank)
    states = [read_json_shard(folder, man, key, r) for r in range(saved)]
    try:
        return merge_data_states(states)
    except StateError as exc:
        raise CheckpointError(f"checkpoint {folder}: the {saved} ranks' {key!r} states do not merge for "
                              f"{world} ranks ({exc})") from exc


def check_loadable(folder: Path, man: CheckpointManifest, map_location: str = "cpu", *,
                   signed: bool = False) -> list[str]:
    """Problems loading the shards of a verified checkpoint (empty list: restore can load it).

    `signed`: the manifest's MAC was checked with the run's key (restore then reads torch
    shards with weights_only=True, else without any unpickler: torchio.load_torch_value)."""
    from sluice.trainer_hooks.torchio import load_torch_shard

    problems: list[str] = []
    where = f"checkpoint {folder}"
    for shard in man.shards:
        try:
            if shard.kind == "torch":
                load_torch_shard(folder / shard.file, map_location, where, signed)
            elif shard.kind == "json":
                state = read_json_shard(folder, man, shard.key, shard.rank)
                if shard.key == RNG_KEY:
                    parse_rng(state, f"{where}/{shard.file}")
        except CheckpointError as exc:
            problems.append(str(exc))
    if man.format == "dcp":
        from sluice.trainer_hooks.torchio import load_dcp_flat

        try:
            load_dcp_flat(folder, man, signed)  # DCP's metadata read without pickle, then every value loaded
        except CheckpointError as exc:
            problems.append(str(exc))
    for key in man.extra.get("fenced", ()):
        if man.world_size > 1 and man.holder(key) is not None:
            try:
                read_fenced_state(folder, man, key, 0, 1)  # what a restore on one rank merges
            except CheckpointError as exc:
                problems.append(str(exc))
    return problems
