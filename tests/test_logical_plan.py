"""The logical plane as a specification: pure, resumable, replica-invariant, exact."""

from __future__ import annotations

import json
from fractions import Fraction
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import examples

from logical_helpers import fake_docs, make_manifest, make_spec

from sluice.errors import EndOfStream, ExhaustedError, SpecError, StateError
from sluice.loaderd.logical import Plan, micro_batches_digest
from sluice.loaderd.logical.packing import IGNORE

TWO_SOURCES = [("a", [30, 20, 7], "0.7", "repeat"), ("b", [25, 11], "0.3", "repeat")]


def run(plan, steps, state=None, docs=None, replicas=1):
    docs = docs or fake_docs()
    state = state or plan.initial_state()
    digests = []
    for _ in range(steps):
        batch, state = plan.step(state, docs)
        digests.append([micro_batches_digest(plan.replica_micro_batches(batch, replicas, r)) for r in range(replicas)])
    return digests, state


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
@pytest.mark.parametrize("unit", ["documents", "tokens", "loss_tokens", "sequences"])
@pytest.mark.parametrize("policy", ["quota", "categorical"])
def test_resume_from_any_step_equals_uninterrupted(algorithm, unit, policy):
    plan = Plan(make_manifest(TWO_SOURCES, algorithm=algorithm, unit=unit, policy=policy), make_spec())
    full, _ = run(plan, 12)
    for k in (0, 4, 11):
        _, state = run(plan, k + 1)
        # through JSON, as a checkpoint would carry it
        restored = plan.load_state(json.loads(json.dumps(state.state_dict())))
        rest, _ = run(plan, 12 - k - 1, state=restored)
        assert rest == full[k + 1 :]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(0, 20), seed=st.integers(0, 2**32), algorithm=st.sampled_from(["concat", "bestfit"]))
def test_resume_property(k, seed, algorithm):
    plan = Plan(make_manifest(TWO_SOURCES, algorithm=algorithm), make_spec(seed=seed))
    full, _ = run(plan, k + 3)
    _, state = run(plan, k)
    rest, _ = run(plan, 3, state=plan.load_state(state.state_dict()))
    assert rest == full[k:]


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_global_stream_identical_for_every_replica_count(replicas):
    """Each replica computes only its lanes (as its daemon would); concatenated, they equal R=1."""
    plan = Plan(make_manifest(TWO_SOURCES, algorithm="bestfit"), make_spec(micro_batch=2))
    docs = fake_docs()
    one = plan.initial_state()
    states = {r: plan.initial_state().subset(plan.lanes_of(replicas, r)) for r in range(replicas)}
    for _ in range(6):
        batch, one = plan.step(one, docs)
        ref = plan.replica_micro_batches(batch, 1, 0)
        parts = []
        for r in range(replicas):
            b, states[r] = plan.step(states[r], docs, lanes=plan.lanes_of(replicas, r))
            parts += plan.replica_micro_batches(b, replicas, r)
        assert np.array_equal(np.concatenate([m.input_ids for m in parts]), np.concatenate([m.input_ids for m in ref]))
        assert np.array_equal(np.concatenate([m.labels for m in parts]), np.concatenate([m.labels for m in ref]))
    merged = states[0]
    for r in range(1, replicas):
        merged = merged.merge(states[r])
    assert merged.state_dict() == one.state_dict()


def test_every_sample_once_per_epoch_across_lanes():
    m = make_manifest([("a", [17, 23, 9], "1", "repeat")], algorithm="concat")
    plan = Plan(m, make_spec())
    fetched = set()
    inner = fake_docs()

    def docs(ref):
        fetched.add((ref.epoch, ref.index))
        return inner(ref)

    state = plan.initial_state()
    while min(lane.sources[0].epoch for lane in state.lanes.values()) < 1:
        _, state = plan.step(state, docs)
    epoch0 = sorted(i for e, i in fetched if e == 0)
    assert epoch0 == list(range(49))  # all of epoch 0, each exactly once
    taken = sum(lane.sources[0].docs for lane in state.lanes.values())
    assert taken == len(fetched)  # no document was taken twice


def test_repeat_uses_a_fresh_permutation_each_epoch():
    plan = Plan(make_manifest([("a", [64], "1", "repeat")]), make_spec(lanes=1, global_batch=1, micro_batch=1))
    assert [plan.order(0, 0).sample_at(i) for i in range(64)] != [plan.order(0, 1).sample_at(i) for i in range(64)]


def test_stop_ends_the_stream_with_a_clear_error():
    plan = Plan(make_manifest([("a", [40], "1", "stop")]), make_spec())
    with pytest.raises(EndOfStream, match="'a' exhausted in lane"):
        run(plan, 100)


def test_fail_raises_naming_source_lane_and_step():
    plan = Plan(make_manifest([("a", [40], "0.5", "fail"), ("b", [400], "0.5", "repeat")]), make_spec())
    with pytest.raises(ExhaustedError, match=r"step \d+: source 'a' exhausted in lane \d+ .*'fail'") as info:
        run(plan, 100)
    assert not isinstance(info.value, EndOfStream)


def test_renormalize_drops_the_exhausted_source():
    plan = Plan(make_manifest([("a", [16], "0.5", "renormalize"), ("b", [4000], "0.5", "repeat")]), make_spec())
    _, state = run(plan, 40)
    for lane in state.lanes.values():
        a, b = lane.sources
        assert not a.active and a.docs == 2  # its whole share, then gone
        assert b.docs > 20


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_rows_are_well_formed(algorithm):
    m = make_manifest(TWO_SOURCES, algorithm=algorithm, seq_len=16, loss_mask="exclude_separator")
    plan = Plan(m, make_spec())
    inner = fake_docs(max_len=40)
    framed = {}

    def docs(ref):
        ids = inner(ref)
        framed[ref.sample_id] = np.concatenate([ids.astype(np.int32), [0]])
        return ids

    state = plan.initial_state()
    for _ in range(5):
        batch, state = plan.step(state, docs)
        for mb in plan.replica_micro_batches(batch, 2, 0):
            assert mb.cu_seqlens[-1] == mb.input_ids.size
            for r, segs in enumerate(mb.segments):
                fill = 0
                for sid, start, end in segs:
                    doc = framed[sid]
                    n = end - start
                    assert np.array_equal(mb.input_ids[r, fill : fill + n], doc[start:end])
                    assert np.array_equal(mb.position_ids[r, fill : fill + n], np.arange(n))
                    want = np.append(doc[1:], IGNORE)[start:end].copy()
                    if end >= len(doc) - 1 >= start:
                        want[len(doc) - 2 - start] = IGNORE  # eos target masked
                    assert np.array_equal(mb.labels[r, fill : fill + n], want)
                    if algorithm == "bestfit" and len(doc) <= 16:
                        assert (start, end) == (0, len(doc))  # never split
                    fill += n
                assert (mb.labels[r, fill:] == IGNORE).all() and (mb.input_ids[r, fill:] == 1).all()
                if algorithm == "concat":
                    assert fill == 16


def test_quota_realized_counts_within_one_document_per_lane():
    plan = Plan(make_manifest([("a", [300], "0.6", "repeat"), ("b", [300], "0.4", "repeat")]), make_spec())
    docs = fake_docs()
    state = plan.initial_state()
    for _ in range(20):
        _, state = plan.step(state, docs)
        for lane in state.lanes.values():
            n = lane.draws
            assert abs(lane.sources[0].docs - Fraction(6 * n, 10)) < 1
            assert abs(lane.sources[1].docs - Fraction(4 * n, 10)) < 1


def test_state_is_small_and_does_not_grow_with_steps():
    plan = Plan(make_manifest(TWO_SOURCES, algorithm="bestfit"), make_spec())
    _, s10 = run(plan, 10)
    _, s60 = run(plan, 60)
    a, b = len(json.dumps(s10.state_dict())), len(json.dumps(s60.state_dict()))
    assert b < a + 400 and b < 8000  # counters grow by digits only


def test_foreign_and_corrupt_states_are_refused():
    plan = Plan(make_manifest(TWO_SOURCES), make_spec())
    _, state = run(plan, 2)
    other_spec = Plan(make_manifest(TWO_SOURCES), make_spec(seed=99))
    with pytest.raises(StateError, match="run spec digest"):
        other_spec.load_state(state.state_dict())
    other_data = Plan(make_manifest([("a", [30, 20, 7], "0.6", "repeat"), ("b", [25, 11], "0.4", "repeat")]), make_spec())
    with pytest.raises(StateError, match="dataset ID .* another dataset"):
        other_data.load_state(state.state_dict())
    bad = state.state_dict()
    bad["lanes"]["3"]["sources"][0] = [0, -1, 1, 0, 0, 0, 0]
    with pytest.raises(StateError, match=r"lanes\[3\]\.sources\[0\]"):
        plan.load_state(bad)
    bad = state.state_dict()
    bad["schema"] = 99
    with pytest.raises(StateError, match="schema 99"):
        plan.load_state(bad)
    bad = state.state_dict()
    bad["lanes"]["0"]["packers"]["*"]["cur"] = "x"
    with pytest.raises(StateError, match="concat residual"):
        plan.step(plan.load_state(bad), fake_docs())


def test_batch_not_divisible_by_lanes_is_refused():
    with pytest.raises(SpecError, match="global_batch=12 is not a multiple of lanes=8"):
        make_spec(lanes=8, global_batch=12)
    plan = Plan(make_manifest(TWO_SOURCES), make_spec())
    with pytest.raises(SpecError, match="3 replicas do not divide lanes=8"):
        plan.lanes_of(3, 0)


@settings(max_examples=examples(60), deadline=None)
@given(records=st.lists(st.integers(0, 60), min_size=1, max_size=3), lanes=st.integers(1, 12),
       chunk=st.integers(1, 9), group=st.integers(1, 5), order=st.sampled_from(["global", "block"]),
       data=st.data())
def test_lane_samples_are_the_order_at_the_lanes_positions(records, lanes, chunk, group, order, data):
    """Lane l's n-th document is position l + n*lanes of the epoch order, whichever lane asks first and
    however positions are grouped into chunks (small chunks and groups here to cross their edges)."""
    plan = Plan(make_manifest([("a", records, "1", "repeat")]), make_spec(lanes=lanes, global_batch=lanes,
                                                                         micro_batch=1, order=order))
    plan.LANE_CHUNK, plan.LANE_GROUP = chunk, group
    n = sum(records)
    o = plan.order(0, 2)
    for lane in data.draw(st.permutations(range(lanes))):
        share = len(range(lane, n, lanes))
        want = [o.sample_at(lane + k * lanes) for k in range(share)]
        assert [plan.lane_sample(0, 2, lane, k) for k in range(share)] == want
        if share:
            lo = data.draw(st.integers(0, share - 1))
            assert plan.lane_samples(0, 2, lane, lo, share).tolist() == want[lo:]
