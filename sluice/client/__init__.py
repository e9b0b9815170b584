"""The training-side client of loaderd: `Client` (iterator, Stateful) and embedded mode.

Importing `Client` pulls in only pyzmq, numpy and sluice's wire format and
errors: no torch (imported lazily on the first batch), pyarrow or tokenizers.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names, imported on first use (PEP 562) so that `sluice` CLI start-up
# (which imports every component's cli module) stays light.
_EXPORTS = {
    "CheckpointedData": "sluice.client.checkpoint",
    "Client": "sluice.client.iterator",
    "DaemonError": "sluice.client.iterator",
    "DaemonUnavailable": "sluice.client.iterator",
    "EmbeddedDaemon": "sluice.client.embedded",
    "embedded_client": "sluice.client.embedded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
