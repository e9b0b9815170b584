"""Order: keyed permutations are bijections with inverses; lanes partition epochs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice import runspec
from sluice.loaderd.logical.order import Feistel, derive_keys, lane_share, make_order
from sluice.runspec import ORDER_VERSIONS, RunSpec


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(0, 700), seed=st.integers(0, 2**63 - 1))
def test_feistel_is_a_bijection_with_inverse(n, seed):
    perm = Feistel(n, derive_keys("t", seed))
    out = [perm.forward(i) for i in range(n)]
    assert sorted(out) == list(range(n))
    assert [perm.inverse(y) for y in out] == list(range(n))


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_feistel_forward_many_equals_forward(n, seed, data):
    """The vectorized walk (and its scalar tail) is the scalar `forward`, value for value."""
    perm = Feistel(n, derive_keys("t", seed))
    xs = data.draw(st.lists(st.integers(0, n - 1), max_size=1100))
    got = perm.forward_many(np.asarray(xs, dtype=np.int64))
    assert got.dtype == np.int64
    assert got.tolist() == [perm.forward(x) for x in xs]


def test_global_order_keeps_its_stream():
    """feistel-v1's output is pinned: whoever changes it bumps ORDER_VERSIONS (docs/logical.md)."""
    order = make_order("global", (6000,), dataset_id="d", seed=1, source="s", epoch=0, window=1)
    got = order.sample_many(np.arange(3, 6000, 8, dtype=np.int64))
    assert got[:8].tolist() == [4714, 4444, 4321, 3124, 1371, 5423, 4302, 4746]  # before the scalar tail
    assert int(got.sum()) == 2305270


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=12), window=st.integers(1, 5), epoch=st.integers(0, 3))
def test_block_shuffle_is_a_bijection_with_inverse(counts, window, epoch):
    order = make_order("block", tuple(counts), dataset_id="d", seed=7, source="s", epoch=epoch, window=window)
    out = [order.sample_at(i) for i in range(order.n)]
    assert sorted(out) == list(range(sum(counts)))
    assert all(order.position_of(s) == i for i, s in enumerate(out))


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 300), min_size=1, max_size=12), window=st.integers(1, 5),
       epoch=st.integers(0, 3), data=st.data())
def test_block_shuffle_sample_many_equals_sample_at(counts, window, epoch, data):
    """The vectorized block order (one Feistel call per window) is `sample_at`, value for value."""
    order = make_order("block", tuple(counts), dataset_id="d", seed=7, source="s", epoch=epoch, window=window)
    if order.n == 0:
        return
    xs = data.draw(st.lists(st.integers(0, order.n - 1), max_size=400))
    got = order.sample_many(np.asarray(xs, dtype=np.int64))
    assert got.dtype == np.int64
    assert got.tolist() == [order.sample_at(x) for x in xs]


def test_block_sample_many_names_a_position_outside_the_epoch():
    order = make_order("block", (5, 5), dataset_id="d", seed=7, source="s", epoch=0, window=1)
    with pytest.raises(IndexError, match="position 10 outside"):
        order.sample_many(np.asarray([0, 10], dtype=np.int64))


def test_block_shuffle_reads_one_window_of_shards_at_a_time():
    counts = (10,) * 8
    order = make_order("block", counts, dataset_id="d", seed=7, source="s", epoch=0, window=2)
    first_window = {order.sample_at(i) // 10 for i in range(20)}
    assert len(first_window) == 2  # the first 20 positions touch exactly 2 shards


def test_permutation_differs_by_every_key_part():
    base = dict(dataset_id="d", seed=1, source="s", epoch=0, window=2)
    ref = [make_order("global", (500,), **base).sample_at(i) for i in range(500)]
    for key, value in (("dataset_id", "e"), ("seed", 2), ("source", "t"), ("epoch", 1)):
        other = make_order("global", (500,), **{**base, key: value})
        assert [other.sample_at(i) for i in range(500)] != ref, key


def test_none_order_is_identity():
    order = make_order("none", (3, 4), dataset_id="d", seed=1, source="s", epoch=5, window=1)
    assert [order.sample_at(i) for i in range(7)] == list(range(7))


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(0, 300), lanes=st.integers(1, 16))
def test_lanes_partition_each_epoch(n, lanes):
    order = make_order("global", (n,), dataset_id="d", seed=3, source="s", epoch=0, window=1)
    seen = []
    for lane in range(lanes):
        seen += [order.sample_at(lane + k * lanes) for k in range(lane_share(n, lanes, lane))]
    assert sorted(seen) == list(range(n))  # every sample exactly once, across lanes


def test_each_order_is_the_version_the_run_spec_digest_records(monkeypatch):
    for kind, version in ORDER_VERSIONS.items():
        order = make_order(kind, (3, 4), dataset_id="b3:d", seed=1, source="s", epoch=0, window=2)
        assert order.name == version
    spec = RunSpec(run_id="r", seed=1, lanes=2, global_batch=4, micro_batch=2)
    unordered = RunSpec(**{**spec.to_obj(), "order": "none"})
    before, unordered_before = spec.digest, unordered.digest
    # a new version of the global order makes another run: its old checkpoints are refused
    monkeypatch.setitem(runspec.ORDER_VERSIONS, "global", "feistel-v2")
    assert spec.digest != before
    assert unordered.digest == unordered_before  # only the run's own order's version counts
