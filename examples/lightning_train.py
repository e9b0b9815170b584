"""Train a tiny GPT-2 (built from a config, no downloads) with Lightning on sluice batches.

Prepare a corpus once (`python -m sluice.demo --out demo-out --no-train`), then::

    python examples/lightning_train.py --manifest demo-out/manifest.json --runspec demo-out/run.toml \\
        --cache demo-out/cache --out pl-run --steps 24 --every 4

Every start is a restart: the same command resumes from ``--out/ckpt/last.ckpt``
when it exists (``trainer.fit(ckpt_path=...)``); `SluiceDataModule` carries the
data state in Lightning's checkpoints and RESTOREs the embedded daemon to it,
so the steps after the resume see exactly the batches of an uninterrupted run.

With ``--devices N`` (N > 1) the same command trains N data-parallel ranks
(``strategy="ddp"``, gloo): this process starts the daemon (N replicas) and
rank 0, Lightning starts ranks 1..N-1 by running this script again, and they
find the daemon through SLUICE_EXAMPLE_ENDPOINT and SLUICE_EXAMPLE_TOKEN_FILE
(set here before the launch). Rank r's client is replica r.

Each batch is one global step (this replica's micro-batches); the loss is the
sum of token losses over the step's loss-bearing tokens of all ranks (the
global mean; times N, since DDP averages gradients over ranks). Outputs under
``--out``: ``batches.jsonl`` (``batches-r<rank>.jsonl`` with N > 1; one line
per trained micro-batch: step, micro, BLAKE3 of each row's
input_ids/labels/position_ids as little-endian int32, process id), and at the
end ``params.pt`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel

from sluice.client import Client, embedded_client
from sluice.client.embedded import EmbeddedDaemon
from sluice.integrations.ddp import global_count
from sluice.integrations.lightning import SluiceDataModule
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec

IGNORE = -100  # sluice's label of a position without loss
KEYS = ("input_ids", "labels", "position_ids")


class TinyGPT(pl.LightningModule):
    """GPT-2 from a config; one training_step per sluice global step (a list of micro-batches)."""

    def __init__(self, vocab: int, seq_len: int, lr: float, log_path: Path) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=32, n_layer=1, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)
        self.lr = lr
        self.log_path = log_path

    def training_step(self, micros: list[dict[str, Any]], batch_idx: int) -> torch.Tensor:
        n_tokens = sum(int((mb["labels"] != IGNORE).sum()) for mb in micros)
        world = self.trainer.world_size
        if world > 1:
            n_tokens = int(global_count(n_tokens))  # every rank's loss tokens
        total = torch.zeros(())
        with open(self.log_path, "a", encoding="utf-8") as log:
            for mb in micros:
                logits = self.model(input_ids=mb["input_ids"].long(), position_ids=mb["position_ids"].long()).logits
                # sluice's labels are already shifted: no shift here
                total = total + F.cross_entropy(logits.flatten(0, 1), mb["labels"].long().flatten(),
                                                ignore_index=IGNORE, reduction="sum")
                arrays = [mb[k].numpy().astype("<i4") for k in KEYS]
                rows = [blake3.blake3(b"".join(a[i].tobytes() for a in arrays)).hexdigest()
                        for i in range(arrays[0].shape[0])]
                log.write(json.dumps({"step": int(mb["step"]), "micro": int(mb["micro"]), "rows": rows,
                                      "pid": os.getpid()}) + "\n")
        if world > 1:  # DDP averages gradients over ranks: times N gives the global mean's gradient
            return total * world / max(n_tokens, 1)
        return total / max(n_tokens, 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="frozen manifest.json")
    p.add_argument("--runspec", required=True, help="run spec (TOML)")
    p.add_argument("--cache", required=True, help="node cache folder of the embedded daemon")
    p.add_argument("--out", required=True, help="run folder: ckpt/, batches.jsonl, params.pt")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (sluice steps 0..STEPS-1)")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--devices", type=int, default=1, help="data-parallel ranks (strategy='ddp' when > 1; default 1)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one intra-op thread: a fixed reduction order, bitwise repeatable
    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.runspec)
    if manifest.tokenizer is None:
        raise SystemExit(f"lightning_train: manifest {args.manifest} names no tokenizer")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"
    pl.seed_everything(args.seed, verbose=False)
    world = args.devices
    rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0  # Lightning's children carry LOCAL_RANK
    log_name = "batches.jsonl" if world == 1 else f"batches-r{rank}.jsonl"
    module = TinyGPT(manifest.tokenizer.vocab_size, manifest.packing.seq_len, args.lr, out / log_name)
    micro_per_step = spec.global_batch // world // spec.micro_batch
    client_kw: dict[str, Any] = dict(credits=2 * micro_per_step, end_step=args.steps)
    daemon = None
    if world == 1:
        client = embedded_client(args.manifest, args.runspec, cache_dir=args.cache,
                                 daemon_args=("--log-level", "warning"), **client_kw)
    else:
        if "SLUICE_EXAMPLE_ENDPOINT" not in os.environ:  # the launching process: start the daemon for all ranks
            daemon = EmbeddedDaemon(args.manifest, args.runspec, cache_dir=args.cache, replicas=world,
                                    extra_args=("--log-level", "warning"))
            os.environ["SLUICE_EXAMPLE_ENDPOINT"] = daemon.endpoint
            os.environ["SLUICE_EXAMPLE_TOKEN_FILE"] = str(Path(daemon.endpoint[len("ipc://"):]).parent / "token")
        token = Path(os.environ["SLUICE_EXAMPLE_TOKEN_FILE"]).read_text().strip()
        client = Client(os.environ["SLUICE_EXAMPLE_ENDPOINT"], rank, world, token=token, **client_kw)
    with client:
        trainer = pl.Trainer(
            max_steps=args.steps, accelerator="cpu", devices=world, deterministic=True, logger=False,
            strategy="ddp" if world > 1 else "auto",
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=args.every,
                                       save_top_k=-1, save_last=True)],
        )
        last = ckpt / "last.ckpt"
        resume = str(last) if last.exists() else None  # every start is a restart
        try:
            trainer.fit(module, datamodule=SluiceDataModule(client), ckpt_path=resume)
        finally:
            if daemon is not None:
                daemon.close()
        if trainer.global_rank == 0:
            torch.save(module.model.state_dict(), out / "params.pt")
    print(f"lightning_train: trained to step {args.steps - 1}" + (f" (resumed from {resume})" if resume else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
