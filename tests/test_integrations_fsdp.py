"""FSDP2 on sluice (2 ranks, CPU, gloo): kill -9 after a checkpoint, restore, bit for bit.

Real processes: examples/fsdp_train.py starts a private loaderd serving two
replicas and two ranks (torch.multiprocessing) that train a tiny causal LM
sharded with `fully_shard`. An uninterrupted run trains STEPS steps; the same
run is started again, the whole job (launcher, daemon, both ranks: the
process group) is killed with SIGKILL after the checkpoint of step EVERY, and
started once more, which restores each rank's model and optimizer shards and
its data state from CheckpointManager's newest checkpoint. Every micro-batch
each rank trains after the resume, and the final (gathered) parameters, equal
the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")

from integrations_support import EVERY, STEPS, finish, kill_when, lines, run_rank_scripts, start  # noqa: E402
from loaderd_support import build_corpus  # noqa: E402

from sluice.errors import CheckpointMismatch  # noqa: E402
from sluice.integrations.fsdp import FSDPState  # noqa: E402

SCRIPT = "fsdp_train.py"
RANKS = 2
MICROS = 2  # global batch 8 in micro-batches of 2 over 2 replicas: 2 micro-batches per rank and step


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("integ-fsdp"), "jsonl.zst", tokenizer_file, docs=160)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fsdp-reference")
    finish(start(SCRIPT, corpus, run), run)
    return run


def by_step(path: Path, skip: int = 0) -> list[tuple[int, int, tuple[str, ...]]]:
    return [(b["step"], b["micro"], tuple(b["rows"])) for b in lines(path, skip)]


def latest_step(run: Path) -> int | None:
    latest = run / "ckpt" / "latest"
    return int(latest.read_text().split("-")[0][1:]) if latest.is_file() else None


@pytest.mark.slow  # two ranks and a daemon
def test_uninterrupted_run_saves_each_ranks_shards_with_its_data_state(reference):
    for r in range(RANKS):
        trained = by_step(reference / f"batches-r{r}.jsonl")
        assert [(s, m) for s, m, _ in trained] == [(s, m) for s in range(STEPS) for m in range(MICROS)]
    other = {rows for s, m, rows in by_step(reference / "batches-r1.jsonl")}
    assert not other & {rows for s, m, rows in by_step(reference / "batches-r0.jsonl")}  # two replicas, two streams
    folder = reference / "ckpt" / "ckpt" / (reference / "ckpt" / "latest").read_text().strip()
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {s["file"] for s in manifest["shards"]}
    assert {"fsdp-r0.pt", "fsdp-r1.pt", "data-r0.json", "data-r1.json"} <= files
    shard = torch.load(folder / "fsdp-r1.pt", weights_only=True)
    assert shard["layout"] == {"kind": "sluice.fsdp-sharded/1", "world_size": 2, "rank": 1}
    full = torch.load(reference / "params.pt", weights_only=True)
    name = "tok.weight"
    assert shard["model"][name].shape[0] == (full[name].shape[0] + 1) // 2  # rank 1 holds its half, not the whole
    assert "exp_avg" in shard["optim"]["state"][name]


@pytest.mark.slow  # three jobs of two ranks each
def test_kill9_of_the_job_after_a_checkpoint_resumes_bit_for_bit(corpus, reference, tmp_path):
    run = tmp_path / "run"

    def past_checkpoint() -> bool:
        saved = latest_step(run)
        return saved is not None and saved >= EVERY and any(
            s > saved for s, _, _ in by_step(run / "batches-r0.jsonl"))

    kill_when(start(SCRIPT, corpus, run), past_checkpoint)
    first = latest_step(run) + 1  # what the restart resumes from
    assert EVERY < first < STEPS
    skips = [(run / f"batches-r{r}.jsonl").stat().st_size for r in range(RANKS)]
    crashed = [by_step(run / f"batches-r{r}.jsonl") for r in range(RANKS)]

    finish(start(SCRIPT, corpus, run), run)

    for r in range(RANKS):
        ref = {(s, m): rows for s, m, rows in by_step(reference / f"batches-r{r}.jsonl")}
        resumed = by_step(run / f"batches-r{r}.jsonl", skips[r])
        assert [(s, m) for s, m, _ in resumed] == [(s, m) for s in range(first, STEPS) for m in range(MICROS)]
        assert all(rows == ref[(s, m)] for s, m, rows in resumed), f"rank {r}: a resumed micro-batch differs"
        assert all(rows == ref[(s, m)] for s, m, rows in crashed[r]), f"rank {r}: a batch before the kill differs"
    events = lines(run / "events.jsonl")
    restores = [e for e in events if e["event"] == "restore"]
    assert [e["step"] for e in restores] == [None, first - 1]
    a, b = torch.load(reference / "params.pt", weights_only=True), torch.load(run / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == [], "parameters differ from the uninterrupted run"


def test_a_sharded_state_of_another_rank_or_mode_is_refused():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    state = FSDPState(model, opt).state_dict()  # one process: a plain model's state, rank 0 of 1
    assert state["layout"] == {"kind": "sluice.fsdp-sharded/1", "world_size": 1, "rank": 0}
    FSDPState(model, opt).load_state_dict(state)
    with pytest.raises(CheckpointMismatch, match=r"saved by rank 1 of 2, this is rank 0 of 1"):
        FSDPState(model, opt).load_state_dict({**state, "layout": {**state["layout"], "rank": 1, "world_size": 2}})
    with pytest.raises(CheckpointMismatch, match=r"an empty state: the checkpoint stored it per rank"):
        FSDPState(model, opt, full=True).load_state_dict({})
    with pytest.raises(CheckpointMismatch, match=r"holds layout 'sluice.fsdp-sharded/1', expected 'sluice.fsdp-full/1'"):
        FSDPState(model, opt, full=True).load_state_dict(state)


RANK_CODE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from sluice.integrations.ddp import deterministic_setup, global_count
    from sluice.integrations.fsdp import FSDPState, shard_model
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deterministic_setup()
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
        shard_model(model, units=[model[0], model[2]])
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    model, opt = build()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
        y[::3] = -100
        per = 8 // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        n = global_count((y != -100).sum())
        (torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n).backward()
        opt.step()
        opt.zero_grad()
    full = FSDPState(model, opt, full=True).state_dict()
    if rank == 0:
        torch.save(full, out)
    if world > 1:
        dist.barrier()
    # a fresh model and optimizer take the full state (as every rank reads a replicated shard) ...
    again, opt2 = build()
    FSDPState(again, opt2, full=True).load_state_dict(torch.load(out, weights_only=True))
    back = FSDPState(again, opt2, full=True).state_dict()
    if rank == 0:   # ... and give back the same bits
        assert all(torch.equal(back["model"][k], full["model"][k]) for k in full["model"]), "model round trip"
        mom = lambda s: {k: v["momentum_buffer"] for k, v in s["optim"]["state"].items()}
        assert all(torch.equal(mom(back)[k], v) for k, v in mom(full).items()), "optimizer round trip"
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
""")


def run_ranks(world: int, tmp: Path) -> dict:
    out = tmp / f"full-w{world}.pt"
    run_rank_scripts(RANK_CODE, world, tmp, str(out))
    return torch.load(out, weights_only=True)


@pytest.mark.slow  # three torch processes
def test_fsdp_ranks_sum_gradients_and_a_full_state_round_trips(tmp_path):
    one, two = run_ranks(1, tmp_path), run_ranks(2, tmp_path)
    assert two["layout"] == {"kind": "sluice.fsdp-full/1", "world_size": 2}
    for k, v in one["model"].items():
        # summed over ranks, the gradient of the global token mean: one process's update to rounding
        # (FSDP's default mean would halve every step here: SGD is not scale-invariant)
        torch.testing.assert_close(two["model"][k], v, rtol=1e-6, atol=1e-6)


RESIZE_CODE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from sluice.errors import CheckpointMismatch
    from sluice.integrations.ddp import deterministic_setup
    from sluice.integrations.fsdp import FSDPState, shard_model
    from sluice.trainer_hooks import CheckpointManager
    rank, world, init, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deterministic_setup()
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0 if world > 1 else 1)         # the restoring run starts from other parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    shard_model(model, units=[model[0], model[2]])
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if world > 1:   # train, then checkpoint the same model both ways: "model" full (rank 0), "fsdp" per rank
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = torch.randn(8, 8, generator=g)[rank * 4:(rank + 1) * 4], torch.randint(0, 5, (8,), generator=g)
            (torch.nn.functional.cross_entropy(model(x), y[rank * 4:(rank + 1) * 4], reduction="sum") / 8).backward()
            opt.step()
            opt.zero_grad()
        CheckpointManager(root, {"model": FSDPState(model, opt, full=True), "fsdp": FSDPState(model, opt)}).save(1)
        full = FSDPState(model, opt, full=True).state_dict()
        if rank == 0:
            torch.save(full, root + "/expected.pt")
        dist.barrier()
        dist.destroy_process_group()
    else:           # one process restores the two ranks' checkpoint
        assert CheckpointManager(root, {"model": FSDPState(model, opt, full=True)}).restore() == 2
        want = torch.load(root + "/expected.pt", weights_only=True)
        got = FSDPState(model, opt, full=True).state_dict()
        assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items()), "parameters"
        assert all(torch.equal(got["optim"]["state"][k]["momentum_buffer"], v["momentum_buffer"])
                   for k, v in want["optim"]["state"].items()), "momentum"
        try:
            CheckpointManager(root, {"fsdp": FSDPState(model, opt)}).restore()
            raise SystemExit("a sharded state saved by 2 ranks was restored on 1")
        except CheckpointMismatch as exc:
            assert "saved by rank 0 of 2, this is rank 0 of 1" in str(exc), exc
""")


@pytest.mark.slow  # three torch processes
def test_a_full_state_restores_on_another_world_size_and_a_sharded_one_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    run_rank_scripts(RESIZE_CODE, 2, tmp_path, str(root))
    run_rank_scripts(RESIZE_CODE, 1, tmp_path, str(root))
