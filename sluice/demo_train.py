"""The training story of `make demo`: train, crash, resume, and prove nothing changed.

`run(out)` works in the folder `python -m sluice.demo` prepared (manifest.json,
run.toml, cache/). It runs the real training script `examples/train_lm.py`
(a small causal transformer LM, one replica, batches from an embedded loaderd)
as child processes:

1. reference: an uninterrupted run of STEPS steps, checkpointing every EVERY;
2. crash: the same run, killed with SIGKILL (trainer and its embedded daemon:
   the whole process group, as a lost node) at a seeded random step;
3. resume: the same command again; it restores the newest committed checkpoint
   (new fencing generation; the daemon is RESTOREd to the saved lane states)
   and trains to the end;
4. verify: every step's global batch (BLAKE3 of each row) and loss, and the
   final parameters (bit for bit), equal the reference; steps trained twice
   (before the crash and again after the resume) saw the same batches and loss.

Exits non-zero if anything differs. The helpers `read_steps`, `compare_streams`
and `compare_params` are what tests/test_e2e_train.py checks with, too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 24
EVERY = 4
SEED = 7  # picks the crash step: after step 15, three steps past the checkpoint of step 12


def trainer_script() -> Path:
    """examples/train_lm.py of this checkout (the demo runs from a source tree, as `make demo` does)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
    if not path.is_file():
        raise FileNotFoundError(f"the training script {path} is missing: run the demo from a sluice checkout")
    return path


# ----------------------------------------------------------------------------- reading runs
@dataclass(frozen=True)
class StepRecord:
    """One step as trained by one incarnation (generation) of the trainers, all ranks merged."""

    step: int
    generation: int
    replicas: int
    loss: float
    rows: tuple[str, ...]  # BLAKE3 of every row of the global batch, replicas in order


def read_steps(out: str | os.PathLike[str]) -> tuple[dict[int, StepRecord], list[StepRecord]]:
    """(final, earlier): per step the record of the newest generation, and every older complete one.

    A step counts for a generation only when every rank logged it (a kill may
    leave one rank's line without the other's).
    """
    by_key: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for path in sorted(Path(out).glob("steps-r*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill -9
            if "event" in rec or "rows" not in rec:
                continue
            by_key.setdefault((rec["step"], rec["generation"]), {})[rec["rank"]] = rec
    complete: dict[int, list[StepRecord]] = {}
    for (step, gen), ranks in sorted(by_key.items()):
        world = next(iter(ranks.values()))["replicas"]
        if sorted(ranks) != list(range(world)):
            continue
        rows = tuple(d for r in range(world) for d in ranks[r]["rows"])
        complete.setdefault(step, []).append(
            StepRecord(step, gen, world, float.fromhex(ranks[0]["loss"]), rows))
    final = {s: recs[-1] for s, recs in complete.items()}
    earlier = [r for recs in complete.values() for r in recs[:-1]]
    return final, earlier


def read_events(out: str | os.PathLike[str], rank: int = 0) -> list[dict[str, Any]]:
    path = Path(out) / f"steps-r{rank}.jsonl"
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" in rec:
            events.append(rec)
    return events


def compare_streams(ref: dict[int, StepRecord], run: dict[int, StepRecord], steps: int, *,
                    earlier: Sequence[StepRecord] = (), loss_rtol: float = 0.0) -> list[str]:
    """Problems (empty: equal) between two runs' per-step global batches and losses.

    `loss_rtol` 0 demands bitwise-equal losses; a resized run compares with a
    tolerance because replicas sum gradients in another order. Steps trained
    more than once (`earlier`) must have seen the reference's batch too.
    """
    problems = []
    for step in range(steps):
        a, b = ref.get(step), run.get(step)
        if a is None or b is None:
            problems.append(f"step {step}: missing from the {'reference' if a is None else 'compared'} run")
            continue
        if a.rows != b.rows:
            problems.append(f"step {step}: global batch differs ({len(a.rows)} vs {len(b.rows)} rows)")
        if not _close(a.loss, b.loss, loss_rtol):
            problems.append(f"step {step}: loss {b.loss!r} differs from the reference's {a.loss!r}")
    for rec in earlier:
        a = ref.get(rec.step)
        if a is None or a.rows != rec.rows:
            problems.append(f"step {rec.step} (generation {rec.generation}, before a crash): batch differs")
        elif rec.replicas == a.replicas and not _close(a.loss, rec.loss, loss_rtol):
            problems.append(f"step {rec.step} (generation {rec.generation}, before a crash): loss differs")
    return problems


def _close(a: float, b: float, rtol: float) -> bool:
    return a == b if rtol == 0 else abs(a - b) <= rtol * max(abs(a), abs(b))


def compare_params(a_path: str | os.PathLike[str], b_path: str | os.PathLike[str]) -> tuple[list[str], float]:
    """(problems, max |a - b|) between two saved state dicts; problems empty iff bitwise equal."""
    import torch

    a = torch.load(a_path, weights_only=True)
    b = torch.load(b_path, weights_only=True)
    if sorted(a) != sorted(b):
        return [f"parameter names differ: {sorted(set(a) ^ set(b))}"], float("inf")
    problems, worst = [], 0.0
    for name in sorted(a):
        if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            problems.append(f"{name}: shape/dtype {tuple(b[name].shape)}/{b[name].dtype} differs")
            continue
        if not torch.equal(a[name], b[name]):
            diff = float((a[name].double() - b[name].double()).abs().max())
            worst = max(worst, diff)
            problems.append(f"{name}: differs (max |diff| {diff:.3g})")
    return problems, worst


# ----------------------------------------------------------------------------- processes
class Trainer:
    """`examples/train_lm.py` as a child process in its own session (so kill -9 takes its daemon too)."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, prefix: str = "  | ",
                 echo: bool = True) -> None:
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(trainer_script()), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=full_env, start_new_session=True, text=True)
        self.lines: list[str] = []
        self._pump = threading.Thread(target=self._read, args=(prefix, echo), daemon=True)
        self._pump.start()

    def _read(self, prefix: str, echo: bool) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if echo:
                print(prefix + line, end="", flush=True)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise
        self._pump.join(5)
        return rc

    def kill9(self) -> None:
        """SIGKILL the trainer's whole process group (the trainer and its embedded daemon)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._pump.join(5)


def wait_for_step(out: Path, step: int, procs: Sequence[Any], timeout: float, *, rank: int = 0,
                  min_generation: int = 0) -> None:
    """Block until rank `rank` logged `step` in generation `min_generation` or later.

    Raises if every process in `procs` exited first or time runs out.
    """
    path = out / f"steps-r{rank}.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step") == step and "rows" in rec and rec["generation"] >= min_generation:
                    return
        if all(p.poll() is not None for p in procs):
            raise RuntimeError(f"the trainers exited before step {step} was logged in {path}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not logged in {path} within {timeout} s")


# ----------------------------------------------------------------------------- the story
def run(out: Path, *, steps: int = STEPS, every: int = EVERY, seed: int = SEED, timeout: float = 600.0) -> int:
    """The demo's training chapter (see the module docstring); 0 iff everything matched."""
    out = Path(out)
    work = out / "train"
    shutil.rmtree(work, ignore_errors=True)
    rng = random.Random(seed)
    crash_at = rng.randrange(every + 1, steps - 2)  # after the first checkpoints, before the end

    def args(name: str) -> list[str]:
        d = work / name
        return ["--manifest", str(out / "manifest.json"), "--runspec", str(out / "run.toml"),
                "--cache", str(out / "cache"), "--daemon-state", str(d / "loaderd-state"),
                "--ckpt", str(d / "ckpt"), "--out", str(d / "out"), "--steps", str(steps), "--every", str(every)]

    print(f"== 5. train a small causal transformer LM for {steps} steps from an embedded loaderd, "
          f"checkpoint every {every} steps")
    print("-- 5a. reference: one uninterrupted run")
    t0 = time.monotonic()
    rc = Trainer(args("reference")).wait(timeout)
    if rc != 0:
        print(f"demo: the reference run failed (exit {rc})")
        return 1
    print(f"   ({time.monotonic() - t0:.1f} s)")
    print(f"-- 5b. crash: the same run, killed with SIGKILL (trainer and its daemon) after step {crash_at}")
    victim = Trainer(args("crashed"))
    try:
        wait_for_step(work / "crashed" / "out", crash_at, [victim.proc], timeout)
    finally:
        victim.kill9()
    ckpt_events = [e for e in read_events(work / "crashed" / "out") if e["event"] == "checkpoint"]
    latest = (work / "crashed" / "ckpt" / "latest").read_text().strip()
    print(f"   killed (exit {victim.proc.returncode}); checkpoints published before the crash: "
          f"{[e['step'] for e in ckpt_events]}; `latest` -> {latest}")
    print("-- 5c. resume: the same command again restores the newest committed checkpoint")
    rc = Trainer(args("crashed")).wait(timeout)
    if rc != 0:
        print(f"demo: the resumed run failed (exit {rc})")
        return 1
    restores = [e for e in read_events(work / "crashed" / "out") if e["event"] == "restore"]
    print(f"   restores: {[(e['restored'], e['generation']) for e in restores]}")
    print("-- 5d. verify against the reference")
    ref, _ = read_steps(work / "reference" / "out")
    resumed, earlier = read_steps(work / "crashed" / "out")
    problems = compare_streams(ref, resumed, steps, earlier=earlier)
    print(f"   {'step':>4}  {'gen':>3}  {'loss (reference)':>18}  {'loss (crash+resume)':>20}  batch (BLAKE3 of rows)")
    for step in range(steps):
        a, b = ref.get(step), resumed.get(step)
        if a is None or b is None:
            continue
        mark = "same" if (a.rows, a.loss) == (b.rows, b.loss) else "DIFFERENT"
        digest = _batch_digest(a.rows)
        print(f"   {step:>4}  {b.generation:>3}  {a.loss:>18.6f}  {b.loss:>20.6f}  {digest} {mark}")
    replayed = sorted({r.step for r in earlier})
    print(f"   steps trained twice (before the crash and after the resume): {replayed}: "
          f"{'same batches and losses' if not [p for p in problems if 'before a crash' in p] else 'DIFFERENT'}")
    param_problems, worst = compare_params(work / "reference" / "out" / "params-r0.pt",
                                           work / "crashed" / "out" / "params-r0.pt")
    problems += param_problems
    print(f"   final parameters: {'bitwise equal' if not param_problems else f'DIFFERENT (max |diff| {worst:.3g})'}")
    if problems:
        print("demo: MISMATCH:\n  " + "\n  ".join(problems))
        return 1
    print(f"demo: the crashed-and-resumed run matches the uninterrupted one: {steps} global batches, {steps} "
          "losses and every parameter bit")
    return 0


def _batch_digest(rows: Sequence[str]) -> str:
    import blake3

    return blake3.blake3("".join(rows).encode()).hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sluice.demo_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="demo-out", help="folder prepared by `python -m sluice.demo` (default demo-out)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--every", type=int, default=EVERY)
    a = p.parse_args(argv)
    return run(Path(a.out).resolve(), steps=a.steps, every=a.every)


if __name__ == "__main__":
    raise SystemExit(main())
