"""Several columnar steps in one call equal the same steps one at a time.

`multistep.plan_steps` (what the thread producer uses once it runs ahead)
keeps each lane's machine across steps and assembles every step's rows in one
block; `StepMaker.produce_steps` cuts and encodes them. Each step must be what
`Plan.step` (and `produce_step`) gives: rows, provenance, micro-batch bytes and
the data state, for every mixture, framing, exhaustion rule (a batch that
meets the end of the stream, a `stop` or a `fail` source stops before it), lane
subset and resume point.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logical_helpers import MappedDocs, fake_docs, make_manifest, make_spec
from sluice.errors import EndOfStream, ExhaustedError, StateError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.multistep import plan_steps
from sluice.loaderd.physical.producer import StepMaker


def view(batch, state):
    rows = [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens, r.segments)
            for lane, rs in sorted(batch.rows.items()) for r in rs]
    if batch.block is not None:  # what the micro-batches view: the step's rows, lane after lane
        ordered = [r for _, rs in sorted(batch.rows.items()) for r in rs]
        for a, name in enumerate(("input_ids", "labels", "position_ids")):
            assert batch.block[a].tobytes() == b"".join(getattr(r, name).tobytes() for r in ordered)
    return batch.step, rows, json.dumps(state.state_dict(), sort_keys=True)


def one_at_a_time(plan, state, docs, lanes, steps):
    out = []
    for _ in range(steps):
        try:
            batch, state = plan.step(state, docs, lanes)
        except (EndOfStream, ExhaustedError) as exc:
            return out, (type(exc).__name__, str(exc))
        out.append(view(batch, state))
    return out, None


def in_batches(plan, state, docs, lanes, steps, n):
    out = []
    while len(out) < steps:
        try:
            got = plan_steps(plan, state, docs, lanes, min(n, steps - len(out)))
        except (EndOfStream, ExhaustedError) as exc:
            return out, (type(exc).__name__, str(exc))
        assert 1 <= len(got) <= n
        out += [view(b, s) for b, s in got]
        state = got[-1][1]
    return out, None


rule = st.sampled_from(["repeat", "renormalize", "stop", "fail"])
weight = st.sampled_from(["1", "0.5", "0.25", "3", "0"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sources=st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=3), weight, rule), min_size=1,
                     max_size=3),
    unit=st.sampled_from(["documents", "tokens", "loss_tokens"]),
    policy=st.sampled_from(["quota", "categorical"]),
    separator=st.sampled_from(["eos", "bos", "bos_eos", "none"]),
    loss_mask=st.sampled_from(["all", "exclude_separator"]),
    seq_len=st.sampled_from([4, 16, 37]),
    lanes=st.sampled_from([1, 2, 4]),
    per_lane=st.integers(1, 3),
    order=st.sampled_from(["global", "block", "none"]),
    seed=st.integers(0, 2**32),
    resume=st.integers(0, 5),
    max_len=st.sampled_from([1, 5, 40, 150]),
    n=st.integers(2, 5),
    subset=st.booleans(),
    max_steps=st.sampled_from([0, 3, 9]),
    pieces=st.sampled_from([None, 3, 16]),
    mapped=st.sampled_from([None, (0, -1), (4, -1), (3, 1)]),
)
def test_steps_in_one_call_equal_steps_one_at_a_time(sources, unit, policy, separator, loss_mask, seq_len, lanes,
                                                      per_lane, order, seed, resume, max_len, n, subset, max_steps,
                                                      pieces, mapped):
    srcs = [(f"s{i}", counts, w, r) for i, (counts, w, r) in enumerate(sources)]
    if all(w == "0" for _, _, w, _ in srcs):
        srcs[0] = (srcs[0][0], srcs[0][1], "1", srcs[0][3])
    manifest = make_manifest(srcs, unit=unit, policy=policy, separator=separator, loss_mask=loss_mask,
                             seq_len=seq_len, piece_tokens=pieces if unit != "documents" else None)
    plan = Plan(manifest, make_spec(lanes=lanes, global_batch=lanes * per_lane, micro_batch=1, order=order,
                                    seed=seed, max_steps=max_steps))
    # mapped: (empty_every, unmapped) of synthetic mapped shards (`MappedDocs`), the draw's shard path
    docs = fake_docs(max_len) if mapped is None else MappedDocs(plan, max_len, empty_every=mapped[0],
                                                                  unmapped=mapped[1])
    mine = list(range(lanes // 2, lanes)) if subset and lanes > 1 else list(range(lanes))
    start = plan.initial_state()
    if resume:
        for _ in range(resume):
            try:
                _, start = plan.step(start, docs)
            except (EndOfStream, ExhaustedError):
                break
    start = start.subset(mine) if subset else start
    want = one_at_a_time(plan, start, docs, mine, 12)
    got = in_batches(plan, start, docs, mine, 12, n)
    assert got == want


def test_a_state_without_the_lanes_is_refused_as_one_step_refuses_it():
    plan = Plan(make_manifest([("a", [30], "1", "repeat")]), make_spec(lanes=4, global_batch=4, micro_batch=1))
    state = plan.initial_state().subset([0, 1])
    with pytest.raises(StateError, match="does not hold lane 2"):
        plan_steps(plan, state, fake_docs(), [0, 1, 2, 3], 4)


@pytest.mark.parametrize("rule,error", [("stop", "end of stream"), ("fail", "exhausted")])
def test_producer_batches_equal_its_single_steps_up_to_the_terminal_entry(rule, error):
    """`produce_steps` gives `produce_step`'s entries (micro-batch bytes, state JSON, samples) in order, and
    the same terminal entry where the stream ends inside a batch."""
    manifest = make_manifest([("a", [13, 5], "1", rule)], seq_len=8)
    plan = Plan(manifest, make_spec(lanes=2, global_batch=2, micro_batch=1))
    class Counted:  # the DocTokens callback with the document count StepMaker reads (as DocSource keeps)
        calls = 0

        def __call__(self, ref):
            self.calls += 1
            return fake_docs(12)(ref)

        def prefetch(self, refs):  # announcements only start work early; they never change a byte
            self.announced = len(refs)

    docs = Counted()

    def entries(make):
        out, state = [], plan.initial_state()
        while state is not None and len(out) < 60:
            for entry, state in make(state):
                out.append((entry.step, [{k: v.tobytes() for k, v in m.items()} for m in entry.micros], entry.samples,
                            entry.state_json, entry.error))
                if entry.error is not None:
                    return out
        return out

    single, batched = StepMaker(plan, docs, replica=0, replicas=1), StepMaker(plan, docs, replica=0, replicas=1)
    want = entries(lambda s: [single.produce_step(s)])
    got = entries(lambda s: batched.produce_steps(s, 4))
    assert got == want
    assert want[-1][4] is not None and error in want[-1][4][1]
    assert len(want) > 4  # the stream ended inside a batch of steps, not at its start
    assert all(np.frombuffer(m["input_ids"], dtype="<i4").size for _, ms, _, _, _ in want[:-1] for m in ms)
