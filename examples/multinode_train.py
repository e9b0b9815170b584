"""Train on many nodes: one command for every node; each rank reads from its own node's loaderd.

Each node, once (docs/deploy.md, "Many nodes"): a loaderd serving the node's
ranks, and a node file saying where it listens and which keys prove the
ranks to it (relative paths are relative to the file)::

    sluice curve-keys keys/ loaderd && sluice curve-keys keys/ trainer && cp keys/trainer.key allowed/
    loaderd manifest.json run.toml --cache /var/cache/sluice --replicas 4 --node-rank N --ranks-per-node 2 \\
        --endpoint tcp://10.0.0.N:5555 --endpoint-file /run/sluice/endpoint \\
        --curve-secret keys/loaderd.key_secret --curve-clients allowed/
    cat /etc/sluice/node.env
    SLUICE_ENDPOINT_FILE=/run/sluice/endpoint
    SLUICE_CURVE_SECRET=keys/trainer.key_secret
    SLUICE_CURVE_SERVER=keys/loaderd.key

Then the same line on every node (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; rank r reads replica r)::

    SLUICE_NODE_FILE=/etc/sluice/node.env torchrun --nnodes 2 --node-rank N --nproc-per-node 2 \\
        --rdzv-backend static --master-addr head --master-port 29500 \\
        examples/multinode_train.py --manifest manifest.json --ckpt /shared/ckpt --steps 1000

Every start is a restart: after any crash, run the same line on every node and
training resumes after the newest checkpoint with exactly the batches an
uninterrupted run would have seen. `--log DIR` writes ``steps-r<rank>.jsonl``:
per step the generation, the loss (``float.hex``) and the digest of this
rank's micro-batches, the one `sluice plan --replicas WORLD_SIZE` prints.
The model is a bigram LM standing in for yours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sluice.client import Client
from sluice.manifest.model import load_manifest
from sluice.trainer_hooks import CheckpointManager
from sluice.wire.protocol import BATCH_ARRAYS, arrays_digest

IGNORE = -100  # the label of a position that carries no loss


def main(argv: Sequence[str] | None = None, on_step: Callable[[int], None] | None = None) -> int:
    """Train steps 0..--steps-1 (resuming from --ckpt); `on_step(step)` runs after each logged step."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="the frozen manifest.json (for the vocabulary size)")
    p.add_argument("--ckpt", required=True, help="checkpoint folder, shared by all ranks of all nodes")
    p.add_argument("--steps", type=int, required=True, help="train steps 0..STEPS-1")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--log", default=None, help="folder for steps-r<rank>.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one intra-op thread and deterministic kernels: a restart retrains bit for bit
    torch.use_deterministic_algorithms(True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")  # env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank() if world > 1 else 0

    torch.manual_seed(0)
    vocab = load_manifest(args.manifest).tokenizer.vocab_size
    model = nn.Sequential(nn.Embedding(vocab, 64), nn.Linear(64, vocab))
    ddp = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Endpoint, replica and keys from torchrun's variables and this node's $SLUICE_NODE_FILE.
    client = Client.from_env(end_step=args.steps)
    mgr = CheckpointManager(args.ckpt, {"model": model, "optim": opt, "data": client}, every=args.every)
    log = None
    if args.log:
        Path(args.log).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.log) / f"steps-r{rank}.jsonl", "a", encoding="utf-8")
    with client:
        start = mgr.restore()  # a new fencing generation; the newest checkpoint, or step 0
        saved = start - 1
        if log:
            print(json.dumps({"restored": saved, "generation": mgr.generation}), file=log, flush=True)
        for step, micros in client.steps(start):
            ids = torch.cat([mb["input_ids"] for mb in micros]).long()
            labels = torch.cat([mb["labels"] for mb in micros]).long()
            loss = F.cross_entropy(ddp(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks of all nodes
            opt.step()
            if log:
                digest = arrays_digest([{k: mb[k].numpy() for k in BATCH_ARRAYS} for mb in micros])
                print(json.dumps({"step": step, "generation": mgr.generation, "loss": loss.item().hex(),
                                  "digest": digest}), file=log, flush=True)
            if on_step:
                on_step(step)
            if mgr.maybe_save(step):
                saved = step
        if saved != args.steps - 1:
            mgr.save(args.steps - 1)  # the end of the run is always checkpointed
        mgr.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from sluice.errors import SluiceError

    try:
        code = main()
    except SluiceError as exc:  # a missing variable, an unreachable daemon, a fenced rank: one line
        print(f"multinode_train: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    raise SystemExit(code)
