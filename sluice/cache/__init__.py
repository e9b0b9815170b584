"""The node cache: content-addressed, digest-verified local copies of dataset objects.

`NodeCache(root, budget_bytes)` is the entry point; see sluice/cache/store.py
and docs/cache.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names, imported on first use (PEP 562) so that `sluice` CLI start-up
# (which imports every component's cli module) stays light.
_EXPORTS = {
    "CachedObject": "sluice.cache.store",
    "CacheStats": "sluice.cache.store",
    "NodeCache": "sluice.cache.store",
    "derived_digest": "sluice.cache.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
