"""`torch.utils.data` forms of a sluice client: an IterableDataset that checkpoints exactly.

    from torch.utils.data import DataLoader
    from sluice.integrations.torch_data import SluiceIterable

    data = SluiceIterable(client)                       # each item: one micro-batch dict
    loader = DataLoader(data, batch_size=None, num_workers=0)
    for mb in loader:
        ...
        if data.at_step_boundary and want_checkpoint:
            save({"data": data.state_dict(), ...})      # JSON; load_state_dict() resumes after it

The daemon is the worker pool (it reads, tokenizes and packs in its own
processes), so the DataLoader runs with ``num_workers=0``: a worker process
would hold a second copy of the client's socket and position, and the stream
would split. `__iter__` refuses to run inside a DataLoader worker.

Exactness: the state is the client's data state after the last *completed*
global step (sluice never replays to restore). `state_dict()` therefore
refuses to answer in the middle of a step (StateError naming the step and
micro-batch): checkpoint after the last micro-batch of a step, as an
optimizer step does anyway. `load_state_dict(state)` RESTOREs the daemon to it
(`client.reset(state)`), and the next item is micro-batch 0 of the following
step. The same object is a torch `Stateful`, so torchdata's
`StatefulDataLoader` (``num_workers=0``) stores and restores it with its own
`state_dict()`.

`rows=True` yields one packed row per item (a dict of 1-D tensors) instead of
one micro-batch, for frameworks that batch rows themselves (transformers'
Trainer with ``per_device_train_batch_size = micro_batch``); `stack_rows`
collates them back into the micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from sluice.errors import StateError

TRAIN_KEYS = ("input_ids", "labels", "position_ids")  # what a causal LM trains on (cu_seqlens stays out of rows)
STATE_KEY = "sluice_data"  # the data state's key in state_dict(): loaders nest it under their own keys


class SluiceIterable(IterableDataset):  # type: ignore[type-arg]
    """Micro-batches (or rows) of one replica from a `sluice.client.Client`, in stream order.

    `client` must be positioned already (``CheckpointManager.restore()``,
    ``client.reset(state)``, or ``load_state_dict`` here); iteration goes on
    from wherever it stands and ends at the client's ``end_step``. `keys`:
    the batch fields kept (None: every array field plus ``step`` and
    ``micro``). `rows`: one row per item (see the module docstring).
    """

    def __init__(self, client: Any, *, keys: Sequence[str] | None = None, rows: bool = False) -> None:
        super().__init__()
        self.client = client
        self.keys = tuple(keys) if keys is not None else None
        self.rows = rows
        self._open: tuple[int, int] | None = None  # (step, micro) yielded last while its step is incomplete

    @property
    def at_step_boundary(self) -> bool:
        """True when every micro-batch of the last step started has been yielded (a checkpoint is exact)."""
        return self._open is None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise StateError("SluiceIterable runs in a DataLoader worker: use num_workers=0 (the loaderd daemon "
                             "is the worker pool; a worker would split the client's stream)")
        for step, micros in self.client.steps(None):
            last = len(micros) - 1
            for mb in micros:
                micro = int(mb["micro"])
                item = self._select(mb)
                if not self.rows:
                    self._open = None if micro == last else (step, micro)
                    yield item
                    continue
                n = int(item["input_ids"].shape[0])
                for i in range(n):
                    self._open = None if (micro == last and i == n - 1) else (step, micro)
                    yield {k: (v[i] if isinstance(v, torch.Tensor) else v) for k, v in item.items()}

    def _select(self, mb: dict[str, Any]) -> dict[str, Any]:
        if self.keys is None:
            return mb
        missing = [k for k in self.keys if k not in mb]
        if missing:
            raise StateError(f"SluiceIterable: micro-batch of step {mb.get('step')} has no field(s) {missing} "
                             f"(it has {sorted(mb)})")
        return {k: mb[k] for k in self.keys}

    def state_dict(self) -> dict[str, Any]:
        """``{"sluice_data": the client's data state}`` (JSON); StateError in the middle of a step."""
        if self._open is not None:
            step, micro = self._open
            raise StateError(f"SluiceIterable: state asked for inside step {step} (after micro-batch {micro}); "
                             "the data state is exact only after a step's last micro-batch: checkpoint at an "
                             "optimizer-step boundary")
        return {STATE_KEY: self.client.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume after the data state in `state` (from `state_dict()`): RESTOREs the daemon now."""
        if not isinstance(state, dict) or STATE_KEY not in state:
            raise StateError(f"SluiceIterable.load_state_dict: expected a dict with key {STATE_KEY!r}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        self.client.reset(state[STATE_KEY])
        self._open = None


def stack_rows(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Collate rows from ``SluiceIterable(rows=True)`` into one batch (int64, as embedding layers want)."""
    if not rows:
        raise StateError("stack_rows: no rows to collate")
    return {k: torch.stack([r[k] for r in rows]).long() for k in rows[0] if isinstance(rows[0][k], torch.Tensor)}
