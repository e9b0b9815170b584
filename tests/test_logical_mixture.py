"""Mixture: quota stays within one unit at every prefix; categorical matches weights."""

import math
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.loaderd.logical.mixture import CounterRNG, categorical_pick, integer_weights, quota_pick


def test_integer_weights_are_exact():
    assert integer_weights(["0.7", "0.3"]) == [7, 3]
    assert integer_weights(["1", "0.25", "0"]) == [4, 1, 0]


@settings(max_examples=examples(300), deadline=None)
@given(ws=st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(lambda w: sum(w) > 0), n=st.integers(1, 150))
def test_quota_within_one_document_at_every_prefix(ws, n):
    counts = [0] * len(ws)
    active = [True] * len(ws)
    total = sum(ws)
    for draw in range(1, n + 1):
        s = quota_pick(ws, counts, active, counted=True)
        counts[s] += 1
        for w, c in zip(ws, counts):
            assert abs(c - Fraction(w * draw, total)) < 1


@settings(max_examples=40, deadline=None)
@given(
    ws=st.lists(st.integers(1, 20), min_size=2, max_size=4),
    sizes=st.lists(st.integers(1, 30), min_size=200, max_size=200),
)
def test_quota_tokens_within_k_minus_1_documents(ws, sizes):
    # Over-service is at most one document (a source is drawn only while it is
    # behind); since deficits sum to zero, under-service is at most the other
    # k-1 sources' over-service.
    counts = [0] * len(ws)
    total_w = sum(ws)
    for i, size in enumerate(sizes):
        s = quota_pick(ws, counts, [True] * len(ws), counted=False)
        counts[s] += size
        t = sum(counts)
        for w, c in zip(ws, counts):
            assert c - Fraction(w * t, total_w) <= max(sizes)
            assert Fraction(w * t, total_w) - c <= (len(ws) - 1) * max(sizes)


def test_quota_renormalizes_over_active_sources():
    counts = [0, 0, 0]
    for _ in range(30):
        s = quota_pick([1, 1, 2], counts, [True, False, True], counted=True)
        counts[s] += 1
    assert counts == [10, 0, 20]


def test_categorical_frequencies_match_weights():
    # Each frequency lies within 5 standard errors of its weight (a false
    # failure has probability < 1e-6 per source); the generator is a pure
    # function of (dataset, seed, lane, draw) so this test is deterministic.
    ws = [5, 3, 2]
    rng = CounterRNG("b3:x", 42, 0)
    n = 20000
    counts = [0, 0, 0]
    for draw in range(n):
        counts[categorical_pick(ws, [True] * 3, rng.u64(draw))] += 1
    for w, c in zip(ws, counts):
        p = w / 10
        assert abs(c / n - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_counter_rng_is_a_pure_function():
    a, b = CounterRNG("b3:x", 1, 3), CounterRNG("b3:x", 1, 3)
    assert [a.u64(i) for i in range(5)] == [b.u64(i) for i in range(5)]
    assert [a.u64(i) for i in range(5)] != [CounterRNG("b3:x", 1, 4).u64(i) for i in range(5)]


def test_quota_regression_weights_that_defeat_largest_deficit():
    ws = [1, 1, 1, 3, 3, 3]
    counts = [0] * 6
    for draw in range(1, 2000):
        counts[quota_pick(ws, counts, [True] * 6, counted=True)] += 1
        assert all(abs(c - Fraction(w * draw, 12)) < 1 for w, c in zip(ws, counts))
