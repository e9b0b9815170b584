"""Tensor-only collectives between the ranks of one checkpoint (nothing is pickled).

Decisions that must be the same on every rank (the generation, the checkpoint
to restore, whether a save happens) are made on rank 0 and broadcast as one
int64; "did every rank succeed" is an all-reduce of 0/1 with MIN. With no
process group (one process) every operation is the identity.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from sluice.errors import CheckpointError

FAILED = -2  # the value broadcast when rank 0 raised


class Collective:
    """The ranks of a torch.distributed group, or one process (group None)."""

    def __init__(self, group: Any | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world, self._src = 0, 1, 0
        else:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            self._src = dist.get_global_rank(group, 0)

    @classmethod
    def detect(cls, process_group: Any | None) -> Collective:
        """The given group, else the default group if torch.distributed runs with > 1 rank."""
        if process_group is not None:
            return cls(process_group)
        dist = sys.modules.get("torch.distributed")  # never import torch.distributed just to look
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.group.WORLD)
        return cls(None)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank."""
        if self.world == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=self._src, group=self.group)
        return int(t.item())

    def agree_ok(self, ok: bool) -> bool:
        """True iff `ok` on every rank."""
        if self.world == 1:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def shared(self, fn: Callable[[], int], what: str, where: str) -> int:
        """Run `fn` on rank 0 and broadcast its integer result; an error on rank 0 is raised on every rank
        (as itself on rank 0, as a CheckpointError naming `what` elsewhere)."""
        value, error = FAILED, None
        if self.rank == 0:
            try:
                value = int(fn())
            except BaseException as exc:
                error = exc
        value = self.broadcast_int(value)
        if error is not None:
            raise error
        if value == FAILED:
            raise CheckpointError(f"checkpoint folder {where}: rank 0 failed to {what} (see its error)")
        return value

    def all_or_raise(self, error: BaseException | None, what: str) -> None:
        """Raise `error` here, or a CheckpointError if another rank failed: every rank raises or none does."""
        ok = self.agree_ok(error is None)
        if error is not None:
            raise error
        if not ok:
            raise CheckpointError(f"another rank failed to {what} (see its error)")
