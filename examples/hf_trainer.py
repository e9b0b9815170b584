"""Train a tiny GPT-2 (built from a config, no downloads) with transformers.Trainer on sluice batches.

Prepare a corpus once (`python -m sluice.demo --out demo-out --no-train` writes
manifest.json, run.toml and cache/), then::

    python examples/hf_trainer.py --manifest demo-out/manifest.json --runspec demo-out/run.toml \\
        --cache demo-out/cache --out hf-run --steps 24 --every 4

Every start is a restart: the same command resumes from the newest complete
checkpoint under ``--out/ckpt`` (the Trainer's ``resume_from_checkpoint``),
and `SluiceCallback` RESTOREs the embedded daemon to the data state saved in
that checkpoint, so the steps after the resume see exactly the batches an
uninterrupted run sees. The data wiring::

    client = embedded_client(manifest, runspec, cache_dir=cache, end_step=steps)
    args = TrainingArguments(..., ignore_data_skip=True, dataloader_num_workers=0,
                             per_device_train_batch_size=spec.micro_batch,
                             gradient_accumulation_steps=micro_per_step)
    trainer = Trainer(model=model, args=args, callbacks=[SluiceCallback(client)], **trainer_kwargs(client))
    trainer.train(resume_from_checkpoint=last_checkpoint(ckpt))

Outputs under ``--out``: ``batches.jsonl`` (one line per micro-batch the
Trainer fetched: step, micro, BLAKE3 of each row's input_ids/labels/
position_ids as little-endian int32), ``events.jsonl`` (restore and save
lines) and, at the end, ``params.pt`` (the model's state dict).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from sluice.client import embedded_client
from sluice.integrations.hf import TRAIN_KEYS, SluiceCallback, collate, last_checkpoint, trainer_kwargs
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec


def row_digests(batch: dict[str, torch.Tensor]) -> list[str]:
    """BLAKE3 of each row's (input_ids, labels, position_ids) as little-endian int32."""
    arrays = [batch[k].numpy().astype("<i4") for k in TRAIN_KEYS]
    return [blake3.blake3(b"".join(a[i].tobytes() for a in arrays)).hexdigest() for i in range(arrays[0].shape[0])]


class Events(TrainerCallback):  # type: ignore[misc]
    """Appends restore/save lines to events.jsonl (flushed: a kill -9 loses nothing written)."""

    def __init__(self, path: Path, sluice_cb: SluiceCallback) -> None:
        self.path, self.sluice_cb = path, sluice_cb

    def write(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), **obj}) + "\n")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write({"event": "restore", "global_step": state.global_step,
                    "from": str(self.sluice_cb.restored_from) if self.sluice_cb.restored_from else None})

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write({"event": "save", "global_step": state.global_step})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="frozen manifest.json")
    p.add_argument("--runspec", required=True, help="run spec (TOML)")
    p.add_argument("--cache", required=True, help="node cache folder of the embedded daemon")
    p.add_argument("--out", required=True, help="run folder: ckpt/, batches.jsonl, events.jsonl, params.pt")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (sluice steps 0..STEPS-1)")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one intra-op thread: a fixed reduction order, bitwise repeatable
    torch.use_deterministic_algorithms(True)
    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.runspec)
    if manifest.tokenizer is None:
        raise SystemExit(f"hf_trainer: manifest {args.manifest} names no tokenizer (the model needs its vocab size)")
    micro_per_step = spec.global_batch // spec.micro_batch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"

    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=manifest.tokenizer.vocab_size, n_positions=manifest.packing.seq_len,
                        n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)

    client = embedded_client(args.manifest, args.runspec, cache_dir=args.cache, credits=2 * micro_per_step,
                             end_step=args.steps, daemon_args=("--log-level", "warning"))
    with client:
        kwargs = trainer_kwargs(client, keys=(*TRAIN_KEYS, "step", "micro"))
        log = open(out / "batches.jsonl", "a", encoding="utf-8")

        def logged_collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
            batch = collate(rows)
            log.write(json.dumps({"step": int(rows[0]["step"]), "micro": int(rows[0]["micro"]),
                                  "rows": row_digests(batch)}) + "\n")
            log.flush()
            return batch

        kwargs["data_collator"] = logged_collate
        targs = TrainingArguments(
            output_dir=str(ckpt), max_steps=args.steps, save_strategy="steps", save_steps=args.every,
            per_device_train_batch_size=spec.micro_batch, gradient_accumulation_steps=micro_per_step,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.01, seed=args.seed,
            ignore_data_skip=True, dataloader_num_workers=0, remove_unused_columns=False,
            logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        )
        sluice_cb = SluiceCallback(client)
        trainer = Trainer(model=model, args=targs, callbacks=[sluice_cb, Events(out / "events.jsonl", sluice_cb)],
                          **kwargs)
        resume = last_checkpoint(ckpt)  # the newest complete one (a crash may cut a save short)
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        log.close()
        torch.save(model.state_dict(), out / "params.pt")
    print(f"hf_trainer: trained steps 0..{args.steps - 1}" + (f" (resumed from {resume})" if resume else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
