"""Train a small causal transformer LM on loaderd batches, with fenced checkpoints.

A complete training script to copy: a GPT-style model in plain torch, batches
from `sluice.client.Client`, and `sluice.trainer_hooks.CheckpointManager`
committing model, optimizer, RNG and data state together. It runs

* single-process, with a private daemon started for it (embedded mode)::

      python examples/train_lm.py --manifest manifest.json --runspec run.toml \\
          --cache cache --ckpt ckpt --out run-out --steps 24 --every 4

* as R data-parallel replicas (torchrun, gloo), one loaderd per node::

      loaderd manifest.json run.toml --cache cache --replicas 2 --endpoint ipc:///tmp/sluice/l.sock &
      torchrun --standalone --nproc-per-node 2 examples/train_lm.py --manifest manifest.json \\
          --runspec run.toml --endpoint ipc:///tmp/sluice/l.sock --ckpt ckpt --out run-out --steps 24

Rank r is replica r of R = WORLD_SIZE. The data wiring is five lines::

    client = Client(endpoint, rank, world)          # run and dataset IDs read from the daemon
    mgr = CheckpointManager(ckpt, {"model": model, "optim": opt, "data": client}, every=4)
    start = mgr.restore()
    for step, micros in client.steps(start):        # this replica's micro-batches of one global step
        ...; mgr.maybe_save(step)

A (re)start always calls `restore()`: it takes a new fencing generation, loads
the newest checkpoint that verifies (or starts fresh) and fences and resets
each rank's client with it (RESTORE to the checkpoint's lane states, or to the
state before step 0), so training resumes at the step after the checkpoint
with exactly the batches an uninterrupted run would have seen. With
``resume = "exact-elastic"`` in the run spec, R may change between restarts (it
must divide the lane count): the data state of every lane is in the checkpoint
(one JSON shard per rank, merged on a resized restore).

Determinism: one intra-op thread, `torch.use_deterministic_algorithms(True)`,
the same seed on every rank, gradients summed with one all-reduce of a
flattened buffer, and the loss normalised by the global count of loss-bearing
tokens (all-reduced as an integer), so a step computes the same mathematical
update for every R; bitwise equality holds across restarts for a fixed R.

Outputs under ``--out``: ``steps-r<rank>.jsonl`` (one line per trained step:
step, generation, global loss as ``float.hex``, the BLAKE3 of each row this
rank trained on; plus event lines for restore/checkpoint/done) and, when the
last step is done, ``params-r<rank>.pt`` (the model's state dict).

Fault injection for the end-to-end test (never set in a real run):
``SLUICE_FAULT_PAUSE_PUBLISH=STEP:PATH`` makes rank 0 stop inside the save of
STEP after every shard and the checkpoint manifest are staged and before the
publish, write PATH, and sleep until it is killed.
``SLUICE_FAULT_PAUSE_AFTER_STEP=STEP:DIR`` makes every rank, once it logged
STEP, write DIR/paused-r<rank> and wait (at most 300 s) for DIR/go: the test
then knows which batches each rank holds when it kills the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sluice.client import Client, embedded_client
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec
from sluice.trainer_hooks import CheckpointManager

IGNORE = -100  # label of a position that carries no loss (sluice's packer convention)


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention within a document, then an MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style causal LM; positions restart at every document boundary of a packed row."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for m in self.modules():  # GPT-2's initialisation: small weights keep the first logits near uniform
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # A token attends to earlier tokens of its own document only: a document
        # starts where position_ids is 0 (the packer resets them there).
        doc = (position_ids == 0).cumsum(dim=1)
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


# ----------------------------------------------------------------------------- data state
# ----------------------------------------------------------------------------- helpers
def row_digests(mb: dict[str, Any]) -> list[str]:
    """BLAKE3 of each row's (input_ids, labels, position_ids) as little-endian int32.

    Rows, not micro-batches, so the global batch of a step (the rows of
    replicas 0..R-1 in order) has the same digests for every R.
    """
    arrays = [mb[k].numpy().astype("<i4", copy=False) for k in ("input_ids", "labels", "position_ids")]
    return [blake3.blake3(b"".join(a[i].tobytes() for a in arrays)).hexdigest() for i in range(arrays[0].shape[0])]


def all_reduce_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_grads(model: nn.Module, world: int) -> None:
    """Sum gradients over replicas in one flat buffer (fixed order, deterministic)."""
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@contextlib.contextmanager
def _fault_pause_before_publish(mgr: CheckpointManager, spec: str) -> Iterator[None]:
    """SLUICE_FAULT_PAUSE_PUBLISH=STEP:PATH (tests only): hang inside the publish of STEP."""
    step_text, _, marker = spec.partition(":")
    real = mgr.record.fenced

    @contextlib.contextmanager
    def fenced(generation: int, what: str = "publish") -> Iterator[None]:
        m = re.fullmatch(r"publish of step (\d+)", what)
        if m and int(m.group(1)) == int(step_text):
            Path(marker).write_text(json.dumps({"step": int(step_text), "generation": generation, "pid": os.getpid()}))
            while True:  # shards and manifest are staged, nothing is published: wait for kill -9
                time.sleep(1)
        with real(generation, what=what):
            yield

    mgr.record.fenced = fenced  # type: ignore[method-assign]
    try:
        yield
    finally:
        mgr.record.fenced = real  # type: ignore[method-assign]


def _fault_pause_after_step(spec: str, step: int, rank: int) -> None:
    """SLUICE_FAULT_PAUSE_AFTER_STEP=STEP:DIR (tests only): after STEP, wait for DIR/go."""
    step_text, _, folder = spec.partition(":")
    if step != int(step_text):
        return
    Path(folder, f"paused-r{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 300
    while not Path(folder, "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"train_lm: paused after step {step}, {folder}/go did not appear within 300 s")
        time.sleep(0.02)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", required=True, help="frozen manifest.json")
    p.add_argument("--runspec", required=True, help="run spec (TOML)")
    p.add_argument("--endpoint", default=None, help="loaderd endpoint; default: start an embedded daemon")
    p.add_argument("--cache", default=None, help="node cache folder (embedded daemon)")
    p.add_argument("--daemon-state", default=None, help="embedded daemon's fencing folder (default CACHE/loaderd-state)")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (shared by all ranks)")
    p.add_argument("--out", required=True, help="folder for steps-r<rank>.jsonl and params-r<rank>.pt")
    p.add_argument("--steps", type=int, required=True, help="train steps 0..STEPS-1")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--stop-after", type=int, default=None, help="exit after this step (a planned stop, e.g. to resize)")
    p.add_argument("--init", default="env://", help="torch.distributed init method (default env://, as torchrun sets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--client-timeout", type=float, default=2.0,
                   help="seconds of daemon silence before the client probes for a restarted daemon")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)  # one intra-op thread: a fixed reduction order
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    if world > 1:
        dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=world)
    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.runspec)
    spec.check_replicas(world)
    if manifest.tokenizer is None:
        raise SystemExit(f"train_lm: manifest {args.manifest} names no tokenizer (the model needs its vocab size)")
    micro_per_step = spec.global_batch // world // spec.micro_batch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"steps-r{rank}.jsonl", "a", encoding="utf-8")

    def record(obj: dict[str, Any]) -> None:
        log.write(json.dumps({"rank": rank, "replicas": world, "t": round(time.time(), 3), **obj}) + "\n")
        log.flush()  # a kill -9 of this process loses nothing written so far

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    torch.manual_seed(args.seed)
    model = TinyLM(manifest.tokenizer.vocab_size, manifest.packing.seq_len, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    client_kw = dict(credits=2 * micro_per_step, timeout_s=args.client_timeout, end_step=args.steps)
    if args.endpoint:
        client: Client = Client(args.endpoint, rank, world, **client_kw)
    else:
        if world > 1 or not args.cache:
            raise SystemExit("train_lm: embedded mode (no --endpoint) is single-process and needs --cache")
        extra = ("--log-level", "warning", *(("--state-dir", args.daemon_state) if args.daemon_state else ()))
        client = embedded_client(args.manifest, args.runspec, cache_dir=args.cache, daemon_args=extra, **client_kw)
    mgr = CheckpointManager(args.ckpt, {"model": model, "optim": opt, "data": client}, every=args.every,
                            keep_last=3, run_id=spec.run_id)
    fault = os.environ.get("SLUICE_FAULT_PAUSE_PUBLISH")
    pause = os.environ.get("SLUICE_FAULT_PAUSE_AFTER_STEP")
    with client, (_fault_pause_before_publish(mgr, fault) if fault and rank == 0 else contextlib.nullcontext()):
        # The fencing token of this incarnation: older trainers' requests and
        # checkpoints are refused from now on.
        start = mgr.restore()
        report = mgr.last_restore
        assert report is not None
        record({"event": "restore", "restored": report.restored, "step": report.step,
                "generation": report.generation})
        say(f"[train] rank 0 of {world}: generation {report.generation}, "
            + (f"restored {report.restored} -> resume at step {start}" if report.restored else "fresh start at step 0"))
        last = args.steps - 1 if args.stop_after is None else min(args.stop_after, args.steps - 1)
        saved = report.step
        for step, micros in client.steps(start):
            if step > last:
                break
            labels = [mb["labels"].long() for mb in micros]
            n_tokens = all_reduce_sum(torch.tensor(sum(int((lab != IGNORE).sum()) for lab in labels)), world)
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for mb, lab in zip(micros, labels):
                logits = model(mb["input_ids"].long(), mb["position_ids"].long())
                loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
                (loss / n_tokens).backward()  # the global mean: the same update for every R
                loss_sum += loss.detach().double()
            all_reduce_grads(model, world)
            opt.step()
            mean = float(all_reduce_sum(loss_sum, world) / n_tokens)
            rows = [d for mb in micros for d in row_digests(mb)]
            record({"step": step, "generation": mgr.generation, "loss": mean.hex(), "tokens": int(n_tokens),
                    "reconnects": client.reconnects, "rows": rows})
            if pause:
                _fault_pause_after_step(pause, step, rank)
            say(f"[train] step {step:3d}  loss {mean:.4f}  rows {len(rows) * world}  "
                f"batch {blake3.blake3(''.join(rows).encode()).hexdigest()[:12]}"
                + (" (replica 0's rows)" if world > 1 else ""))
            saved_now = mgr.maybe_save(step)
            if saved_now is not None:
                saved = step
                record({"event": "checkpoint", "step": step, "generation": saved_now.generation,
                        "name": saved_now.name})
                say(f"[ckpt]  step {step:3d}  published {saved_now.name} ({saved_now.bytes} bytes, "
                    f"{saved_now.exposed_pause_s * 1000:.0f} ms); COMMIT sent to loaderd")
        if last == args.steps - 1 and last >= 0 and saved != last:
            final = mgr.save(last)  # the end of the run is always checkpointed
            record({"event": "checkpoint", "step": last, "generation": final.generation, "name": final.name})
            say(f"[ckpt]  step {last:3d}  published {final.name} (end of run)")
        mgr.close()
        if last == args.steps - 1:
            torch.save(model.state_dict(), out / f"params-r{rank}.pt")
        record({"event": "done", "step": last})
    log.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from sluice.errors import SluiceError

    try:
        code = main()
    except SluiceError as exc:  # bad input, no daemon at --endpoint, a fenced rank: one line, no traceback
        print(f"train_lm: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    raise SystemExit(code)
