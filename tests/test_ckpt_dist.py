"""Two real ranks (gloo process group): per-rank data and RNG shards, one commit.

Rank processes are real subprocesses joined by a file:// rendezvous; the
restore after a resize (2 ranks -> 1) runs in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import torch

from integrations_support import RANK_EPILOGUE
from sluice.trainer_hooks.manager import CheckpointManager

RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from sluice.trainer_hooks.manager import CheckpointManager
    root, rdzv, rank, phase = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)

    class Client:
        def __init__(self):
            self.step = -1
            self.lanes = {str(rank): 0, str(rank + 2): 0}
            self.generation = None
        def state_dict(self):
            return {"kind": "sluice.data-state", "schema": 1, "dataset_id": "b3:d", "runspec_digest": "b3:r",
                    "step": self.step, "lanes": {k: {"draws": v, "rows": 0, "sources": [], "packers": {}}
                                                 for k, v in self.lanes.items()}}
        def load_state_dict(self, state):
            self.reset(state)
        def reset(self, state=None):
            self.step = -1 if state is None else state["step"]
            self.lanes = {k: v["draws"] for k, v in (state or {"lanes": {}})["lanes"].items()}
        def fence(self, generation):
            self.generation = generation
        def commit(self, step):
            commits.append([step, self.generation])
        def check_resize(self, saved_world_size, world_size):
            pass  # an elastic contract: the resize test restores 2 ranks' states on 1

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    client = Client()
    commits = []
    mgr = CheckpointManager(root, {"model": model, "data": client})
    out = {"rank": rank}
    if phase == "save":
        torch.manual_seed(100 + rank)
        for step in range(2):
            client.step = step
            client.lanes = {k: 10 * step + int(k) for k in client.lanes}
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.save(step)
        out["next_rand"] = torch.rand(3).tolist()
        out["commits"] = commits
        out["weight0"] = model.weight[0, 0].item()
        # every="auto": rank 0 decides for all ranks (a per-rank clock could split them).
        from sluice.trainer_hooks.manager import CheckpointConfig
        auto = CheckpointManager(root + "-auto", {"model": model},
                                 config=CheckpointConfig(every="auto", mtbf_s=1e-12 if rank == 0 else 1e12))
        out["auto"] = [auto.maybe_save(s) is not None for s in range(3)]
    else:
        torch.manual_seed(7)
        mgr.restore()
        report = mgr.last_restore
        out.update(step=report.step, generation=client.generation, lanes=client.lanes,
                   next_rand=torch.rand(3).tolist(), weight0=model.weight[0, 0].item())
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def run_ranks(root, tmp_path, phase: str) -> list[dict]:
    rdzv = tmp_path / f"rdzv-{phase}"
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", RANK + RANK_EPILOGUE, str(root), str(rdzv),
                               str(r), phase],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


class Holder:
    """A fenced stateful that keeps the state it is reset to."""

    state = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.reset(state)

    def reset(self, state=None):
        self.state = state

    def fence(self, generation):
        self.generation = generation

    def commit(self, step):
        pass

    def check_resize(self, saved_world_size, world_size):
        pass  # an elastic contract


@pytest.mark.slow
def test_two_ranks_commit_together_restore_per_rank_and_resize_to_one(tmp_path):
    root = tmp_path / "ck"
    saved = run_ranks(root, tmp_path, "save")
    assert [o["commits"] for o in saved] == [[[0, 1], [1, 1]]] * 2  # both ranks heard every COMMIT
    assert [o["auto"] for o in saved] == [[True, True, True]] * 2
    folder = root / "ckpt" / "s000000000001-g000001"
    man = json.loads((folder / "manifest.json").read_text())
    assert sorted(s["file"] for s in man["shards"]) == [
        "data-r0.json", "data-r1.json", "model.pt", "rng-r0.json", "rng-r1.json"]
    assert man["extra"]["world_size"] == 2

    restored = run_ranks(root, tmp_path, "restore")
    for rank, (before, after) in enumerate(zip(saved, restored, strict=True)):
        assert (after["step"], after["generation"]) == (1, 2)
        assert after["lanes"] == {str(rank): 10 + rank, str(rank + 2): 12 + rank}
        assert after["next_rand"] == before["next_rand"]  # each rank's own RNG stream continues
        assert after["weight0"] == before["weight0"]  # the replicated model, written once by rank 0

    # Resize to one process: the data state holds the lanes of both old ranks.
    model = torch.nn.Linear(4, 4)
    data = Holder()
    assert CheckpointManager(root, {"model": model, "data": data}).restore() == 2
    assert data.generation == 3
    assert {k: v["draws"] for k, v in data.state["lanes"].items()} == {"0": 10, "1": 11, "2": 12, "3": 13}
    assert data.state["step"] == 1 and data.state["dataset_id"] == "b3:d"
