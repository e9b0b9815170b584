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

Several data-parallel ranks (CPU, gloo), either form::

    python examples/hf_trainer.py ... --nproc 2       # this process is rank 0 and starts rank 1 (one process group)
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py ...

Each rank joins the process group, rank 0 starts the daemon with N
replicas and tells the others its endpoint and token file
(`all_gather_json`), and rank r trains replica r's micro-batches with
`SluiceTrainer` (the Trainer's DataLoader left unprepared by accelerate),
``global_batch / N / micro_batch`` of them per optimizer step. The loss is the step's global token mean: the Trainer
counts the loss tokens of every rank (``average_tokens_across_devices``)
and scales by N against DDP's gradient average. (Under torchrun a kill -9
of the launcher does not reach the ranks: torchrun starts each in a session
of its own; ``--nproc`` keeps them in the launcher's process group.)

Outputs under ``--out``: ``batches.jsonl`` (``batches-r<rank>.jsonl`` with
several ranks; one line per micro-batch the Trainer fetched: step, micro,
BLAKE3 of each row's input_ids/labels/position_ids as little-endian int32),
``events.jsonl`` (restore and save lines, with the rank) and, at the end,
``params.pt`` (the model's state dict, from rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any


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
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel ranks this process starts (default 1; under torchrun its WORLD_SIZE rules)")
    return p.parse_args(argv)


INIT_ENV = "SLUICE_EXAMPLE_INIT_METHOD"  # the --nproc launcher's rendezvous (a file:// URL) for its ranks


def start_ranks(nproc: int, argv: Sequence[str], out: str) -> list[subprocess.Popen[bytes]]:
    """--nproc N: make this process rank 0 of N and start ranks 1..N-1 (this script again, in this process
    group, so a kill of the group takes every rank); they meet through a file:// rendezvous in a fresh
    folder under `out` (a killed job leaves it there, not in the system's temp folder)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    rdzv = tempfile.mkdtemp(prefix=".rdzv-", dir=os.path.abspath(out))  # 0700, new for every start
    os.environ.update({"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0",
                       "OMP_NUM_THREADS": "1", INIT_ENV: f"file://{rdzv}/init"})
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                             env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(1, nproc)]


def join_ranks(procs: list[subprocess.Popen[bytes]], ok: bool, timeout_s: float = 120.0) -> int:
    """Wait for the ranks `start_ranks` started (bounded; stopped at once if this rank failed); the first
    non-zero exit status among them, else 0."""
    deadline = time.monotonic() + (timeout_s if ok else 0.0)
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"hf_trainer: rank process {p.pid} still running; stopping it", file=sys.stderr)
            p.kill()
            p.wait()
    shutil.rmtree(Path(os.environ[INIT_ENV][len("file://"):]).parent, ignore_errors=True)
    return next((p.returncode for p in procs if p.returncode != 0), 0)


def launch_if_asked(argv: Sequence[str]) -> list[subprocess.Popen[bytes]]:
    """--nproc N outside a launcher: start ranks 1..N-1 (this process becomes rank 0); [] otherwise."""
    args = parse_args(argv)
    return start_ranks(args.nproc, argv, args.out) if "WORLD_SIZE" not in os.environ and args.nproc > 1 else []


# Run as a script, the other ranks start here, before the heavy imports below, so that their imports
# (seconds each) overlap this process's instead of following them; main() called from Python starts them itself.
EARLY_RANKS = launch_if_asked(sys.argv[1:]) if __name__ == "__main__" else None

import blake3  # noqa: E402  (the heavy imports, after the early rank start)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from sluice.client import Client, embedded_client  # noqa: E402
from sluice.client.embedded import EmbeddedDaemon  # noqa: E402
from sluice.integrations.ddp import all_gather_json  # noqa: E402
from sluice.integrations.hf import (  # noqa: E402
    TRAIN_KEYS, SluiceCallback, SluiceTrainer, collate, last_checkpoint, trainer_kwargs,
)
from sluice.manifest.model import load_manifest  # noqa: E402
from sluice.runspec import load_runspec  # noqa: E402


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
            f.write(json.dumps({"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")), **obj}) + "\n")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write({"event": "restore", "global_step": state.global_step,
                    "from": str(self.sluice_cb.restored_from) if self.sluice_cb.restored_from else None})

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write({"event": "save", "global_step": state.global_step})


def rank_client(args: argparse.Namespace, rank: int, world: int, **client_kw: Any) -> tuple[Client, Any]:
    """Replica `rank`'s client of the daemon rank 0 starts (N replicas), and that daemon (None on other ranks)."""
    daemon = None
    if rank == 0:
        daemon = EmbeddedDaemon(args.manifest, args.runspec, cache_dir=args.cache, replicas=world,
                                extra_args=("--log-level", "warning"))
    where = [daemon.endpoint, str(Path(daemon.endpoint[len("ipc://"):]).parent / "token")] if daemon else None
    endpoint, token_file = all_gather_json(where)[0]  # the path of the token file (0600), not the token
    return Client(endpoint, rank, world, token=Path(token_file).read_text().strip(), **client_kw), daemon


def main(argv: Sequence[str] | None = None, ranks: list[subprocess.Popen[bytes]] | None = None) -> int:
    """Train (every start is a restart); `ranks`: the other ranks if already started (EARLY_RANKS)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if ranks is None:
        ranks = launch_if_asked(argv)
    ok = False
    try:
        run(args)
        ok = True
    finally:
        rc = join_ranks(ranks, ok) if ranks else 0
    return rc


def run(args: argparse.Namespace) -> None:
    """Train this rank (the only one, or one of WORLD_SIZE); rank 0 writes params.pt."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)  # one intra-op thread: a fixed reduction order, bitwise repeatable
    torch.use_deterministic_algorithms(True)
    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.runspec)
    if manifest.tokenizer is None:
        raise SystemExit(f"hf_trainer: manifest {args.manifest} names no tokenizer (the model needs its vocab size)")
    if spec.global_batch % (world * spec.micro_batch):
        raise SystemExit(f"hf_trainer: global_batch {spec.global_batch} of {args.runspec} is not a multiple of "
                         f"{world} ranks x micro_batch {spec.micro_batch}")
    micro_per_step = spec.global_batch // world // spec.micro_batch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"

    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=manifest.tokenizer.vocab_size, n_positions=manifest.packing.seq_len,
                        n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)

    client_kw: dict[str, Any] = dict(credits=2 * micro_per_step, end_step=args.steps)
    daemon = None
    if world == 1:
        client = embedded_client(args.manifest, args.runspec, cache_dir=args.cache,
                                 daemon_args=("--log-level", "warning"), **client_kw)
    else:  # join the ranks before the Trainer does (accelerate takes the group as it finds it)
        dist.init_process_group("gloo", init_method=os.environ.get(INIT_ENV, "env://"), rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
        client, daemon = rank_client(args, rank, world, **client_kw)
    try:
        with client:
            resume = train(args, spec, model, client, out, ckpt, micro_per_step, world, rank)
        if world > 1:
            dist.barrier()  # every rank is done with the daemon before rank 0 stops it
    finally:
        if daemon is not None:
            daemon.close()
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        torch.save(model.state_dict(), out / "params.pt")
        print(f"hf_trainer: trained steps 0..{args.steps - 1} on {world} rank(s)"
              + (f" (resumed from {resume})" if resume else ""))


def train(args: argparse.Namespace, spec: Any, model: Any, client: Client, out: Path, ckpt: Path,
          micro_per_step: int, world: int, rank: int) -> Path | None:
    """Train to --steps with the Trainer (SluiceTrainer with several ranks); the checkpoint resumed from."""
    kwargs = trainer_kwargs(client, keys=(*TRAIN_KEYS, "step", "micro"))
    log = open(out / ("batches.jsonl" if world == 1 else f"batches-r{rank}.jsonl"), "a", encoding="utf-8")

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
        average_tokens_across_devices=True,  # the step's loss tokens of every rank: the global token mean
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
    )
    torch.set_num_threads(1)  # again: accelerate may have set its own count while setting up the ranks
    sluice_cb = SluiceCallback(client)
    trainer_cls = Trainer if world == 1 else SluiceTrainer
    trainer = trainer_cls(model=model, args=targs, callbacks=[sluice_cb, Events(out / "events.jsonl", sluice_cb)],
                          **kwargs)
    resume = last_checkpoint(ckpt)  # the newest complete one (a crash may cut a save short)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    log.close()
    return resume


if __name__ == "__main__":
    raise SystemExit(main(ranks=EARLY_RANKS))
