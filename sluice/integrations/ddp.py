"""The data-parallel determinism recipe as helpers (CPU, gloo): the same update for a fixed R, bit for bit.

    from sluice.integrations.ddp import deterministic_setup, global_count, deterministic_allreduce

    deterministic_setup()                                   # one intra-op thread, deterministic algorithms
    n = global_count(sum((mb["labels"] != -100).sum() for mb in micros))   # the step's loss tokens, all ranks
    for mb in micros:
        (token_loss_sum(mb) / n).backward()                 # the global mean: the same update for every R
    deterministic_allreduce(model)                          # gradients SUMMED over ranks, one flat buffer
    opt.step()

Why a flat buffer in parameter order: one all-reduce of one tensor has one
summation order for a given world size, so every rank ends with identical
gradients and a restarted run computes the same bits; many small all-reduces
(or DDP's bucketed, hook-ordered ones) may be issued in another order.
Gradients are summed, not averaged: with the loss divided by the global
token count, the sum is the global mean's gradient for every R. Across a
change of R the global batch (and the loss-token count) is bitwise identical
but sums run in another order, so every step trained after a resize agrees
with the uninterrupted run to rounding, not bitwise (the table in
docs/integrations.md).

With one process (no process group, or world size 1) the helpers do nothing
but return their input, so one script serves both.

For frameworks that checkpoint the data state themselves with several ranks
(Lightning, the HF Trainer): `all_gather_json` (every rank's data state, never pickled, to
merge into one) and `fence_replicas` (one fencing generation for every rank's
client before a RESTORE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def deterministic_setup() -> None:
    """One intra-op and one inter-op thread and `torch.use_deterministic_algorithms(True)` (call first)."""
    torch.set_num_threads(1)  # a fixed reduction order inside each op
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started: the intra-op setting is what matters
        pass
    torch.use_deterministic_algorithms(True)


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def global_count(count: int | torch.Tensor, group: Any = None) -> torch.Tensor:
    """`count` (e.g. this rank's loss-bearing tokens) summed over every rank, as an int64 tensor."""
    t = torch.as_tensor(count, dtype=torch.int64).clone()
    if _world(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def deterministic_allreduce(model: nn.Module, group: Any = None) -> int:
    """Sum the gradients of `model` over ranks in one flat buffer, in parameter order; the number of
    gradient elements reduced (0 with one process).

    Every rank must hold gradients for the same parameters (ValueError naming
    the first parameter without one otherwise, before any communication: a
    mismatch would pair the wrong elements across ranks).
    """
    if _world(group) == 1:
        return 0
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in named if p.grad is None]
    if missing:
        raise ValueError(f"deterministic_allreduce: parameter {missing[0]!r} has no gradient on rank "
                         f"{dist.get_rank(group)} ({len(missing)} without); every rank must backward through "
                         "the same parameters (zero a gradient instead of leaving it None)")
    grads = [p.grad for _, p in named]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return int(flat.numel())


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (JSON-serializable), in rank order; ``[obj]`` with one process.

    Sent as UTF-8 JSON in uint8 tensors (sizes first, then one padded
    all-gather), never pickled: `torch.distributed.all_gather_object` would
    unpickle what arrives from the other ranks.
    """
    import json

    if _world(group) == 1:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")),
                            dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_world(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(t[: int(n)].numpy().tobytes()).decode("utf-8")) for t, n in zip(out, sizes)]


def fence_replicas(client: Any, group: Any = None) -> int:
    """Fence this rank's client with one generation shared by every rank (call on every rank before
    `client.reset(...)`); the generation. Nothing to do with one process (returns the client's generation).

    The daemon keeps one generation for the run: a reset without a fence takes
    the generation after the daemon's, so two ranks resetting one after the
    other would fence each other out. CheckpointManager does this itself; a
    framework that restores the data state on its own (Lightning, the HF
    Trainer) needs this. The shared value is the highest generation any rank's
    daemon reported, plus one.
    """
    if _world(group) == 1:
        return int(client.generation)
    client.connect()  # learn the daemon's generation
    g = torch.tensor([int(client.generation) + 1], dtype=torch.int64)
    dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
    client.fence(int(g))
    return int(g)
