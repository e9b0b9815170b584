"""The producer's announcement as arrays names exactly the documents `Plan.upcoming` names, in need order.

`upcoming_columns(plan, state, lanes, n)` (sluice/loaderd/logical/upcoming.py)
replaces building one `DocRef` per announced document: for every algorithm,
unit, order, exhaustion rule, piece draw and position (including open
documents and a packer's residual), its (source, object, record) arrays equal
the interleave of the lanes' `Plan.upcoming` lists: every lane's i-th document
before any lane's (i+1)-th.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import examples

from logical_helpers import fake_docs, make_manifest, make_spec
from sluice.errors import EndOfStream, ExhaustedError, StateError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.upcoming import upcoming_columns


def interleaved(plan, state, lanes, n):
    """The reference: every lane's `Plan.upcoming` list, taken column by column."""
    per_lane = [plan.upcoming(state, lane, n) for lane in lanes]
    refs = [refs[i] for i in range(max(map(len, per_lane), default=0)) for refs in per_lane if i < len(refs)]
    return [(r.source, r.obj, r.record) for r in refs]


def columns(plan, state, lanes, n):
    up = upcoming_columns(plan, state, lanes, n)
    assert len(up.source) == len(up.obj) == len(up.record) == len(up)
    return list(zip(up.source.tolist(), up.obj.tolist(), up.record.tolist()))


def advance(plan, state, steps):
    """The state after up to `steps` steps (fewer where the stream ends)."""
    docs = fake_docs(60)
    for _ in range(steps):
        try:
            _, state = plan.step(state, docs)
        except (EndOfStream, ExhaustedError):
            break
    return state


rule = st.sampled_from(["repeat", "renormalize", "stop", "fail"])


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sources=st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.sampled_from(["1", "0.3", "2"]),
                               rule), min_size=1, max_size=3),
    algorithm=st.sampled_from(["concat", "bestfit"]),
    unit=st.sampled_from(["documents", "tokens", "sequences"]),
    pieces=st.sampled_from([None, 3, 16]),
    order=st.sampled_from(["global", "block", "none"]),
    lanes=st.sampled_from([1, 2, 3, 4]),
    seed=st.integers(0, 2**32),
    steps=st.integers(0, 12),
    n=st.integers(0, 70),
    replica=st.sampled_from([None, 0, 1]),
)
def test_columns_name_what_upcoming_names_in_need_order(sources, algorithm, unit, pieces, order, lanes, seed, steps,
                                                       n, replica):
    srcs = [(f"s{i}", counts, w, r) for i, (counts, w, r) in enumerate(sources)]
    plan = Plan(make_manifest(srcs, algorithm=algorithm, unit=unit, seq_len=16,
                              piece_tokens=pieces if unit == "tokens" else None),
                make_spec(lanes=lanes, global_batch=lanes, micro_batch=1, seed=seed, order=order))
    state = advance(plan, plan.initial_state(), steps)
    mine = list(range(lanes)) if replica is None or lanes == 1 else list(plan.lanes_of(1, 0))[replica::2]
    assert columns(plan, state, mine, n) == interleaved(plan, state, mine, n)


def test_lanes_of_different_lengths_interleave_and_skip_the_gaps():
    # lane 0 owns 3 positions of a 5-record "stop" source, lane 1 two: past them only lane 0 continues
    plan = Plan(make_manifest([("a", [5], "1", "stop")]), make_spec(lanes=2, global_batch=2, micro_batch=1))
    got = columns(plan, plan.initial_state(), [0, 1], 10)
    assert len(got) == 5 and got == interleaved(plan, plan.initial_state(), [0, 1], 10)
    assert sorted(r for _, _, r in got) == [0, 1, 2, 3, 4]


def test_a_state_naming_a_sample_outside_its_source_is_refused_alike():
    plan = Plan(make_manifest([("a", [6], "1", "repeat")]), make_spec(lanes=1, global_batch=1, micro_batch=1))
    d = advance(plan, plan.initial_state(), 1).state_dict()
    d["lanes"]["0"]["packers"]["*"] = {"cur": [0, 0, 99, 0, 5]}  # a residual at sample 99 of 6
    bad = plan.load_state(d)
    with pytest.raises(StateError, match="sample index 99 outside"):
        plan.upcoming(bad, 0, 4)
    with pytest.raises(StateError, match="sample index 99 outside"):
        upcoming_columns(plan, bad, [0], 4)
