"""The compiled kernel's per-step whole-row bounds (`jitrows._step_cu`) against `fused.unit_arrays`' numpy form.

The kernel tier (the `jit_kernel` fixture: the slow tier, conftest.py).
"""

from __future__ import annotations

import pytest

from sluice.loaderd.logical import fusedmix
from sluice.loaderd.logical.fused import unit_arrays
from test_logical_fused import five_sources_case, mixture_case


@pytest.mark.parametrize("sources", [1, 5])
def test_the_kernels_step_bounds_and_tokens_per_source_equal_numpys(jit_kernel, sources):
    """The kernel hands every step's cu_seqlens, piece bounds and tokens per source with its rows
    (`jitrows._step_cu`): equal to what `fused.unit_arrays` makes in numpy from the keys and the pieces'
    sources (the producer's micro-batches of several a step), along a stream of calls of 1-3 steps."""
    plan, docs = five_sources_case()
    if sources == 1:
        plan, docs = mixture_case([([40, 30], "1", "repeat")], "quota", "tokens", 16, "eos", "all", 16, 4, 2, "block",
                                  9, 60, 0)
    state = plan.initial_state()
    for call in range(12):
        lanes, n = [0, 1, 2, 3], call % 3 + 1
        got = fusedmix.mixed_steps(plan, state, docs, lanes, n, jit_kernel)
        assert got is not None and got is not NotImplemented and got._cu is not None
        PT = len(lanes) * got.k * got.L
        cu, bounds, tokens = unit_arrays(got.keys, n, PT, got.entry_source[got._owners_np()], got.sources)
        assert got._cu.dtype == cu.dtype and got._cu.tolist() == cu.tolist()
        assert got._bounds == bounds and got._tokens == tokens
        assert [sum(t) for t in got._tokens] == [len(lanes) * got.k * got.L] * n
        state = got.state(n - 1)
