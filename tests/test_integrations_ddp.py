"""sluice.integrations.ddp: two gloo ranks end a step with identical, summed gradients."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")

from integrations_support import run_rank_scripts  # noqa: E402

RANK_CODE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from sluice.integrations.ddp import deterministic_setup, deterministic_allreduce, global_count
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], f"{sys.argv[4]}-r{sys.argv[1]}.pt"
    deterministic_setup()
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)                         # identical initial parameters on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    y[::3] = -100                                # positions without loss
    per = 8 // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    n = global_count((y != -100).sum())
    loss = torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n
    loss.backward()
    reduced = deterministic_allreduce(model)
    torch.save({"grads": [p.grad for p in model.parameters()], "n": int(n), "reduced": reduced}, out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
""")


def run_ranks(world: int, tmp: Path) -> list[dict]:
    outs = [tmp / f"w{world}-r{r}.pt" for r in range(world)]
    run_rank_scripts(RANK_CODE, world, tmp, str(tmp / f"w{world}"))
    return [torch.load(o, weights_only=True) for o in outs]


@pytest.mark.slow  # three torch processes
def test_two_ranks_sum_gradients_identically_and_match_one_process(tmp_path):
    one = run_ranks(1, tmp_path)[0]
    r0, r1 = run_ranks(2, tmp_path)
    assert r0["n"] == r1["n"] == one["n"] and one["reduced"] == 0
    assert r0["reduced"] == sum(g.numel() for g in r0["grads"])
    for a, b, c in zip(r0["grads"], r1["grads"], one["grads"]):
        assert torch.equal(a, b)  # bitwise the same on every rank
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)  # the global batch's gradient, to rounding
