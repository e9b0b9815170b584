"""The test tiers themselves: what the fast tier (`make test`, `-m 'not slow'`) leaves to `make test-all`."""

from __future__ import annotations

import support


def test_the_fast_tier_is_a_run_that_leaves_out_the_slow_tests(request):
    assert [support.leaves_out_slow(e) for e in ("not slow", "not slow and not gpu", "(not slow)")] == [True] * 3
    assert [support.leaves_out_slow(e) for e in ("", "slow", "slow or not slow", "not gpu")] == [False] * 4
    if support.FAST_TIER:
        assert not [i for i in request.session.items if i.get_closest_marker("slow")]


def test_examples_are_all_of_them_in_a_full_run_and_a_quarter_in_the_fast_tier(monkeypatch):
    monkeypatch.setattr(support, "FAST_TIER", False)
    assert [support.examples(n) for n in (5, 20, 60, 300)] == [5, 20, 60, 300]
    monkeypatch.setattr(support, "FAST_TIER", True)
    assert [support.examples(n) for n in (5, 20, 60, 300)] == [5, 10, 15, 75]  # never more than asked, at least 10


def test_kernel_tests_are_in_the_slow_tier(request):
    """conftest.py's collection hook marks every test that takes the compiled kernel (numba) slow: the fast
    tier runs none of them (compiling the kernel costs ~11 s of CPU a session)."""
    kernel_tests = [i for i in request.session.items if {"kernel", "jit_kernel"} & set(i.fixturenames)]
    if support.FAST_TIER:
        assert kernel_tests == []
    else:
        assert all(i.get_closest_marker("slow") for i in kernel_tests)
