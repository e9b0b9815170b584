"""The node cache: content-addressed, digest-verified local copies of dataset objects.

`NodeCache(root, budget_bytes)` is the entry point; see sluice/cache/store.py
and docs/cache.md.
"""

from sluice._lazy import lazy_exports

_EXPORTS = {
    "CachedObject": "sluice.cache.store",
    "CacheStats": "sluice.cache.store",
    "NodeCache": "sluice.cache.store",
    "derived_digest": "sluice.cache.store",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
