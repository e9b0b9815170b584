"""Restore drill: prove that checkpoints restore, and measure RTO and RPO.

`run_drill(DIR)` picks the newest committed checkpoint and an older one (from
an older generation when there is one, else the previous step) and restores
each in a fresh Python subprocess — a scratch process with none of the
trainer's state — that verifies every shard digest (and, with the run's key
file, the manifest's MAC) and loads every shard as restore would: torch
shards and DCP values without any unpickler (with the key file:
torch.load(weights_only=True)), JSON, and DCP's metadata without pickle
(dcpmeta.py). Nothing in the scratch process ever runs pickle's full unpickler.

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
from sluice.trainer_hooks.signing import Signer
from sluice.trainer_hooks.state import decode_json_state
from sluice.trainer_hooks.verify import CheckpointInfo, load_checkpoint_manifest, scan, verify_shards

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
    """In the scratch process: verify and load one checkpoint; print one JSON line.

    Arguments: FOLDER [KEY_FILE ROOT]. With a key file the manifest must carry its MAC.
    """
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0])
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ok": False, "problems": [], "tensors": 0, "bytes": 0, "data_step": None}
    try:
        signer = Signer.from_file(args[1], args[2]) if len(args) > 2 else None
        man = load_checkpoint_manifest(folder, signer)
        problems = verify_shards(folder, man)
        out["problems"] = problems
        out["bytes"] = man.total_bytes
        if not problems:
            out["tensors"] = _load_all(folder, man, signed=signer is not None)
            out["data_step"] = (man.data or {}).get("step")
            out["ok"] = True
    except CheckpointError as exc:
        out["problems"].append(str(exc))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - any load failure (torch's BaseExceptions too) fails the drill
        out["problems"].append(f"load failed: {exc!r}"[:1000])
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


def _load_all(folder: Path, man: Any, *, signed: bool) -> int:
    from sluice.trainer_hooks.torchio import load_dcp_flat, load_torch_shard

    tensors = 0
    where = f"checkpoint {folder}"
    for shard in man.shards:
        path = folder / shard.file
        if shard.kind == "torch":
            tensors += _count_tensors(load_torch_shard(path, "cpu", where, signed))
        elif shard.kind == "json":
            decode_json_state(path.read_bytes(), f"{where}/{shard.file}")
    if man.format == "dcp":
        tensors += _count_tensors(load_dcp_flat(folder, man, signed))
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


def run_drill(root: str | Path, *, head_step: int | None = None, timeout_s: float = 600.0,
              key_file: str | Path | None = None) -> list[DrillResult]:
    """Restore the latest and an older checkpoint of `root` in scratch subprocesses.

    With `key_file` (the run's `hmac_key_file`) a checkpoint whose manifest lacks
    that key's MAC fails its drill, as restore would skip it. The key file is
    checked here first (CheckpointError), and only its path reaches the child.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} does not exist")
    key_args = []
    if key_file is not None:
        Signer.from_file(key_file, root)
        key_args = [str(key_file), str(root)]
    infos = scan(root)
    targets = _pick_targets(infos)
    if not targets:
        raise CheckpointError(f"checkpoint folder {root}: no committed checkpoint to drill")
    newest = head_step if head_step is not None else targets[0][1].step
    results = []
    for role, info in targets:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(info.path), *key_args], capture_output=True,
                              text=True, timeout=timeout_s)
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
