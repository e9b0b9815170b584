"""Retention and garbage collection: which checkpoint folders may go.

Pure planning (`plan_retention`) is separated from the filesystem work
(`collect_garbage`) so the rules can be checked as properties:

* **superseded**: a checkpoint ``(s, g)`` is superseded when a newer generation
  ``g2 > g`` published a step ``s2 <= s`` — the newer writer resumed from before
  ``s``, so ``(s, g)`` lies on an abandoned branch of history;
* **kept**: the `keep_last` newest non-superseded checkpoints, every
  non-superseded checkpoint whose step is a multiple of `keep_every` (when > 0),
  and always the one ``latest`` points to (even if superseded);
* everything else is deleted.

Debris is what no reader will ever use: staging folders of generations older
than the current one, ``ckpt/`` folders without a committed manifest from older
generations, and ``retired/`` folders (checkpoints a restore stepped over).
Deletion first renames a folder into ``DIR/trash/`` (atomic, under the run lock,
so a half-deleted checkpoint is never visible) and then removes it; one call
deletes at most `max_deletions` folders, so GC work per save is bounded.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import fsync_dir, read_small
from sluice.trainer_hooks.layout import MANIFEST_NAME, Paths, ckpt_name, parse_ckpt_name, parse_staging_name
from sluice.trainer_hooks.runrecord import RunRecord

log = logging.getLogger("sluice.trainer_hooks")

Key = tuple[int, int]  # (step, generation)


def order_key(step_gen: Key) -> Key:
    """Newest first means the highest (step, generation)."""
    return step_gen


def plan_retention(
    committed: Iterable[Key], latest: Key | None, *, keep_last: int, keep_every: int = 0
) -> tuple[set[Key], set[Key]]:
    """(keep, delete) for the committed checkpoints `(step, generation)`.

    Never puts `latest` into `delete`; every input lands in exactly one set.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    items = set(committed)
    # Lowest step published by each generation: anything older-generation at or
    # above it is superseded.
    min_step_by_gen: dict[int, int] = {}
    for s, g in items:
        min_step_by_gen[g] = min(s, min_step_by_gen.get(g, s))
    superseded = {
        (s, g) for s, g in items if any(g2 > g and s2 <= s for g2, s2 in min_step_by_gen.items())
    }
    live = sorted(items - superseded, key=order_key, reverse=True)
    keep = set(live[:keep_last])
    if keep_every > 0:
        keep |= {k for k in live if k[0] % keep_every == 0}
    if latest is not None and latest in items:
        keep.add(latest)
    return keep, items - keep


@dataclass
class GcReport:
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    pending: int = 0  # deletions left for a later call (bound reached)

    def to_obj(self) -> dict:
        return {"deleted": self.deleted, "kept": self.kept, "pending": self.pending}


def read_latest(paths: Paths) -> Key | None:
    """The (step, generation) `latest` names, None if it is absent or garbage."""
    try:
        data = read_small(paths.latest, 256, "latest pointer")
        return None if data is None else parse_ckpt_name(data.decode("ascii").strip())
    except (CheckpointError, UnicodeDecodeError):  # `latest` is a hint: garbage reads as none
        return None


def committed_folders(paths: Paths) -> dict[Key, Path]:
    """Folders under ckpt/ with a manifest file present, by (step, generation)."""
    out: dict[Key, Path] = {}
    if not paths.ckpt.is_dir():
        return out
    for entry in paths.ckpt.iterdir():
        key = parse_ckpt_name(entry.name)
        if key is not None and (entry / MANIFEST_NAME).is_file():
            out[key] = entry
    return out


def _trash(paths: Paths, folder: Path) -> Path:
    trash = paths.root / "trash"
    trash.mkdir(exist_ok=True)
    dest = trash / f"{folder.parent.name}-{folder.name}-{os.getpid()}-{id(folder)}"
    os.replace(folder, dest)
    return dest


def collect_garbage(
    root: str | os.PathLike[str],
    *,
    keep_last: int,
    keep_every: int = 0,
    max_deletions: int = 16,
    dry_run: bool = False,
    active_staging: str | None = None,
) -> GcReport:
    """Apply retention and remove debris in `root` (see module docstring).

    `active_staging` names a staging folder of the calling writer that must stay.
    Holds the run lock while it moves folders to trash; removes them after.
    """
    paths = Paths(Path(root))
    record = RunRecord(paths.root)
    report = GcReport()
    victims: list[Path] = []
    with record.locked():
        current = record.generation()
        latest = read_latest(paths)
        committed = committed_folders(paths)
        keep, delete = plan_retention(committed, latest, keep_last=keep_last, keep_every=keep_every)
        report.kept = sorted(ckpt_name(*k) for k in keep)
        candidates: list[Path] = [committed[k] for k in sorted(delete)]
        if paths.staging.is_dir():
            for entry in sorted(paths.staging.iterdir()):
                parsed = parse_staging_name(entry.name)
                if entry.name == active_staging:
                    continue
                # Staging of the current generation may belong to a live writer.
                if parsed is None or parsed[0] < current:
                    candidates.append(entry)
        if paths.ckpt.is_dir():
            for entry in sorted(paths.ckpt.iterdir()):
                parsed = parse_ckpt_name(entry.name)
                if parsed is not None and parsed in committed:
                    continue
                if parsed is None or parsed[1] < current:
                    candidates.append(entry)  # a folder without a manifest: never committed
        for sub in ("retired", "trash"):
            folder = paths.root / sub
            if folder.is_dir():
                candidates.extend(sorted(folder.iterdir()))
        report.pending = max(0, len(candidates) - max_deletions)
        for folder in candidates[:max_deletions]:
            report.deleted.append(f"{folder.parent.name}/{folder.name}")
            if not dry_run:
                victims.append(folder if folder.parent.name == "trash" else _trash(paths, folder))
        if victims:
            fsync_dir(paths.root)
    for folder in victims:
        shutil.rmtree(folder, ignore_errors=True)
    if report.deleted:
        log.info("checkpoint gc in %s: deleted %s (%d pending)", root, report.deleted, report.pending)
    return report
