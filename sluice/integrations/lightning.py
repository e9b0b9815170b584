"""A Lightning DataModule over a sluice client; the data state rides in Lightning's checkpoints.

    from sluice.integrations.lightning import SluiceDataModule

    dm = SluiceDataModule(client)            # each batch: one global step (this replica's micro-batches)
    trainer = L.Trainer(max_steps=N, callbacks=[ModelCheckpoint(every_n_train_steps=E, save_last=True)])
    trainer.fit(module, datamodule=dm, ckpt_path="last" or None)

Each batch is one sluice global step as a list of micro-batch dicts, so
Lightning's global step g (optimizer steps done) is sluice step g - 1's end
and ``accumulate_grad_batches`` stays 1: the LightningModule's
``training_step`` loops over the micro-batches (e.g. summing token losses
over the step's loss-token count for the global mean).

Lightning stores ``state_dict()`` under the DataModule's class name in every
checkpoint: the client's data state after sluice step g - 1, taken from the
client's history (`state_dict_at`), because Lightning's fetcher prefetches one
batch, so the client may already stand in step g. On ``fit(ckpt_path=...)``
Lightning calls ``load_state_dict`` before it builds the dataloader, which
RESTOREs the daemon; without a checkpoint, ``train_dataloader`` RESTOREs the
run's initial state (step 0). The DataLoader runs with ``num_workers=0``: the
daemon is the worker pool.

Several ranks (``strategy="ddp"``): each rank's client is its own replica.
``train_dataloader`` checks, before the first step, that the Trainer's world
size is the clients' ``replicas`` (StateError naming micro batch,
micro-batches per step, accumulation, world size and the run spec's global
batch): a single process reading replica 0 of 2 would train half of every
global step.
Lightning writes rank 0's checkpoint only and loads it on every rank, so
``state_dict()`` gathers the ranks' data states and stores them merged (every
replica's lanes), and every rank fences its client with one shared generation
before a RESTORE (`sluice.integrations.ddp.fence_replicas`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sluice.errors import StateError
from sluice.integrations.torch_data import STATE_KEY


class _Steps(IterableDataset):  # type: ignore[type-arg]
    """Whole global steps (lists of micro-batch dicts) from the client, from wherever it stands."""

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if get_worker_info() is not None:
            raise StateError("SluiceDataModule's dataloader runs in a worker: use num_workers=0 (the loaderd "
                             "daemon is the worker pool)")
        for _step, micros in self.client.steps(None):
            yield micros


class SluiceDataModule(pl.LightningDataModule):
    """Batches of one replica from `client`; its data state in Lightning checkpoints (module docstring)."""

    def __init__(self, client: Any) -> None:
        super().__init__()
        self.client = client
        self.restored_step: int | None = None  # the sluice step whose state a checkpoint restored

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        trainer = getattr(self, "trainer", None)
        accumulate = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
        if accumulate != 1:
            # a batch is a whole global step already; accumulating would map global steps to sluice steps wrongly
            raise StateError(f"Trainer(accumulate_grad_batches={accumulate}): SluiceDataModule needs 1 (each batch "
                             "is one whole global step; loop over its micro-batches in training_step)")
        self._check_split(trainer, accumulate)
        if self.restored_step is None:
            self._fence()
            self.client.reset()  # no checkpoint was loaded: a fresh start at step 0
        return DataLoader(_Steps(self.client), batch_size=None, num_workers=0)

    def _check_split(self, trainer: Any, accumulate: int) -> None:
        """StateError unless the Trainer's world size is the client's replicas (x peers): each batch is one
        replica's share of a global step, so only then does one optimizer step train the global batch."""
        from sluice.integrations.batchsplit import check_batch_split

        split = self.client.batch_split()
        per_rank = (("micro_batch", split["micro_batch"]), ("micro-batches per batch", split["micro_per_step"]),
                    ("accumulate_grad_batches", accumulate))
        world = int(trainer.world_size) if trainer is not None else 1
        check_batch_split(self.client, "Lightning", per_rank, world,
                          lambda rows: f"each batch must be one replica's share of a step ({rows} sequences)")

    def _fence(self) -> None:
        """With several ranks, one generation for every rank's RESTORE (else each would fence the others)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            from sluice.integrations.ddp import fence_replicas

            fence_replicas(self.client)

    def state_dict(self) -> dict[str, Any]:
        """``{"sluice_data": the data state after the trainer's last optimizer step}``; {} before the first.

        With several ranks (``strategy="ddp"``), the ranks' states merged into one holding every replica's
        lanes (a collective: Lightning calls this on every rank when it saves).
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.global_step < 1:
            return {}
        state = self.client.state_dict_at(trainer.global_step - 1)
        if trainer.world_size > 1:
            # Lightning writes rank 0's checkpoint only, and every rank loads it: it must hold every
            # replica's lanes (each client then serves its own). Every rank calls state_dict() on a save.
            from sluice.integrations.ddp import all_gather_json
            from sluice.trainer_hooks.state import merge_data_states

            state = merge_data_states(all_gather_json(state))
        return {STATE_KEY: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """RESTORE the daemon to the checkpoint's data state (StateError if the checkpoint lacks one)."""
        if STATE_KEY not in state_dict:
            raise StateError(f"Lightning checkpoint: the {type(self).__name__} entry has no {STATE_KEY!r} (saved "
                             "before the first optimizer step, or not by sluice); refusing to resume without the "
                             "data position")
        self._fence()
        self.client.reset(state_dict[STATE_KEY])
        self.restored_step = int(state_dict[STATE_KEY]["step"])
