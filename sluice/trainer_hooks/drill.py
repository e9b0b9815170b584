"""Restore drill: prove that checkpoints restore, and measure RTO and RPO.

`run_drill(DIR)` picks the newest committed checkpoint and an older one (from
an older generation when there is one, else the previous step) and restores
each in a fresh Python subprocess — a scratch process with none of the
trainer's state — that verifies every shard digest and loads every shard the
safe way (torch.load(weights_only=True), JSON, or DCP after digest checks).

* RTO: seconds for that restore (inside the scratch process, and wall time
  including interpreter start).
* RPO: the step gap between the restored checkpoint and the newest state
  (the newest committed checkpoint, or `head_step` when the caller knows the
  trainer's current step).

A drill is read-only: it never acquires a generation, so it never fences a live
writer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError
from sluice.trainer_hooks.verify import CheckpointInfo, load_manifest, scan, verify_shards

_CHILD = "from sluice.trainer_hooks.drill import child_main; raise SystemExit(child_main())"


@dataclass(frozen=True)
class DrillResult:
    name: str
    role: str  # "latest" | "older"
    step: int
    generation: int
    ok: bool
    problems: tuple[str, ...]
    restore_s: float | None
    wall_s: float
    rpo_steps: int
    tensors: int
    bytes: int
    data_step: Any

    def to_obj(self) -> dict[str, Any]:
        return {**self.__dict__, "problems": list(self.problems)}


def child_main(argv: list[str] | None = None) -> int:
    """In the scratch process: verify and load one checkpoint; print one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0])
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ok": False, "problems": [], "tensors": 0, "bytes": 0, "data_step": None}
    try:
        man = load_manifest(folder)
        problems = verify_shards(folder, man)
        out["problems"] = problems
        out["bytes"] = man.total_bytes
        if not problems:
            out["tensors"] = _load_all(folder, man)
            out["data_step"] = (man.data or {}).get("step")
            out["ok"] = True
    except CheckpointError as exc:
        out["problems"].append(str(exc))
    except Exception as exc:  # any load failure is a failed drill, reported not raised
        out["problems"].append(f"load failed: {exc!r}")
    out["restore_s"] = time.perf_counter() - t0
    print(json.dumps(out))
    return 0


def _count_tensors(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0


def _load_all(folder: Path, man: Any) -> int:
    import torch

    tensors = 0
    for shard in man.shards:
        path = folder / shard.file
        if shard.kind == "torch":
            tensors += _count_tensors(torch.load(path, map_location="cpu", weights_only=True))
        elif shard.kind == "json":
            json.loads(path.read_bytes())
    if man.format == "dcp":
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        tensors += _count_tensors(_load_state_dict_from_keys(checkpoint_id=str(folder / "dcp")))
    return tensors


def _pick_targets(infos: list[CheckpointInfo]) -> list[tuple[str, CheckpointInfo]]:
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    latest = committed[0]
    targets = [("latest", latest)]
    older = next((i for i in committed[1:] if i.generation < latest.generation), None)
    if older is None and len(committed) > 1:
        older = committed[1]
    if older is not None:
        targets.append(("older", older))
    return targets


def run_drill(root: str | Path, *, head_step: int | None = None, timeout_s: float = 600.0) -> list[DrillResult]:
    """Restore the latest and an older checkpoint of `root` in scratch subprocesses."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} does not exist")
    infos = scan(root)
    targets = _pick_targets(infos)
    if not targets:
        raise CheckpointError(f"checkpoint folder {root}: no committed checkpoint to drill")
    newest = head_step if head_step is not None else targets[0][1].step
    results = []
    for role, info in targets:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(info.path)], capture_output=True, text=True,
                              timeout=timeout_s)
        wall = time.perf_counter() - t0
        try:
            child = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            child = {"ok": False, "problems": [f"scratch process exited {proc.returncode}: {proc.stderr.strip()[-500:]}"],
                     "restore_s": None, "tensors": 0, "bytes": 0, "data_step": None}
        results.append(DrillResult(
            name=info.name, role=role, step=info.step, generation=info.generation, ok=bool(child["ok"]),
            problems=tuple(child["problems"]), restore_s=child.get("restore_s"), wall_s=wall,
            rpo_steps=newest - info.step, tensors=int(child["tensors"]), bytes=int(child["bytes"]),
            data_step=child.get("data_step"),
        ))
    return results
