"""transformers.Trainer over a sluice client: rows, a collator, the packed-LM loss, a TrainerCallback.

    from sluice.integrations.hf import SluiceCallback, SluiceTrainer, last_checkpoint, trainer_kwargs

    args = TrainingArguments(out, max_steps=N, save_steps=E, ignore_data_skip=True,
                             remove_unused_columns=False, dataloader_num_workers=0,
                             per_device_train_batch_size=spec.micro_batch,
                             gradient_accumulation_steps=micro_per_step, ...)
    trainer = Trainer(model=model, args=args, callbacks=[SluiceCallback(client)],
                      **trainer_kwargs(client))     # train_dataset, data_collator
    # several ranks: SluiceTrainer(...) with the same arguments, each rank's client its own replica
    trainer.train(resume_from_checkpoint=last_checkpoint(out))   # None: a fresh start

One Trainer optimizer step is one sluice global step: Trainer global step g
(1-based) trains sluice step g - 1, from ``micro_per_step`` micro-batches of
``micro_batch`` rows each (one row per dataset item, so the Trainer's own
batching rebuilds the micro-batch; `collate` stacks the rows).

Data state with the Trainer's checkpoints: when the Trainer is about to save
checkpoint-g (``control.should_save`` after step g), `SluiceCallback` writes
the client's data state after sluice step g - 1 into that folder as
``sluice_data.json`` (JSON; temp file and rename), before the Trainer writes
its own files there. On ``train(resume_from_checkpoint=...)`` the Trainer
restores model, optimizer, scheduler, RNG and its global step g; the callback
(``on_train_begin``) reads ``sluice_data.json`` from checkpoint-g and RESTOREs
the daemon to it, so the first batch after the resume is step g's. A fresh
start RESTOREs the run's initial state (step 0).

What to set (checked at train begin, StateError naming the setting):
``per_device_train_batch_size x gradient_accumulation_steps x world size``
equal to the run spec's ``global_batch``, each rank its own replica (the
error names every factor and the run spec's numbers); ``ignore_data_skip=True`` (the Trainer would otherwise skip the batches it
already trained by drawing them again: the client's state already resumes
after them, so skipping would drop g steps of data); ``dataloader_num_workers=0``
(the daemon is the worker pool).

Several ranks (torchrun, or any launcher accelerate recognizes; CPU and
gloo tested): use `SluiceTrainer`, each rank with its own client (replica
r of N) and ``gradient_accumulation_steps = global_batch / N / micro_batch``.
The plain Trainer passes its DataLoader through ``accelerator.prepare``,
which with several processes either reads batches on rank 0 and sends them
to the others (``dispatch_batches``) or wraps the IterableDataset in
``IterableDatasetShard`` (each rank keeps 1/N of what it reads): neither
gives each rank its own replica's stream. `SluiceTrainer` overrides
``get_train_dataloader`` (the Trainer's documented hook) to return a plain
DataLoader over the rank's client, never prepared by accelerate; the model
is still wrapped in DDP and the Trainer moves each batch to the device. The
callback then works on every rank: on a save it gathers the ranks' data
states (`sluice.integrations.ddp.all_gather_json`, JSON, never pickled) and
the main process writes them merged (every replica's lanes) into
checkpoint-g; on a resume every rank fences its client with one shared
generation (`fence_replicas`) and RESTOREs from the merged state, of which
each client serves its own lanes.

The state written for checkpoint-g is taken from the client's history
(`state_dict_at(g - 1)`), not its current position: accelerate's dataloader
fetches one item ahead, so the client may already stand inside step g.

Labels: sluice's packer emits labels already shifted (label i is the token
after input i; -100 carries no loss), while a transformers causal LM shifts
its ``labels`` argument once more. `collate` therefore also passes them as
``shift_labels`` (transformers' convention for padding-free collators): the
model's loss uses them unshifted, and the Trainer counts the loss-bearing
tokens of the whole optimizer step from them (``num_items_in_batch``), so the
loss is the step's global token mean whatever the micro-batch split.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from sluice.errors import StateError
from sluice.integrations.torch_data import TRAIN_KEYS, SluiceIterable, stack_rows

STATE_FILE = "sluice_data.json"  # the data state's file inside a Trainer checkpoint folder


def collate(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The Trainer's data collator: stack rows into a micro-batch (int64).

    Returns input_ids, position_ids, labels and ``shift_labels`` (the same
    already-shifted labels: transformers' causal-LM loss then uses them as
    they are, and the Trainer counts the step's loss tokens from them).
    """
    batch = stack_rows(rows)
    out = {k: batch[k] for k in TRAIN_KEYS}
    out["shift_labels"] = out["labels"]
    return out


def trainer_kwargs(client: Any, *, keys: Sequence[str] = TRAIN_KEYS) -> dict[str, Any]:
    """``train_dataset`` and ``data_collator`` for `transformers.Trainer`.

    `keys`: the fields of each row item (at least TRAIN_KEYS; e.g. add "step"
    and "micro" to see them in a wrapping collator; `collate` drops them).
    """
    return {"train_dataset": SluiceIterable(client, keys=keys, rows=True), "data_collator": collate}


def write_state(folder: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write a data state as FOLDER/sluice_data.json (temp file, fsync, rename)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    tmp = folder / f".{STATE_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_state(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The data state in FOLDER/sluice_data.json; StateError naming the file when missing or unreadable."""
    path = Path(folder) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateError(f"{path}: no sluice data state in this Trainer checkpoint (was it saved with "
                         "SluiceCallback?); refusing to resume the model without its data position") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: unreadable sluice data state: {exc}") from exc
    if not isinstance(state, dict):
        raise StateError(f"{path}: the sluice data state is not a JSON object")
    return state


def last_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete Trainer checkpoint under FOLDER (checkpoint-N holding both the Trainer's
    trainer_state.json, written near the end of its save, and sluice_data.json); None if there is none.

    Unlike transformers' `get_last_checkpoint`, a folder cut short by a crash
    during its save is passed over instead of resumed from.
    """
    best: tuple[int, Path] | None = None
    root = Path(folder)
    if not root.is_dir():
        return None
    for path in root.iterdir():
        name, _, num = path.name.partition("-")
        if name != "checkpoint" or not num.isdigit():
            continue
        if (path / "trainer_state.json").is_file() and (path / STATE_FILE).is_file():
            if best is None or int(num) > best[0]:
                best = (int(num), path)
    return best[1] if best else None


def _world(args: Any) -> int:
    return int(getattr(args, "world_size", 1) or 1)


class SluiceTrainer(Trainer):  # type: ignore[misc]
    """A `transformers.Trainer` whose training DataLoader is the rank's own client stream (module docstring).

    Same arguments as the Trainer, with ``**trainer_kwargs(client)``; needed
    with several ranks, harmless with one. The DataLoader is not passed
    through ``accelerator.prepare``: accelerate would dispatch rank 0's batches
    or keep 1/N of each rank's rows (``IterableDatasetShard``).
    """

    def get_train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        """The rank's rows in micro-batches of ``per_device_train_batch_size`` (StateError for another dataset)."""
        if not isinstance(self.train_dataset, SluiceIterable):
            raise StateError(f"SluiceTrainer: train_dataset is a {type(self.train_dataset).__name__}, not a "
                             "SluiceIterable (pass **trainer_kwargs(client))")
        if self.args.dataloader_num_workers != 0:
            raise StateError(f"TrainingArguments.dataloader_num_workers is {self.args.dataloader_num_workers!r}; "
                             "sluice needs 0 (the loaderd daemon is the worker pool)")
        # a plain DataLoader: every rank reads its own replica; training_step moves batches to the device
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, collate_fn=self.data_collator,
                          num_workers=0)


class SluiceCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the data state into the Trainer's checkpoints and restores it on resume (module docstring).

    `checkpoint_dir`: where the Trainer's checkpoints live (default: the
    Trainer's ``output_dir``), for a ``resume_from_checkpoint`` elsewhere.
    With several ranks every rank must run it (its save and restore are
    collectives).
    """

    def __init__(self, client: Any, *, checkpoint_dir: str | os.PathLike[str] | None = None) -> None:
        self.client = client
        self.checkpoint_dir = checkpoint_dir
        self.restored_from: Path | None = None  # the checkpoint folder whose data state was loaded (None: fresh)
        self._saved_step = -1  # the Trainer global step whose data state was written last (every rank agrees)

    def _folder(self, args: Any, global_step: int) -> Path:
        return Path(self.checkpoint_dir or args.output_dir) / f"checkpoint-{global_step}"

    def _fence(self, args: Any) -> None:
        """With several ranks, one generation for every rank's RESTORE (else each would fence the others)."""
        if _world(args) > 1:
            from sluice.integrations.ddp import fence_replicas

            fence_replicas(self.client)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for name, want in (("ignore_data_skip", True), ("dataloader_num_workers", 0)):
            if getattr(args, name) != want:
                raise StateError(f"TrainingArguments.{name} is {getattr(args, name)!r}; sluice needs {want!r} "
                                 "(see sluice.integrations.hf)")
        loader = kwargs.get("train_dataloader")
        if _world(args) > 1 and loader is not None and type(loader) is not DataLoader:
            # e.g. accelerate's DataLoaderDispatcher: only rank 0's replica would be read (a plain Trainer)
            raise StateError(f"{_world(args)} ranks, and the train dataloader is "
                             f"{type(loader).__module__}.{type(loader).__name__}: "
                             "accelerate dispatches rank 0's batches or keeps 1/N of each rank's rows; use "
                             "sluice.integrations.hf.SluiceTrainer (each rank reads its own replica)")
        self._saved_step = state.global_step  # checkpoint-g of a resume exists already
        if state.global_step == 0:
            self._check_split(args)
            self._fence(args)
            self.client.reset()  # a fresh start: the run's initial state, step 0
            self.restored_from = None
            return
        folder = self._folder(args, state.global_step)
        data = read_state(folder)
        if data.get("step") != state.global_step - 1:
            raise StateError(f"{folder / STATE_FILE}: data state after step {data.get('step')!r}, but the Trainer "
                             f"resumes after global step {state.global_step} (sluice step {state.global_step - 1})")
        self._check_split(args)
        self._fence(args)
        self.client.reset(data)
        self.restored_from = folder

    def _check_split(self, args: Any) -> None:
        """StateError unless per_device_train_batch_size x gradient_accumulation_steps x world size is the run
        spec's global batch, each rank its own replica (`sluice.integrations.batchsplit`)."""
        from sluice.integrations.batchsplit import check_batch_split

        per_device, accumulate = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
        gpus = int(getattr(args, "n_gpu", 1) or 1)  # > 1: one process over several GPUs (torch DataParallel)
        batch = per_device * max(gpus, 1)  # the rows the Trainer draws per forward pass

        def fix(rows: int) -> str:
            if rows % batch == 0:
                return (f"set gradient_accumulation_steps = {rows // batch} (global_batch / replicas = {rows} "
                        f"sequences per rank and step, in batches of {batch})")
            return (f"make per_device_train_batch_size x gradient_accumulation_steps = {rows} (global_batch / "
                    f"replicas); batches of {batch} do not divide it")

        factors = [("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accumulate)]
        if gpus > 1:  # the Trainer batches per_device rows for each GPU
            factors.insert(1, ("n_gpu (DataParallel)", gpus))
        check_batch_split(self.client, "transformers.Trainer", factors, _world(args), fix)

    def _save(self, args: Any, state: Any) -> None:
        # the decision to save depends only on the global step, so every rank takes it together (a collective)
        if state.global_step < 1 or state.global_step == self._saved_step:
            return
        self._saved_step = state.global_step
        data = self.client.state_dict_at(state.global_step - 1)
        if _world(args) > 1:
            # the main process writes the checkpoint; it must hold every replica's lanes (each client resumes its own)
            from sluice.integrations.ddp import all_gather_json
            from sluice.trainer_hooks.state import merge_data_states

            data = merge_data_states(all_gather_json(data))
        if getattr(args, "should_save", True):
            write_state(self._folder(args, state.global_step), data)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:  # the Trainer saves checkpoint-g next: the data state goes in first
            self._save(args, state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save(args, state)  # a save the flow callback did not announce (e.g. trainer.save at the end)
