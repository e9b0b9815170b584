"""The node cache: content-addressed, digest-verified local copies of dataset objects.

`NodeCache(root, budget_bytes)` is the entry point; see sluice/cache/store.py
and docs/cache.md.
"""

from sluice.cache.store import CachedObject, CacheStats, NodeCache, derived_digest

__all__ = ["CachedObject", "CacheStats", "NodeCache", "derived_digest"]
