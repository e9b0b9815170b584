"""trainer_hooks: checkpoint model, optimizer, RNG and data state as one fenced commit.

Public API (imported lazily so `sluice` CLI start-up stays light)::

    from sluice.trainer_hooks import CheckpointManager, FencedStateful, ModelOptimState

    mgr = CheckpointManager("ckpt/", {"model": model, "optim": opt, "data": client}, every=500)
    start = mgr.restore()
    ...
    mgr.maybe_save(step)

See docs/checkpoints.md for the protocol, the on-disk layout and the CLI.
"""

from __future__ import annotations

from sluice._lazy import lazy_exports

_EXPORTS = {
    "CheckpointManager": "sluice.trainer_hooks.manager",
    "CheckpointConfig": "sluice.trainer_hooks.config",
    "SaveReport": "sluice.trainer_hooks.config",
    "RestoreReport": "sluice.trainer_hooks.config",
    "FencedStateful": "sluice.trainer_hooks.protocol",
    "Stateful": "sluice.trainer_hooks.protocol",
    "ModelOptimState": "sluice.trainer_hooks.torchio",
    "RunRecord": "sluice.trainer_hooks.runrecord",
    "collect_garbage": "sluice.trainer_hooks.retention",
    "young_interval": "sluice.trainer_hooks.cadence",
    "waste": "sluice.trainer_hooks.cadence",
    "run_drill": "sluice.trainer_hooks.drill",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
