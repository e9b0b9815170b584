"""Checkpoint manager: round trips, verification and every bad input of issue 6.

The data stateful here is `LaneData`, a plain class speaking the
`FencedStateful` protocol with a JSON state shaped like the data client's
(dataset ID, run-spec digest, step, lane states): a test double of an external
protocol, which records the calls the manager makes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.errors import CheckpointError, FencedError, StateError
from sluice.trainer_hooks.layout import MANIFEST_NAME
from sluice.trainer_hooks.manager import CheckpointManager, ModelOptimState
from sluice.trainer_hooks.runrecord import RunRecord

DATASET = "b3:" + "d" * 64
SPEC = "b3:" + "5" * 64


class LaneData:
    """Stand-in for the data client: a JSON state of lanes; records the fencing protocol's calls."""

    def __init__(self, dataset_id: str = DATASET, runspec_digest: str = SPEC) -> None:
        self.dataset_id, self.runspec_digest = dataset_id, runspec_digest
        self.step = -1
        self.events: list[tuple] = []
        self.commits: list[int] = []

    def advance(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"kind": "sluice.data_state", "schema": 1, "dataset_id": self.dataset_id,
                "runspec_digest": self.runspec_digest, "step": self.step,
                "lanes": {str(k): {"draws": 3 * (self.step + 1) + k, "residual": [f"s{k}", 7]} for k in range(4)}}

    def load_state_dict(self, state: dict) -> None:
        self.reset(state)

    def reset(self, state: dict | None = None) -> None:
        if state is not None and state["dataset_id"] != self.dataset_id:
            raise StateError(f"data state of dataset {state['dataset_id']}, this run reads {self.dataset_id}")
        self.events.append(("reset", None if state is None else state["step"]))
        self.step = -1 if state is None else state["step"]

    def fence(self, generation: int) -> None:
        self.events.append(("fence", generation))

    def commit(self, step: int) -> None:
        self.commits.append(step)

    def check_resize(self, saved_world_size: int, world_size: int) -> None:
        self.events.append(("check_resize", saved_world_size, world_size))


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 16)  # draws from torch's RNG: restored RNG must give the same batch
    loss = model(x).pow(2).mean() + 0.01 * np.random.rand() + 0.01 * random.random()
    opt.zero_grad()
    loss.backward()
    opt.step()


def manager(root: Path, model, opt, data, fmt: str = "torch", **cfg) -> CheckpointManager:
    statefuls = {"model": model, "optim": opt} if fmt == "torch" else {"app": ModelOptimState(model, opt)}
    return CheckpointManager(root, {**statefuls, "data": data}, format=fmt, **cfg)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run(root: Path, steps: range, mgr: CheckpointManager, model, opt, data, every: int) -> None:
    for step in steps:
        train_step(model, opt)
        data.advance(step)
        if step % every == 0:
            mgr.save(step)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, fmt):
    # Uninterrupted reference: 8 steps.
    model, opt = make_model(0)
    random.seed(1), np.random.seed(1)
    for _ in range(8):
        train_step(model, opt)
    reference = params(model)

    # Interrupted: 5 steps with a checkpoint after step 4, then a fresh process-like
    # restart with different seeds everywhere, restore, and 3 more steps.
    model, opt = make_model(0)
    random.seed(1), np.random.seed(1)
    data = LaneData()
    mgr = manager(tmp_path, model, opt, data, fmt)
    for step in range(5):
        train_step(model, opt)
        data.advance(step)
    mgr.save(4)

    model2, opt2 = make_model(99)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    data2 = LaneData()
    mgr2 = manager(tmp_path, model2, opt2, data2, fmt)
    assert mgr2.restore() == 5  # the first step to train
    report = mgr2.last_restore
    assert (report.step, report.generation, report.skipped) == (4, 2, ())
    # the new generation is handed over before the data state is loaded
    assert data2.events == [("fence", 2), ("reset", 4)]
    for _ in range(3):
        train_step(model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(reference, params(model2), strict=True))


def test_manifest_lists_every_shard_with_key_bytes_and_blake3(tmp_path):
    model, opt = make_model(0)
    data = LaneData()
    data.advance(11)
    mgr = CheckpointManager(tmp_path, {"model": model, "optim": opt, "data": data})
    report = mgr.save(11)
    folder = tmp_path / "ckpt" / report.name
    man = json.loads((folder / MANIFEST_NAME).read_bytes())
    assert {s["key"] for s in man["shards"]} == {"model", "optim", "data", "rng"} == set(man["keys"])
    for shard in man["shards"]:
        import blake3

        blob = (folder / shard["file"]).read_bytes()
        assert (len(blob), blake3.blake3(blob).hexdigest()) == (shard["bytes"], shard["blake3"])
    assert man["data"] == {"key": "data", "step": 11, "dataset_id": DATASET, "runspec_digest": SPEC}
    # the data state is JSON on disk, never a pickle
    assert json.loads((folder / "data.json").read_bytes())["lanes"]["0"]["draws"] == 36
    assert (tmp_path / "latest").read_text().strip() == report.name
    assert data.commits == [11] and data.events == [("fence", 1)]  # a save before any restore fenced it
    assert report.data_bytes == (folder / "data.json").stat().st_size
    assert list((tmp_path / "staging").iterdir()) == []


def saved_dir(tmp_path: Path, steps=(0, 1, 2)) -> tuple[Path, list[str]]:
    model, opt = make_model(0)
    data = LaneData()
    mgr = manager(tmp_path, model, opt, data, keep_last=10)
    names = []
    for step in steps:
        train_step(model, opt)
        data.advance(step)
        names.append(mgr.save(step).name)
    return tmp_path, names


def restore_fresh(root: Path, **kw):
    model, opt = make_model(5)
    data = LaneData()
    mgr = manager(root, model, opt, data, **kw)
    mgr.restore()
    return mgr.last_restore, data


def test_truncated_shard_is_skipped_for_the_previous_checkpoint(tmp_path):
    root, names = saved_dir(tmp_path)
    shard = root / "ckpt" / names[-1] / "model.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    report, data = restore_fresh(root)
    assert report.restored == names[-2] and data.step == 1
    assert report.skipped[0][0] == names[-1] and "bytes, manifest says" in report.skipped[0][1][0]
    # the damaged one is retired, so it can never be chosen again
    assert report.retired == (names[-1],)
    assert (root / "latest").read_text().strip() == names[-2]


def test_flipped_byte_is_detected_by_blake3(tmp_path):
    root, names = saved_dir(tmp_path)
    shard = root / "ckpt" / names[-1] / "optim.pt"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    shard.write_bytes(bytes(blob))
    report, _ = restore_fresh(root)
    assert report.restored == names[-2]
    assert "BLAKE3" in report.skipped[0][1][0] and "optim.pt" in report.skipped[0][1][0]


def test_missing_manifest_means_never_committed(tmp_path):
    root, names = saved_dir(tmp_path)
    (root / "ckpt" / names[-1] / MANIFEST_NAME).unlink()
    report, _ = restore_fresh(root)
    assert report.restored == names[-2]


def test_manifest_pointing_at_a_missing_shard(tmp_path):
    root, names = saved_dir(tmp_path)
    (root / "ckpt" / names[-1] / "rng.json").unlink()
    report, _ = restore_fresh(root)
    assert report.restored == names[-2]
    assert report.skipped[0][1] == ("shard rng.json (key rng): missing",)


def test_latest_pointing_at_garbage_falls_back_to_scanning(tmp_path):
    root, names = saved_dir(tmp_path)
    (root / "latest").write_bytes(b"\xff\x00not a checkpoint name\n")
    report, data = restore_fresh(root)
    assert report.restored == names[-1] and data.step == 2


def test_rollback_window_bounds_how_far_restore_walks_back(tmp_path):
    root, names = saved_dir(tmp_path, steps=(0, 1, 2, 3))
    for name in names[1:]:
        (root / "ckpt" / name / "data.json").write_bytes(b"{}")
    with pytest.raises(CheckpointError, match="rollback window of 2") as err:
        restore_fresh(root, rollback_window=2)
    assert names[-1] in str(err.value) and names[-2] in str(err.value)
    report, _ = restore_fresh(root, rollback_window=3)
    assert report.restored == names[0]


@pytest.mark.parametrize(
    ("field", "expected", "stored"),
    [("dataset ID", dict(expected_dataset_id="b3:" + "e" * 64), DATASET),
     ("run spec", dict(expected_runspec_digest="b3:" + "6" * 64), SPEC)],
)
def test_expected_identity_is_checked_before_anything_is_loaded(tmp_path, field, expected, stored):
    root, _ = saved_dir(tmp_path, steps=(0,))
    model, opt = make_model(1)
    data = LaneData()
    mgr = manager(root, model, opt, data)
    with pytest.raises(StateError) as err:
        mgr.restore(**expected)
    message = str(err.value)
    assert stored in message and next(iter(expected.values())) in message
    assert data.events == []  # nothing was sent to the daemon


def test_a_state_the_data_stateful_refuses_leaves_the_model_untouched(tmp_path):
    root, _ = saved_dir(tmp_path, steps=(0,))
    model, opt = make_model(1)
    before = params(model)
    data = LaneData(dataset_id="b3:" + "e" * 64)  # this trainer reads another dataset
    with pytest.raises(StateError, match="this run reads"):
        manager(root, model, opt, data).restore()
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


def test_stale_writer_is_fenced_and_publishes_nothing(tmp_path):
    model, opt = make_model(0)
    old = manager(tmp_path, model, opt, LaneData())
    first = old.save(0).name
    # A second writer takes over (restore bumps the generation) ...
    new = manager(tmp_path, *make_model(1), LaneData())
    new.restore()
    # ... and the old one, still alive, tries to publish a newer step.
    with pytest.raises(FencedError, match="holds generation 1, the run record says 2"):
        old.save(1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [first]
    assert list((tmp_path / "staging").iterdir()) == []
    assert (tmp_path / "latest").read_text().strip() == first
    assert new.save(1).generation == 2


def test_restore_of_an_empty_folder_is_a_fresh_start(tmp_path):
    report, data = restore_fresh(tmp_path)
    assert (report.restored, report.generation, report.start) == (None, 1, 0)
    assert data.events == [("fence", 1), ("reset", None)]  # the data starts over at step 0


def test_run_record_refuses_garbage(tmp_path):
    (tmp_path / "run.json").write_text("{nope")
    with pytest.raises(CheckpointError, match="run.json: not valid JSON"):
        RunRecord(tmp_path).acquire()


def test_data_state_that_is_not_json_is_refused(tmp_path):
    class Bad(LaneData):
        def state_dict(self):
            return {"tensor": torch.zeros(1)}

    model, opt = make_model(0)
    with pytest.raises(StateError, match="JSON-serializable"):
        CheckpointManager(tmp_path, {"model": model, "data": Bad()}).save(0)
    assert not (tmp_path / "latest").exists()


def test_shard_with_pickled_object_is_refused_by_weights_only(tmp_path):
    root, names = saved_dir(tmp_path, steps=(0, 1))
    # Replace a shard with a pickle of an arbitrary object and fix up its manifest
    # entry, as an attacker with write access would: torch.load(weights_only=True) refuses.
    folder = root / "ckpt" / names[-1]
    torch.save({"evil": Path("/")}, folder / "model.pt")
    import blake3

    man = json.loads((folder / MANIFEST_NAME).read_bytes())
    blob = (folder / "model.pt").read_bytes()
    for shard in man["shards"]:
        if shard["file"] == "model.pt":
            shard.update(bytes=len(blob), blake3=blake3.blake3(blob).hexdigest())
    (folder / MANIFEST_NAME).write_text(json.dumps(man))
    report, data = restore_fresh(root)  # skipped for the previous good checkpoint, with the reason
    assert report.restored == names[-2] and data.step == 0
    assert report.skipped[0][0] == names[-1] and "model.pt cannot be loaded safely" in report.skipped[0][1][0]


def test_explicit_rollback_retires_the_newer_branch(tmp_path):
    root, names = saved_dir(tmp_path, steps=(0, 1, 2, 3))
    model, opt = make_model(3)
    data = LaneData()
    mgr = manager(root, model, opt, data)
    mgr.restore(step=1)
    report = mgr.last_restore
    assert report.restored == names[1] and set(report.retired) == {names[2], names[3]}
    data.advance(2)
    mgr.save(2)
    # a later crash-restart resumes the new branch, not the abandoned one
    report2, data2 = restore_fresh(root)
    assert report2.restored == "s000000000002-g000002" and data2.step == 2


def test_trainer_hooks_never_import_the_daemon():
    import subprocess
    import sys

    code = ("import sys, sluice.trainer_hooks.manager, sluice.trainer_hooks.cli, sluice.trainer_hooks.drill\n"
            "print(sorted(m for m in sys.modules if m.startswith(('sluice.loaderd', 'sluice.client', 'zmq'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_rng_states_round_trip_through_json_including_cached_gaussians():
    from sluice.trainer_hooks.state import capture_rng, encode_json_state, restore_rng

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached gaussian in both generators
    saved = json.loads(encode_json_state(capture_rng(), "rng"))
    assert saved["numpy"]["has_gauss"] == 1 and saved["python"]["gauss_next"] is not None
    expected = (random.gauss(0, 1), np.random.standard_normal(), torch.randn(3).tolist(), random.random())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(saved, "test")
    assert (random.gauss(0, 1), np.random.standard_normal(), torch.randn(3).tolist(), random.random()) == expected
    with pytest.raises(CheckpointError, match="RNG state schema"):
        restore_rng({"schema": "other"}, "test")


def test_a_resize_merges_the_ranks_data_states_with_datastate_merge():
    from sluice.trainer_hooks.state import merge_data_states

    def rank_state(lanes: dict[str, int], step: int = 4) -> dict:
        return {"kind": "sluice.data-state", "schema": 1, "dataset_id": DATASET, "runspec_digest": SPEC,
                "step": step, "lanes": {k: {"draws": v, "rows": v, "sources": [[0, v, 1, v, 9 * v, 8 * v, v]],
                                            "packers": {}} for k, v in lanes.items()}}

    merged = merge_data_states([rank_state({"0": 5, "2": 7}), rank_state({"1": 6, "3": 8})])
    assert list(merged["lanes"]) == ["0", "1", "2", "3"] and merged["lanes"]["3"]["draws"] == 8
    with pytest.raises(StateError, match="step 4 and step 5 differ"):
        merge_data_states([rank_state({"0": 5}), rank_state({"1": 6}, step=5)])
    with pytest.raises(StateError, match="disagree"):
        merge_data_states([rank_state({"0": 5}), rank_state({"0": 6})])
    with pytest.raises(StateError, match="negative"):
        merge_data_states([rank_state({"0": 5}), rank_state({"1": -6})])
