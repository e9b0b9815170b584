"""`sluice ckpt list / verify / gc / drill` on real folders: in-process through `main(argv)` where
the test is about what a command reports or its refusals, as real subprocesses for exit codes and the drill."""

from __future__ import annotations

import json

import pytest
import torch

from sluice.trainer_hooks.manager import CheckpointConfig, CheckpointManager


def cli(*args: object) -> tuple[int, str, str]:
    """`sluice *args` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from sluice.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


class Data:
    """A fenced JSON data stateful (test double of the data client)."""

    def __init__(self) -> None:
        self.step = -1

    def state_dict(self):
        return {"step": self.step, "dataset_id": "b3:" + "a" * 64, "runspec_digest": "b3:" + "b" * 64,
                "lanes": {"0": {"draws": self.step + 1}}}

    def load_state_dict(self, state):
        self.reset(state)

    def reset(self, state=None):
        self.step = -1 if state is None else state["step"]

    def fence(self, generation):
        pass

    def commit(self, step):
        pass

    def check_resize(self, saved_world_size, world_size):
        pass


@pytest.fixture
def two_generations(tmp_path):
    """Generation 1 saves steps 0-2, generation 2 restores and saves step 3."""
    data = Data()
    mgr = CheckpointManager(tmp_path, {"model": torch.nn.Linear(8, 8), "data": data},
                            config=CheckpointConfig(keep_last=10))
    for step in range(3):
        data.step = step
        mgr.save(step)
    data2 = Data()
    mgr2 = CheckpointManager(tmp_path, {"model": torch.nn.Linear(8, 8), "data": data2},
                             config=CheckpointConfig(keep_last=10))
    mgr2.restore()
    data2.step = 3
    mgr2.save(3)
    return tmp_path


def test_list_shows_generation_latest_and_data_step(sluice_cli, two_generations):
    out = sluice_cli("ckpt", "list", two_generations, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["generation"] == 2 and doc["latest"] == "s000000000003-g000002"
    assert [(c["step"], c["generation"], c["data"]["step"]) for c in doc["checkpoints"]] == [
        (3, 2, 3), (2, 1, 2), (1, 1, 1), (0, 1, 0)]
    text = sluice_cli("ckpt", "list", two_generations)
    assert "* s000000000003-g000002" in text.stdout and "b3:aaaa" in text.stdout


def test_verify_reports_damage_and_exits_1(two_generations):
    code, out, _ = cli("ckpt", "verify", two_generations, "--all", "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    shard = two_generations / "ckpt" / "s000000000001-g000001" / "model.pt"
    shard.write_bytes(shard.read_bytes()[:10])
    code, out, _ = cli("ckpt", "verify", two_generations)
    assert code == 0 and "ok  s000000000003-g000002" in out
    code, out, _ = cli("ckpt", "verify", two_generations, "--all")
    assert code == 1
    assert "BAD s000000000001-g000001: shard model.pt (key model): 10 bytes" in out


def test_gc_defaults_to_the_runs_own_retention(sluice_cli, two_generations):
    out = sluice_cli("ckpt", "gc", two_generations, "--json")
    doc = json.loads(out.stdout)
    assert (doc["keep_last"], doc["keep_every"], doc["deleted"]) == (10, 0, [])


def test_gc_dry_run_then_real(sluice_cli, two_generations):
    dry = sluice_cli("ckpt", "gc", two_generations, "--keep-last", "2", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    doc = json.loads(dry.stdout)
    assert doc["deleted"] == ["ckpt/s000000000000-g000001", "ckpt/s000000000001-g000001"]
    assert (two_generations / "ckpt" / "s000000000000-g000001").exists()
    real = sluice_cli("ckpt", "gc", two_generations, "--keep-last", "2")
    assert real.returncode == 0 and "deleted 2 folder(s)" in real.stdout
    assert sorted(p.name for p in (two_generations / "ckpt").iterdir()) == [
        "s000000000002-g000001", "s000000000003-g000002"]


@pytest.mark.slow
def test_drill_restores_latest_and_an_older_generation(sluice_cli, two_generations):
    out = sluice_cli("ckpt", "drill", two_generations, "--head-step", "5", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is True
    latest, older = doc["results"]
    assert (latest["role"], latest["name"], latest["rpo_steps"]) == ("latest", "s000000000003-g000002", 2)
    assert (older["role"], older["generation"], older["rpo_steps"]) == ("older", 1, 3)
    assert latest["tensors"] == 2 and latest["restore_s"] > 0 and latest["data_step"] == 3
    # the drill is read-only: it did not fence the live writer
    assert json.loads((two_generations / "run.json").read_text())["generation"] == 2


def test_drill_reports_damaged_checkpoints(sluice_cli, two_generations):
    for name in ("s000000000003-g000002", "s000000000002-g000001"):
        (two_generations / "ckpt" / name / "rng.json").write_text("{}")
    out = sluice_cli("ckpt", "drill", two_generations, "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and [r["ok"] for r in doc["results"]] == [False, False]
    assert all("shard rng.json (key rng): 2 bytes" in r["problems"][0] for r in doc["results"])


@pytest.mark.parametrize("action", ["list", "verify", "gc", "drill"])
def test_missing_folder_is_a_clear_error(sluice_main, tmp_path, action):
    out = sluice_main("ckpt", action, tmp_path / "nope")
    assert out.returncode == 2 and f"checkpoint folder {tmp_path / 'nope'} does not exist" in out.stderr
