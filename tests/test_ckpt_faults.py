"""Faults with real processes: kill -9 mid-write, disk full, racing writers.

Each child is a real Python process running the real CheckpointManager on the
same folder; the parent inspects and restores what the crash left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sluice.errors import CheckpointError
from sluice.trainer_hooks.manager import CheckpointManager
from sluice.trainer_hooks.runrecord import RunRecord
from sluice.trainer_hooks.verify import scan

CHILD_PRELUDE = textwrap.dedent("""
    import json, sys, time

    class Data:
        step = -1
        def state_dict(self):
            return {"dataset_id": "b3:x", "runspec_digest": "b3:y", "step": self.step, "lanes": {"0": [self.step]}}
        def load_state_dict(self, state):
            self.step = state["step"]
""")


TORCH = "import torch\nfrom sluice.trainer_hooks.manager import CheckpointManager, CheckpointConfig\n"


def run_child(body: str, *args: str, **kw) -> subprocess.Popen:
    body = textwrap.dedent(body)
    prelude = CHILD_PRELUDE + (TORCH if "torch" in body else "")
    return subprocess.Popen([sys.executable, "-c", prelude + body, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


class Holder:
    """Receives restored state in the parent (a plain Stateful)."""

    def __init__(self) -> None:
        self.state = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.state = state


def test_kill_9_in_the_middle_of_a_checkpoint_write_restores_the_previous_good_one(tmp_path):
    # The child saves a ~24 MB model every step; the parent waits until the
    # second checkpoint is being written into staging (files present, not yet
    # published) and kills the child with SIGKILL.
    child = run_child("""
        root = sys.argv[1]
        data = Data()
        model = torch.nn.Linear(2048, 3072)
        with torch.no_grad():
            model.weight.zero_()
        mgr = CheckpointManager(root, {"model": model, "data": data}, config=CheckpointConfig(keep_last=5))
        for step in range(1000):
            data.step = step
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step)
            print(step, flush=True)
    """, str(tmp_path))
    try:
        first = child.stdout.readline()
        assert first.strip() == "0", child.stderr.read()
        staging = tmp_path / "staging"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(d.is_dir() and any(d.iterdir()) for d in staging.iterdir()):
                break
            time.sleep(0.0005)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    debris = [d.name for d in (tmp_path / "staging").iterdir()]
    published = {i.step for i in scan(tmp_path, verify=True) if i.verified}
    assert published, "the first checkpoint must be published"

    import torch

    model = torch.nn.Linear(2048, 3072)
    data = Holder()
    mgr = CheckpointManager(tmp_path, {"model": model, "data": data})
    mgr.restore()
    report = mgr.last_restore
    # The newest fully published checkpoint is restored, exactly.
    assert report.step == max(published) and data.state["step"] == report.step
    assert torch.all(model.weight == report.step + 1)  # weights and data state from the same step
    assert report.generation == 2
    # The half-written staging folder is debris of an older generation: GC takes it.
    assert debris
    from sluice.trainer_hooks.retention import collect_garbage

    gc = collect_garbage(tmp_path, keep_last=5)
    assert any(name.startswith("staging/") for name in gc.deleted)
    assert list((tmp_path / "staging").iterdir()) == []


DISK_FULL_CHILD = """
    import resource, signal
    root, limit = sys.argv[1], int(sys.argv[2])
    data = Data()
    model = torch.nn.Linear(64, 64)
    mgr = CheckpointManager(root, {"model": model, "data": data})
    data.step = 0
    mgr.save(0)
    first = open(root + "/latest").read()
    # Now the filesystem refuses to grow any file past `limit` bytes (EFBIG), as
    # a full disk refuses with ENOSPC; a bigger model no longer fits.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    model2 = torch.nn.Linear(1024, 1024)
    mgr2 = CheckpointManager(root, {"model": model2, "data": data})
    mgr2.generation = mgr.generation
    data.step = 1
    try:
        mgr2.save(1)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    else:
        print(json.dumps({"error": None}))
"""


@pytest.mark.slow  # a child process importing torch (~2 s of CPU); the fast tier checks the same save on a tmpfs below
def test_disk_full_during_a_save_leaves_the_previous_checkpoint_and_latest(tmp_path):
    child = run_child(DISK_FULL_CHILD, str(tmp_path), str(1 << 20))
    out, err = child.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] == "CheckpointError", err
    assert "previous checkpoint and `latest` are unchanged" in result["message"]
    assert_only_first_checkpoint(tmp_path)


def assert_only_first_checkpoint(root: Path) -> None:
    infos = scan(root, verify=True)
    assert [(i.step, i.verified) for i in infos] == [(0, True)]
    assert (root / "latest").read_text().strip() == infos[0].name
    assert list((root / "staging").iterdir()) == []


def test_disk_full_on_a_real_tiny_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; the RLIMIT_FSIZE test (slow tier) covers the same path")
    try:
        import torch

        class D(Holder):
            def state_dict(self):
                return {"step": 0}

        mgr = CheckpointManager(mnt, {"model": torch.nn.Linear(64, 64), "data": D()})
        mgr.save(0)
        big = CheckpointManager(mnt, {"model": torch.nn.Linear(1024, 1024), "data": D()})
        big.generation = mgr.generation
        with pytest.raises(CheckpointError, match="No space left on device"):
            big.save(1)
        assert_only_first_checkpoint(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_compare_and_swap_under_racing_processes(tmp_path):
    # Eight processes each try 25 CAS increments from the value they read; every
    # successful swap must be unique (no lost update) and the final generation
    # equals the number of successes.
    body = """
        from sluice.trainer_hooks.runrecord import RunRecord
        rec = RunRecord(sys.argv[1])
        wins = []
        for _ in range(25):
            g = rec.generation()
            if rec.compare_and_swap(g, g + 1):
                wins.append(g + 1)
        print(json.dumps(wins))
    """
    children = [run_child(body, str(tmp_path)) for _ in range(8)]
    wins: list[int] = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        wins += json.loads(out)
    assert len(wins) == len(set(wins))
    assert sorted(wins) == list(range(1, len(wins) + 1))
    assert RunRecord(tmp_path).generation() == len(wins)
    assert len(wins) >= 25  # at least one process won every time it raced alone


@pytest.mark.slow
def test_racing_writers_exactly_one_generation_publishes(tmp_path):
    # Three writers each acquire a generation and then try to publish; only the
    # one holding the newest generation may succeed, the others are fenced.
    body = """
        from sluice.errors import FencedError
        root, barrier = sys.argv[1], sys.argv[2]
        data = Data()
        mgr = CheckpointManager(root, {"model": torch.nn.Linear(4, 4), "data": data})
        mgr.restore()
        gen = mgr.generation
        open(f"{barrier}/{gen}", "w").close()
        import os
        while len(os.listdir(barrier)) < 3:
            time.sleep(0.01)
        try:
            mgr.save(gen)
            print(json.dumps({"gen": gen, "ok": True}))
        except FencedError as exc:
            print(json.dumps({"gen": gen, "ok": False}))
    """
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    root = tmp_path / "ck"
    children = [run_child(body, str(root), str(barrier)) for _ in range(3)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["gen"] for r in results) == [1, 2, 3]
    assert [r["gen"] for r in results if r["ok"]] == [3]
    assert [(i.step, i.generation) for i in scan(root)] == [(3, 3)]
