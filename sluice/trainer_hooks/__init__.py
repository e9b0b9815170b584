"""trainer_hooks: checkpoint model, optimizer, RNG and data state as one fenced commit.

Public API (imported lazily so `sluice` CLI start-up stays light)::

    from sluice.trainer_hooks import CheckpointManager, CheckpointConfig, ModelOptimState

See docs/checkpoints.md for the protocol, the on-disk layout and the CLI.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "CheckpointManager": "sluice.trainer_hooks.manager",
    "CheckpointConfig": "sluice.trainer_hooks.manager",
    "SaveReport": "sluice.trainer_hooks.manager",
    "RestoreReport": "sluice.trainer_hooks.manager",
    "ModelOptimState": "sluice.trainer_hooks.manager",
    "RunRecord": "sluice.trainer_hooks.runrecord",
    "collect_garbage": "sluice.trainer_hooks.retention",
    "young_interval": "sluice.trainer_hooks.cadence",
    "waste": "sluice.trainer_hooks.cadence",
    "run_drill": "sluice.trainer_hooks.drill",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sluice.trainer_hooks' has no attribute {name!r}")
