"""Train a small causal LM with FSDP2 (`fully_shard`, CPU, gloo) on sluice batches, checkpointing model
shards, optimizer shards and data state together.

Prepare a corpus once (`python -m sluice.demo --out demo-out --no-train`), then::

    python examples/fsdp_train.py --manifest demo-out/manifest.json --runspec demo-out/run.toml \\
        --cache demo-out/cache --out fsdp-run --steps 24 --every 4 --nproc 2

starts a private loaderd serving 2 replicas and 2 ranks (torch.multiprocessing,
gloo). Under torchrun, with a loaderd of your own, each process is one rank::

    loaderd demo-out/manifest.json demo-out/run.toml --cache demo-out/cache --replicas 2 \\
        --endpoint ipc:///tmp/sluice/l.sock &
    torchrun --standalone --nproc-per-node 2 examples/fsdp_train.py --manifest demo-out/manifest.json \\
        --runspec demo-out/run.toml --endpoint ipc:///tmp/sluice/l.sock --out fsdp-run --steps 24

Every start is a restart: `CheckpointManager.restore()` loads the newest
checkpoint under ``--out/ckpt`` (each rank's FSDP shards, `FSDPState`, and
its data state) or starts fresh, so after a crash the same command trains
exactly the batches, and ends with exactly the parameters, of an
uninterrupted run with the same number of ranks.

Outputs under ``--out``: ``batches-r<rank>.jsonl`` (one line per trained
micro-batch: step, micro, BLAKE3 of each row as in examples/train_lm.py),
``events.jsonl`` (restore and checkpoint events of rank 0) and, when the last
step is done, ``params.pt`` (the full parameters, gathered on rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the model and row digests of train_lm.py
from train_lm import IGNORE, TinyLM, row_digests  # noqa: E402

from sluice.client import Client  # noqa: E402
from sluice.integrations.ddp import deterministic_setup, global_count  # noqa: E402
from sluice.integrations.fsdp import FSDPState, shard_model  # noqa: E402
from sluice.manifest.model import load_manifest  # noqa: E402
from sluice.runspec import load_runspec  # noqa: E402
from sluice.trainer_hooks import CheckpointManager  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="frozen manifest.json")
    p.add_argument("--runspec", required=True, help="run spec (TOML)")
    p.add_argument("--endpoint", default=None, help="loaderd endpoint (one rank per process, RANK/WORLD_SIZE from "
                   "torchrun); default: start a private daemon and --nproc ranks")
    p.add_argument("--cache", default=None, help="node cache folder of the private daemon")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start without --endpoint (default 2)")
    p.add_argument("--out", required=True, help="folder for checkpoints (ckpt/), batches-r<rank>.jsonl, params.pt")
    p.add_argument("--steps", type=int, required=True, help="train steps 0..STEPS-1")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--init", default="env://", help="torch.distributed init method (default env://, as torchrun sets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def train(rank: int, world: int, args: argparse.Namespace, endpoint: str, token: str | None) -> None:
    """One rank: shard the model, restore, train to --steps, checkpoint every --every steps."""
    deterministic_setup()
    if world > 1:
        dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=world)
    manifest, spec = load_manifest(args.manifest), load_runspec(args.runspec)
    spec.check_replicas(world)
    assert manifest.tokenizer is not None, f"{args.manifest} names no tokenizer (the model needs its vocab size)"
    out = Path(args.out)
    torch.manual_seed(args.seed)  # the same initial parameters on every rank, before sharding
    model = TinyLM(manifest.tokenizer.vocab_size, manifest.packing.seq_len, args.d_model, args.layers, args.heads)
    shard_model(model, units=model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    micro_per_step = spec.global_batch // world // spec.micro_batch
    client = Client(endpoint, rank, world, token=token, credits=2 * micro_per_step, end_step=args.steps)
    # "fsdp" is not in CheckpointConfig.replicated: each rank writes its own shards (fsdp-r<rank>.pt)
    mgr = CheckpointManager(out / "ckpt", {"fsdp": FSDPState(model, opt), "data": client}, every=args.every,
                            keep_last=3, run_id=spec.run_id)
    events = open(out / "events.jsonl", "a", encoding="utf-8") if rank == 0 else None
    batches = open(out / f"batches-r{rank}.jsonl", "a", encoding="utf-8")

    def event(obj: dict[str, Any]) -> None:
        if events is not None:
            events.write(json.dumps({"pid": os.getpid(), **obj}) + "\n")
            events.flush()

    with client:
        start = mgr.restore()
        report = mgr.last_restore
        assert report is not None
        event({"event": "restore", "restored": report.restored, "step": report.step, "generation": report.generation})
        saved = report.step
        for step, micros in client.steps(start):
            n_tokens = global_count(sum(int((mb["labels"] != IGNORE).sum()) for mb in micros))
            for i, mb in enumerate(micros):
                model.set_requires_gradient_sync(i == len(micros) - 1)  # one reduce-scatter per step
                logits = model(mb["input_ids"].long(), mb["position_ids"].long())
                loss = F.cross_entropy(logits.flatten(0, 1), mb["labels"].long().flatten(), ignore_index=IGNORE,
                                       reduction="sum")
                (loss / n_tokens).backward()  # the global mean: gradients are summed over ranks
                batches.write(json.dumps({"step": step, "micro": int(mb["micro"]), "rows": row_digests(mb)}) + "\n")
            opt.step()
            opt.zero_grad(set_to_none=True)
            batches.flush()  # a kill -9 loses no line of a trained step
            done = mgr.maybe_save(step)
            if done is not None:
                saved = step
                event({"event": "checkpoint", "step": step, "name": done.name})
        if saved != args.steps - 1:
            event({"event": "checkpoint", "step": args.steps - 1, "name": mgr.save(args.steps - 1).name})
        mgr.close()
        full = FSDPState(model, full=True).state_dict()  # collective: every rank takes part in the gather
        if rank == 0:
            torch.save(full["model"], out / "params.pt")
        event({"event": "done", "step": args.steps - 1})
    batches.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace, endpoint: str, token: str) -> None:
    train(rank, world, args, endpoint, token)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.endpoint:  # one rank of a torchrun job
        train(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), args, args.endpoint, None)
        return 0
    if not args.cache:
        raise SystemExit("fsdp_train: without --endpoint, --cache is needed (the private daemon's node cache)")
    import torch.multiprocessing as mp

    from sluice.client.embedded import EmbeddedDaemon

    daemon = EmbeddedDaemon(args.manifest, args.runspec, cache_dir=args.cache, replicas=args.nproc,
                            extra_args=("--log-level", "warning"))
    rdzv = tempfile.mkdtemp(prefix="sluice-fsdp-")
    try:
        args.init = f"file://{rdzv}/rdzv"  # a fresh rendezvous file per start
        mp.start_processes(_spawned, args=(args.nproc, args, daemon.endpoint, daemon.token), nprocs=args.nproc,
                           start_method="spawn")
    finally:
        daemon.close()
        Path(rdzv, "rdzv").unlink(missing_ok=True)
        os.rmdir(rdzv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
