"""transformers.Trainer over a sluice client: rows, a collator, the packed-LM loss, a TrainerCallback.

    from sluice.integrations.hf import SluiceCallback, last_checkpoint, trainer_kwargs

    args = TrainingArguments(out, max_steps=N, save_steps=E, ignore_data_skip=True,
                             remove_unused_columns=False, dataloader_num_workers=0,
                             per_device_train_batch_size=spec.micro_batch,
                             gradient_accumulation_steps=micro_per_step, ...)
    trainer = Trainer(model=model, args=args, callbacks=[SluiceCallback(client)],
                      **trainer_kwargs(client))     # train_dataset, data_collator
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
``ignore_data_skip=True`` (the Trainer would otherwise skip the batches it
already trained by drawing them again: the client's state already resumes
after them, so skipping would drop g steps of data); ``dataloader_num_workers=0``
(the daemon is the worker pool). Single process only: with several ranks,
accelerate either dispatches rank 0's batches to every rank or shards the
IterableDataset (``IterableDatasetShard``: each rank keeps 1/N of what it
reads), and neither gives each rank its own replica's stream
(docs/integrations.md).

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
from transformers import TrainerCallback

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


class SluiceCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the data state into the Trainer's checkpoints and restores it on resume (module docstring).

    `checkpoint_dir`: where the Trainer's checkpoints live (default: the
    Trainer's ``output_dir``), for a ``resume_from_checkpoint`` elsewhere.
    """

    def __init__(self, client: Any, *, checkpoint_dir: str | os.PathLike[str] | None = None) -> None:
        self.client = client
        self.checkpoint_dir = checkpoint_dir
        self.restored_from: Path | None = None  # the checkpoint folder whose data state was loaded (None: fresh)

    def _folder(self, args: Any, global_step: int) -> Path:
        return Path(self.checkpoint_dir or args.output_dir) / f"checkpoint-{global_step}"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for name, want in (("ignore_data_skip", True), ("dataloader_num_workers", 0)):
            if getattr(args, name) != want:
                raise StateError(f"TrainingArguments.{name} is {getattr(args, name)!r}; sluice needs {want!r} "
                                 "(see sluice.integrations.hf)")
        if state.global_step == 0:
            self.client.reset()  # a fresh start: the run's initial state, step 0
            self.restored_from = None
            return
        folder = self._folder(args, state.global_step)
        data = read_state(folder)
        if data.get("step") != state.global_step - 1:
            raise StateError(f"{folder / STATE_FILE}: data state after step {data.get('step')!r}, but the Trainer "
                             f"resumes after global step {state.global_step} (sluice step {state.global_step - 1})")
        self.client.reset(data)
        self.restored_from = folder

    def _save(self, args: Any, state: Any) -> None:
        if state.global_step < 1:
            return
        folder = self._folder(args, state.global_step)
        if (folder / STATE_FILE).exists():
            return
        write_state(folder, self.client.state_dict_at(state.global_step - 1))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:  # the Trainer saves checkpoint-g next: the data state goes in first
            self._save(args, state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save(args, state)  # a save the flow callback did not announce (e.g. trainer.save at the end)
