"""One optimizer step must be one sluice global step: a trainer's batch settings checked at train begin.

A framework that batches on its own (transformers' ``per_device_train_batch_size``
x ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``)
and a run spec that fixes the global batch can disagree. Unchecked, the
trainer draws some other number of sequences per optimizer step, its step
count drifts from sluice's, and the first checkpoint fails far from the
cause ("step 3 is not among the last 1024 steps it completed" after four
Trainer steps of one micro-batch each). Checked here before the first step:

    rank's sequences per optimizer step  == global_batch / replicas
    world size                           == replicas x peers   (each rank its own replica)

The error names every factor on both sides, e.g. ``per_device_train_batch_size
2 x gradient_accumulation_steps 1 x world size 1 = 2 sequences per optimizer
step, but the run spec's global_batch is 8``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from sluice.errors import StateError


def check_batch_split(client: Any, where: str, per_rank: Sequence[tuple[str, int]], world_size: int,
                      fix: Callable[[int], str]) -> None:
    """StateError unless one optimizer step of `world_size` ranks trains exactly one global step of the run spec.

    `per_rank`: the named factors of one rank's sequences per optimizer step
    (their product); `fix(rows)`: what to set so that a rank trains `rows`
    sequences per step (said when the world size is right and the rows are
    not). The run spec's numbers come from the daemon (`Client.batch_split`).
    """
    split = client.batch_split()
    peers = int(getattr(client, "peers", 1) or 1)
    replicas, global_batch = split["replicas"], split["global_batch"]
    rows = math.prod(v for _, v in per_rank)
    want_rows, want_world = global_batch // replicas, replicas * peers
    if rows == want_rows and world_size == want_world:
        return
    trained = rows * world_size // peers
    factors = " x ".join(f"{name} {value}" for name, value in per_rank)
    shared = f" / {peers} ranks per replica (peers)" if peers > 1 else ""
    spec = (f"micro_batch {split['micro_batch']} x {split['micro_per_step']} micro-batches per step x "
            f"{replicas} replica{'s' if replicas != 1 else ''}")
    if world_size != want_world:
        todo = (f"run {want_world} rank{'s' if want_world != 1 else ''}, each with its own replica "
                f"(Client(endpoint, rank, {replicas})), or give every client replicas={max(world_size // peers, 1)} "
                "(and a daemon started with that many)")
    else:
        todo = fix(want_rows)
    raise StateError(f"{where}: {factors} x world size {world_size}{shared} = {trained} sequences per optimizer "
                     f"step, but the run spec's global_batch is {global_batch} ({spec}); one optimizer step must "
                     f"train one global step: {todo}")
