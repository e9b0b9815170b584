"""`sorted_unique`: numpy's `np.unique(a)` for integer arrays, without importing `numpy.ma`.

numpy 2's `np.unique` without `return_index`/`return_inverse`/`return_counts`
asks `np.ma.is_masked`, which imports `numpy.ma` the first time (10-50 ms,
most of it `inspect.signature` over its functions) on whichever thread gets
there first: in the daemon, the producer thread that plans the first step. The
daemon never uses masked arrays, so its serving path calls this instead.
"""

from __future__ import annotations

import numpy as np


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of `a` (flattened), ascending, in `a`'s dtype: what `np.unique(a)` returns."""
    out = np.sort(np.asarray(a).ravel())
    if len(out) < 2:
        return out
    keep = np.empty(len(out), dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]
