"""Async saves: immutable host copy, background drain, backlog of one, block/skip.

A real second process holds the run lock, so a drain is held at its publish
step for exactly as long as the test wants: no sleeps decide an outcome.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading

import pytest
import torch

from sluice.errors import FencedError
from sluice.trainer_hooks.manager import CheckpointConfig, CheckpointManager
from sluice.trainer_hooks.verify import scan

HOLD_LOCK = (
    "import sys\nfrom sluice.trainer_hooks.runrecord import RunRecord\n"
    "rec = RunRecord(sys.argv[1])\n"
    "with rec.locked():\n    print('held', flush=True)\n"
    "    if sys.stdin.read() == 'bump':\n"
    "        obj = rec._read_unlocked()\n        rec._write_unlocked({**obj, 'generation': obj['generation'] + 1})\n"
)


class Steps:
    """A fenced JSON data stateful (test double of the data client); records commits and their thread."""

    def __init__(self) -> None:
        self.step = -1
        self.commits: list[tuple[int, int]] = []

    def state_dict(self) -> dict:
        return {"step": self.step, "dataset_id": "b3:ds", "runspec_digest": "b3:rs", "lanes": {"0": [self.step, 1]}}

    def load_state_dict(self, state: dict) -> None:
        self.reset(state)

    def reset(self, state: dict | None = None) -> None:
        self.step = -1 if state is None else state["step"]

    def fence(self, generation: int) -> None:
        self.generation = generation

    def commit(self, step: int) -> None:
        self.commits.append((step, threading.get_ident()))

    def check_resize(self, saved_world_size: int, world_size: int) -> None:
        pass  # an elastic contract


class LockHolder:
    """Another process holding the run lock until release()."""

    def __init__(self, root) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self, bump: bool = False) -> None:
        """Let go of the lock; with `bump`, a newer writer's generation is written first."""
        if bump:
            self.proc.stdin.write("bump")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def make(root, policy="block", **cfg):
    model = torch.nn.Linear(32, 32)
    with torch.no_grad():
        model.weight.zero_()
    data = Steps()
    mgr = CheckpointManager(root, {"model": model, "data": data},
                            config=CheckpointConfig(async_save=True, policy=policy, keep_last=10, **cfg))
    assert mgr.restore() == 0  # an empty folder: a fresh start at generation 1
    return mgr, model, data, data.commits


def test_async_save_stages_an_immutable_copy_and_commits_on_the_caller_thread(tmp_path):
    mgr, model, data, commits = make(tmp_path)
    holder = LockHolder(tmp_path)
    try:
        data.step = 0
        report = mgr.save(0)
        assert report.mode == "async" and not report.durable and report.durability_lag_s is None
        # Training goes on and mutates the model while the drain is held at publish.
        with torch.no_grad():
            model.weight.add_(5.0)
        data.step = 1
        assert scan(tmp_path) == []  # nothing visible yet
    finally:
        holder.release()
    durable = mgr.wait()
    assert durable.step == 0 and durable.durable
    assert durable.durability_lag_s >= durable.exposed_pause_s > 0
    # commit ran on this (the trainer's) thread, after the drain
    assert commits == [(0, threading.get_ident())] and data.generation == 1
    restored = torch.nn.Linear(32, 32)
    steps = Steps()
    CheckpointManager(tmp_path, {"model": restored, "data": steps}).restore()
    assert torch.all(restored.weight == 0) and steps.step == 0  # the staged copy, not the mutated model


def test_skip_policy_drops_a_save_that_arrives_during_a_drain(tmp_path, caplog):
    mgr, model, data, commits = make(tmp_path, policy="skip")
    holder = LockHolder(tmp_path)
    try:
        mgr.save(0)
        skipped = mgr.save(1)
        assert skipped.skipped and mgr.skipped_saves == 1
        assert "skipped" in caplog.text and "policy=skip" in caplog.text
    finally:
        holder.release()
    mgr.wait()
    mgr.save(2)
    mgr.wait()
    assert [i.step for i in scan(tmp_path)] == [2, 0]
    assert [c[0] for c in commits] == [0, 2]


def test_block_policy_waits_for_the_drain_and_counts_the_wait(tmp_path):
    mgr, model, data, commits = make(tmp_path, policy="block")
    holder = LockHolder(tmp_path)
    out: dict = {}
    mgr.save(0)
    second = threading.Thread(target=lambda: out.setdefault("report", mgr.save(1)))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # blocked behind the held drain: the backlog is one
    holder.release()
    second.join(timeout=60)
    report = out["report"]
    assert report.blocked_s > 0 and report.exposed_pause_s >= report.blocked_s
    mgr.wait()
    assert [i.step for i in scan(tmp_path)] == [1, 0] and mgr.skipped_saves == 0


def test_a_failed_drain_surfaces_on_the_next_call(tmp_path):
    mgr, model, data, commits = make(tmp_path)
    mgr.save(0)
    mgr.wait()
    # A newer writer takes over (under the lock) while this one drains step 1.
    holder = LockHolder(tmp_path)
    mgr.save(1)
    holder.release(bump=True)
    with pytest.raises(FencedError, match="holds generation 1, the run record says 2"):
        mgr.wait()
    assert [i.step for i in scan(tmp_path)] == [0]
    assert [c[0] for c in commits] == [0]


def test_every_auto_uses_youngs_interval_from_the_measured_cost(tmp_path):
    model = torch.nn.Linear(8, 8)
    mgr = CheckpointManager(tmp_path, {"model": model}, config=CheckpointConfig(every="auto", mtbf_s=3600.0))
    assert mgr.interval_s is None and mgr.should_save(0)
    report = mgr.maybe_save(0)
    assert report is not None
    assert mgr.interval_s == pytest.approx(math.sqrt(2 * report.exposed_pause_s * 3600.0))
    assert mgr.maybe_save(1) is None  # far less than T* has passed
    tiny = CheckpointManager(tmp_path / "b", {"model": model}, config=CheckpointConfig(every="auto", mtbf_s=1e-12))
    assert tiny.maybe_save(0) is not None and tiny.maybe_save(1) is not None


def test_every_n_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, {"model": torch.nn.Linear(2, 2)}, config=CheckpointConfig(every=3, keep_last=9))
    saved = [s for s in range(10) if mgr.maybe_save(s) is not None]
    assert saved == [0, 3, 6, 9]


def _held_wait(caplog, holder, call) -> list[str]:
    """Run `call` in a thread while `holder` holds the run lock (a drain held at its publish) for 0.7 s: the
    warnings it logged meanwhile (it must still wait then), after the holder let go and it ended."""
    caplog.clear()
    t = threading.Thread(target=call)
    t.start()
    t.join(timeout=0.7)
    assert t.is_alive(), "did not wait for the held drain"
    said = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    holder.release()
    t.join(timeout=60)
    assert not t.is_alive()
    return said


def test_a_wait_for_a_drain_held_up_is_said_while_it_lasts(tmp_path, caplog, monkeypatch):
    # the drain held at its publish (a slow or hung filesystem, as the trainer sees it): both waits for it,
    # wait() and a save under policy=block, are warnings naming who waits and for which drain, doubling
    from sluice.trainer_hooks import manager

    monkeypatch.setattr(manager, "SAY_AFTER_S", 0.2)
    mgr, model, data, commits = make(tmp_path, policy="block")
    with caplog.at_level(logging.WARNING, logger="sluice.trainer_hooks"):
        holder = LockHolder(tmp_path)
        mgr.save(0)
        said = _held_wait(caplog, holder, mgr.wait)
        assert said and all(m.startswith("the trainer has waited ") and "sluice-ckpt-drain-0" in m for m in said)
        assert len(said) <= 3, said  # (at 0.2 and 0.4 s: doubling, not once a period)
        holder = LockHolder(tmp_path)
        mgr.save(1)
        said = _held_wait(caplog, holder, lambda: mgr.save(2))
        assert said and all(m.startswith("checkpoint step 2 (policy=block) has waited ") and
                            "sluice-ckpt-drain-1" in m for m in said), said
    mgr.wait()
    assert [i.step for i in scan(tmp_path)] == [2, 1, 0]
