"""`fused.unit_arrays`: every micro-batch's cu_seqlens, piece bounds and tokens per source of a call at once.

Specified against the plain per-micro-batch reading of the same piece starts
(the pieces whose start falls in the micro-batch's U tokens, each running to
the next start or the micro-batch's end), and, for whole steps, against the
kernel's own `jitrows._step_cu` (run uncompiled), which makes the same arrays
for the producer's steps of one micro-batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.loaderd.logical.fused import unit_arrays


@st.composite
def calls(draw):
    """(keys, n units, U tokens each, each piece's source, sources): every unit starts with a piece (a row start
    is a piece start), the other starts anywhere inside a unit, sorted and distinct."""
    n = draw(st.integers(1, 12))
    U = draw(st.integers(1, 64))
    S = draw(st.integers(1, 6))
    keys = {u * U for u in range(n)}
    for u in range(n):
        keys |= set(draw(st.lists(st.integers(u * U, (u + 1) * U - 1), max_size=8)))
    keys = np.array(sorted(keys), dtype=np.int64)
    src = np.array(draw(st.lists(st.integers(0, S - 1), min_size=len(keys), max_size=len(keys))), dtype=np.int64)
    return keys, n, U, src, S


def per_unit(keys: np.ndarray, n: int, U: int, src: np.ndarray, S: int):
    """The plain reading: unit by unit, its pieces, their lengths and sources."""
    out = []
    for u in range(n):
        inside = [i for i, k in enumerate(keys.tolist()) if u * U <= k < (u + 1) * U]
        starts = [int(keys[i]) - u * U for i in inside]
        cu = starts + [U]
        tokens = [0] * S
        for i, a, b in zip(inside, cu, cu[1:]):
            tokens[int(src[i])] += b - a
        out.append((cu, inside, tokens))
    return out


@settings(max_examples=300, deadline=None)
@given(calls())
def test_every_micro_batch_of_a_call_is_its_plain_reading(call):
    keys, n, U, src, S = call
    cu, bounds, tokens = unit_arrays(keys, n, U, src, S)
    assert cu.dtype == np.int32 and len(bounds) == n + 1 and len(tokens) == n
    for u, (want_cu, inside, want_tokens) in enumerate(per_unit(keys, n, U, src, S)):
        lo, hi = bounds[u], bounds[u + 1]
        assert cu[lo + u:hi + u + 1].tolist() == want_cu
        assert list(range(lo, hi)) == inside
        assert tokens[u] == want_tokens and sum(tokens[u]) == U


@settings(max_examples=100, deadline=None)
@given(calls(), st.integers(1, 4))
def test_whole_steps_equal_the_kernels_step_arrays(call, per_step):
    """With U a whole step's tokens the arrays are the kernel's `_step_cu`'s (owners the identity: `src` is then
    each entry's source)."""
    pytest.importorskip("numba")
    from sluice.loaderd.physical.jitload import uncompiled

    keys, n, U, src, S = call
    steps = -(-n // per_step)  # (units grouped into steps of `per_step` units; the last may hold fewer)
    PT = U * per_step
    rows = uncompiled().modules["jitrows"]
    with np.errstate(over="ignore"):
        k_cu, k_bounds, k_tokens = rows._step_cu(keys, np.arange(len(keys), dtype=np.int64), src, steps, PT, S)
    cu, bounds, tokens = unit_arrays(keys, steps, PT, src, S)
    assert cu.tolist() == k_cu.tolist() and bounds == k_bounds.tolist() and tokens == k_tokens.tolist()
