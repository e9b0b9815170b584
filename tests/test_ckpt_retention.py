"""Retention rules as properties, and bounded GC on a real checkpoint folder."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sluice.trainer_hooks.manager import CheckpointConfig, CheckpointManager
from sluice.trainer_hooks.runrecord import RunRecord
from sluice.trainer_hooks.retention import collect_garbage, plan_retention
from sluice.trainer_hooks.verify import scan

checkpoints = st.sets(st.tuples(st.integers(0, 60), st.integers(1, 4)), max_size=25)


@given(checkpoints, st.integers(1, 5), st.integers(0, 7), st.data())
def test_plan_keeps_latest_and_partitions_the_input(items, keep_last, keep_every, data):
    latest = data.draw(st.sampled_from(sorted(items))) if items else None
    keep, delete = plan_retention(items, latest, keep_last=keep_last, keep_every=keep_every)
    assert keep | delete == items and not keep & delete
    if latest is not None:
        assert latest in keep


@given(st.lists(st.integers(0, 1000), unique=True, max_size=30), st.integers(1, 5), st.integers(0, 7))
def test_single_generation_keeps_last_k_and_every_nth(steps, keep_last, keep_every):
    items = {(s, 1) for s in steps}
    keep, _ = plan_retention(items, None, keep_last=keep_last, keep_every=keep_every)
    expected = set(sorted(items, reverse=True)[:keep_last])
    if keep_every:
        expected |= {k for k in items if k[0] % keep_every == 0}
    assert keep == expected


def test_superseded_generation_is_collected_but_not_if_latest():
    # Generation 2 resumed from step 20, so generation 1's steps 20 and 30 are an
    # abandoned branch; step 10 of generation 1 is still history.
    items = {(10, 1), (20, 1), (30, 1), (20, 2), (25, 2)}
    keep, delete = plan_retention(items, (25, 2), keep_last=5)
    assert delete == {(20, 1), (30, 1)}
    keep, delete = plan_retention(items, (30, 1), keep_last=5)
    assert (30, 1) in keep and delete == {(20, 1)}


class Data:
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def test_manager_applies_retention_after_each_publish(tmp_path):
    mgr = CheckpointManager(tmp_path, {"model": torch.nn.Linear(2, 2), "data": Data()},
                            config=CheckpointConfig(keep_last=2, keep_every=4))
    for step in range(10):
        mgr.save(step)
    assert sorted(i.step for i in scan(tmp_path)) == [0, 4, 8, 9]
    assert mgr.last_gc is not None and "ckpt/s000000000007-g000001" in mgr.last_gc.deleted


def test_gc_is_bounded_and_collects_debris_but_not_a_live_writers_staging(tmp_path):
    mgr = CheckpointManager(tmp_path, {"model": torch.nn.Linear(2, 2)}, config=CheckpointConfig(keep_last=10))
    for step in range(6):
        mgr.save(step)
    # Debris: staging of dead generation 1 and a never-committed folder; then a new
    # writer (generation 2) is staging right now.
    (tmp_path / "staging" / "g1-s6").mkdir()
    (tmp_path / "staging" / "g1-s6" / "model.pt").write_bytes(b"partial")
    (tmp_path / "ckpt" / "s000000000007-g000001").mkdir()
    RunRecord(tmp_path).acquire()  # a new writer took generation 2
    (tmp_path / "staging" / "g2-s9").mkdir()

    first = collect_garbage(tmp_path, keep_last=2, max_deletions=3)
    assert len(first.deleted) == 3 and first.pending == 3
    second = collect_garbage(tmp_path, keep_last=2, max_deletions=3)
    assert second.pending == 0
    gone = set(first.deleted) | set(second.deleted)
    assert {"staging/g1-s6", "ckpt/s000000000007-g000001"} <= gone
    assert [d.name for d in (tmp_path / "staging").iterdir()] == ["g2-s9"]
    assert [i.step for i in scan(tmp_path)] == [5, 4]
    assert (tmp_path / "latest").read_text().strip() == "s000000000005-g000001"
    assert not (tmp_path / "trash").exists() or list((tmp_path / "trash").iterdir()) == []


def test_gc_never_deletes_what_latest_points_to(tmp_path):
    mgr = CheckpointManager(tmp_path, {"model": torch.nn.Linear(2, 2)}, config=CheckpointConfig(keep_last=10))
    for step in range(4):
        mgr.save(step)
    (tmp_path / "latest").write_text("s000000000000-g000001\n")
    collect_garbage(tmp_path, keep_last=1)
    assert sorted(i.step for i in scan(tmp_path)) == [0, 3]
