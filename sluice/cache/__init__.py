"""The node cache: content-addressed, digest-verified local copies of dataset objects.

`NodeCache(root, budget_bytes)` is the entry point; sluice/cache/store.py
lists the parts behind it, docs/cache.md the contract.
"""

from sluice._lazy import lazy_exports

_EXPORTS = {
    "CachedObject": "sluice.cache.objects",
    "CacheStats": "sluice.cache.objects",
    "NodeCache": "sluice.cache.store",
    "derived_digest": "sluice.cache.hashing",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
