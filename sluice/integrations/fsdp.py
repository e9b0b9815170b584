"""FSDP (FSDP2 `fully_shard`, CPU and gloo) with the determinism recipe, checkpointed with the data state.

    from sluice.integrations.ddp import deterministic_setup, global_count
    from sluice.integrations.fsdp import FSDPState, shard_model

    deterministic_setup()                                   # one intra-op thread, deterministic algorithms
    dist.init_process_group("gloo", ...)
    model = shard_model(TinyLM(...), units=model.blocks)    # fully_shard each block, then the root; grads SUMMED
    opt = torch.optim.AdamW(model.parameters(), ...)        # built after sharding: it holds the DTensor shards
    mgr = CheckpointManager(ckpt, {"fsdp": FSDPState(model, opt), "data": client}, every=4)
    start = mgr.restore()
    for step, micros in client.steps(start):
        n = global_count(sum(int((mb["labels"] != -100).sum()) for mb in micros))
        for i, mb in enumerate(micros):
            model.set_requires_gradient_sync(i == len(micros) - 1)   # one reduce-scatter per step
            (token_loss_sum(model, mb) / n).backward()       # the global mean, whatever R
        opt.step(); opt.zero_grad()
        mgr.maybe_save(step)

Determinism: FSDP2 reduce-scatters each unit's gradients in backward order,
which is fixed, and gloo sums each element over the ranks in a fixed order, so
for a fixed world size a run and its resumed twin compute the same bits.
`shard_model` sets the gradient divide factor to 1 (a SUM over ranks, not
FSDP's default mean): with the loss divided by the global loss-token count
the sum is the global mean's gradient for every R. Across a change of R the
sums run in another order: equal to rounding, not bitwise.

Checkpoints (`FSDPState`, a torch Stateful for `CheckpointManager`):

* ``full=False`` (default): each rank saves its own shards, the local part
  of every parameter and optimizer state tensor as plain tensors (nothing but
  tensors and plain containers, which restore reads without any unpickler),
  with its rank and the world size. CheckpointManager writes it per rank
  (``fsdp-r<rank>.pt``) as long as its name is not in
  ``CheckpointConfig.replicated`` (default ``("model", "optim")``: call it
  ``"fsdp"``). Restore needs the same world size: a shard saved by rank r of
  W is refused elsewhere (CheckpointMismatch naming both), since resharding
  would need DCP across ranks, which CheckpointManager does not do.
* ``full=True``: rank 0 gathers the full (unsharded) state dict, CPU-offloaded,
  and the manager must store it once (its name IN ``replicated``, e.g.
  ``"model"``); every rank reads it and keeps its own shards. It costs a gather
  per save and the whole model in rank 0's memory, and it restores on any
  world size (the data state's contract, `resume = "exact-elastic"`, decides
  whether a resize is allowed).

With one process and no process group, `shard_model` returns the model as it
is and `FSDPState` saves a plain model's state, so one script serves both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sluice.errors import CheckpointMismatch

SHARDED = "sluice.fsdp-sharded/1"  # the layout tag of a per-rank sharded state
FULL = "sluice.fsdp-full/1"  # the layout tag of a full (rank 0, unsharded) state


def _dist() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_model(model: nn.Module, *, units: Iterable[nn.Module] = (), mesh: Any = None,
                sum_gradients: bool = True) -> nn.Module:
    """`fully_shard` every module of `units` (e.g. the transformer blocks), then `model` itself; returns `model`.

    `mesh`: a 1-D CPU device mesh (default: every rank of the default group).
    `sum_gradients`: gradient divide factor 1, so the reduce-scatter SUMS over
    ranks (the recipe: divide the loss by the global loss-token count). Without
    a process group (one process) nothing is sharded and `model` is returned
    unchanged. Build the optimizer after this call (it must hold the shards).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if sum_gradients:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():  # each setter covers its own unit only, not the units inside it
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                # gloo has no PREMUL_SUM: a plain SUM, scaled apart (by 1.0, which changes no bit)
                module.set_force_sum_reduction_for_comms(True)
    return model


def _to_local(obj: Any) -> Any:
    """`obj` with every DTensor replaced by a compact copy of this rank's local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()  # clone: the local shard may be a view of a padded buffer
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


def _from_local(template: Any, saved: Any, where: str) -> Any:
    """`saved` (from `_to_local`) rebuilt in the shape of `template` (this rank's live state dict):
    each local shard becomes a DTensor with the template's mesh and placements.
    CheckpointMismatch naming the key when the structure or a shard's shape or dtype differs."""
    from torch.distributed.tensor import DTensor

    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            got = f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointMismatch(f"{where}: saved shard is {got}, this rank's shard is {tuple(local.shape)} "
                                     f"{local.dtype}")
        return DTensor.from_local(saved, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, dict):
        if not isinstance(saved, dict):
            raise CheckpointMismatch(f"{where}: saved {type(saved).__name__}, expected a dict")
        if set(saved) != set(template):
            missing, extra = sorted(set(template) - set(saved)), sorted(set(saved) - set(template))
            raise CheckpointMismatch(f"{where}: keys differ from this model's (missing {missing[:5]}, "
                                     f"unexpected {extra[:5]})")
        return {k: _from_local(template[k], v, f"{where}.{k}") for k, v in saved.items()}
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != template.shape:
            raise CheckpointMismatch(f"{where}: saved {saved!r:.60}, expected a tensor of shape "
                                     f"{tuple(template.shape)}")
    return saved


class FSDPState:
    """A torch Stateful over an FSDP2 model and its optimizer (see the module docstring for the two modes).

    `optimizer` may be None (model only). The optimizer's state is keyed by
    parameter name (torch.distributed.checkpoint.state_dict), and a fresh
    optimizer's state is created before a load, so nothing is silently skipped.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 full: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.full = full

    def _get(self, options: Any = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_sd, "optim": optim_sd}

    def _set(self, state: dict[str, Any], options: Any = None) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"], options=options)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)

    def state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's local shards and its layout. Full: the whole state on rank 0 ({} elsewhere)."""
        rank, world = _dist()
        if self.full:
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            state = self._get(StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank != 0:
                return {}
            return {"layout": {"kind": FULL, "world_size": world}, **state}
        return {"layout": {"kind": SHARDED, "world_size": world, "rank": rank}, **_to_local(self._get())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict()` of the same mode; CheckpointMismatch (naming what differs) when it does not fit."""
        rank, world = _dist()
        layout = state.get("layout") if isinstance(state, dict) else None
        kind = layout.get("kind") if isinstance(layout, dict) else None
        want = FULL if self.full else SHARDED
        if kind != want:
            hint = ""
            if self.full and not state:
                hint = (" (an empty state: the checkpoint stored it per rank; a full state must be stored once, "
                        "so its name must be in CheckpointConfig.replicated)")
            raise CheckpointMismatch(f"FSDPState(full={self.full}) on rank {rank}: checkpoint holds layout "
                                     f"{kind!r}, expected {want!r}{hint}")
        assert isinstance(layout, dict)
        body = {k: v for k, v in state.items() if k != "layout"}
        if self.full:
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            self._set(body, StateDictOptions(full_state_dict=True))
            return
        if layout.get("world_size") != world or layout.get("rank") != rank:
            raise CheckpointMismatch(
                f"FSDPState: the sharded state was saved by rank {layout.get('rank')} of {layout.get('world_size')}, "
                f"this is rank {rank} of {world}; sharded FSDP state restores only on the same ranks (a resize "
                f"needs FSDPState(full=True); a rank reading another's shard means the stateful's name is in "
                f"CheckpointConfig.replicated)")
        self._set(_from_local(self._get(), body, "FSDPState"))
