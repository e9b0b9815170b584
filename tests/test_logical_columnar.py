"""The columnar plane equals the reference plane: same rows, same states, at every step and resume point.

`Plan(..., reference=True)` computes each step document by document (the
specification); the default `Plan` packs concat steps columnar
(`sluice/loaderd/logical/columnar.py`). For every algorithm, mixture unit,
policy, separator/loss-mask framing, exhaustion rule and resume point, both
must give byte-identical micro-batches, identical provenance segments and
identical data states (the state is what a checkpoint keeps, so a state that
differs in any field is a bug even if the rows agree).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logical_helpers import MappedDocs, fake_docs, make_manifest, make_spec
from sluice.errors import EndOfStream, ExhaustedError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.mixture import (
    CounterRNG,
    categorical_pick,
    categorical_picks,
    counted_quota_picks,
    quota_pick,
)


def outcome(plan, state, docs, steps):
    """Per step: every row's arrays and segments and the state after it; the terminal error if the stream ends."""
    out = []
    for _ in range(steps):
        try:
            batch, state = plan.step(state, docs)
        except (EndOfStream, ExhaustedError) as exc:
            out.append(("end", type(exc).__name__, str(exc)))
            break
        rows = [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens, r.segments)
                for lane, rs in sorted(batch.rows.items()) for r in rs]
        for lane, rs in batch.rows.items():
            for r in rs:
                assert r.input_ids.dtype == r.labels.dtype == r.position_ids.dtype == np.int32
        out.append((rows, json.dumps(state.state_dict(), sort_keys=True)))
    return out, state


def both(sources, steps, *, state_at=None, max_len=40, mapped=None, **kw):
    """(columnar outcome, reference outcome); `mapped` = (empty_every, unmapped) serves the documents from
    synthetic mapped shards (`MappedDocs`: the columnar draw's shard path) instead of the callback alone."""
    spec_kw = {k: kw.pop(k) for k in ("seed", "lanes", "global_batch", "micro_batch", "order") if k in kw}
    manifest = make_manifest(sources, **kw)
    spec = make_spec(**spec_kw)
    fast, ref = Plan(manifest, spec), Plan(manifest, spec, reference=True)
    assert fast.columnar == (kw.get("algorithm", "concat") == "concat" and kw.get("unit") != "sequences")
    docs = fake_docs(max_len) if mapped is None else MappedDocs(fast, max_len, empty_every=mapped[0],
                                                                  unmapped=mapped[1])
    start = fast.initial_state()
    if state_at:  # resume both from the reference's state after `state_at` steps, through JSON
        _, st_ = outcome(ref, start, docs, state_at)
        start = ref.load_state(json.loads(json.dumps(st_.state_dict())))
    got, _ = outcome(fast, start, docs, steps)
    want, _ = outcome(ref, start, docs, steps)
    return got, want


SOURCES = [("a", [30, 20, 7], "0.7", "repeat"), ("b", [25, 11], "0.3", "repeat")]


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
@pytest.mark.parametrize("unit", ["documents", "tokens", "loss_tokens", "sequences"])
@pytest.mark.parametrize("policy", ["quota", "categorical"])
def test_columnar_equals_reference_for_every_algorithm_unit_and_policy(algorithm, unit, policy):
    got, want = both(SOURCES, 14, algorithm=algorithm, unit=unit, policy=policy)
    assert got == want


@pytest.mark.parametrize("unit", ["tokens", "loss_tokens"])
@pytest.mark.parametrize("sources", [[("a", [30, 20, 7], "1", "repeat")],  # one source: batched picks
                                     [("a", [9], "0.5", "renormalize"), ("b", [40, 12], "0.5", "repeat")],
                                     [("a", [30], "1", "repeat"), ("b", [25], "0", "repeat")]])
def test_token_units_with_one_source_left_equal_the_reference(unit, sources):
    """Token-unit quota picks are batched while one source (with weight) is active: the same stream,
    also across the step where another source runs out and the epochs that repeat."""
    got, want = both(sources, 30, unit=unit, policy="quota", order="block")
    assert got == want


@pytest.mark.parametrize("separator", ["eos", "bos_eos", "none"])
@pytest.mark.parametrize("loss_mask", ["all", "exclude_separator"])
@pytest.mark.parametrize("mapped", [(0, -1), (3, -1), (4, 1)])
def test_single_source_draws_from_mapped_shards_equal_the_reference(separator, loss_mask, mapped):
    """One live source with mapped shards: each document is a slice of its shard (no callback), empty
    documents and objects not mapped yet included, across epochs and a resume point."""
    got, want = both([("a", [30, 20, 7], "1", "repeat")], 30, mapped=mapped, separator=separator,
                     loss_mask=loss_mask, order="block", state_at=4)
    assert got == want


@pytest.mark.parametrize("separator", ["eos", "bos", "bos_eos", "none"])
@pytest.mark.parametrize("unit", ["tokens", "loss_tokens"])
@pytest.mark.parametrize("policy", ["quota", "categorical"])
def test_columnar_equals_reference_with_piece_draws(separator, unit, policy):
    # documents up to 150 tokens against pieces of 7: most documents are cut, pieces straddle rows
    got, want = both(SOURCES, 14, max_len=150, unit=unit, policy=policy, separator=separator,
                     loss_mask="exclude_separator", piece_tokens=7, state_at=3)
    assert got == want


rule = st.sampled_from(["repeat", "renormalize", "stop", "fail"])
weight = st.sampled_from(["1", "0.5", "0.25", "3", "0.1", "0"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sources=st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=3), weight, rule), min_size=1, max_size=3),
    unit=st.sampled_from(["documents", "tokens", "loss_tokens", "sequences"]),
    policy=st.sampled_from(["quota", "categorical"]),
    separator=st.sampled_from(["eos", "bos", "bos_eos", "none"]),
    loss_mask=st.sampled_from(["all", "exclude_separator"]),
    seq_len=st.sampled_from([4, 16, 37, 64]),
    lanes=st.sampled_from([1, 2, 4]),
    per_lane=st.integers(1, 3),
    order=st.sampled_from(["global", "block", "none"]),
    seed=st.integers(0, 2**32),
    resume=st.integers(0, 6),
    max_len=st.sampled_from([1, 5, 40, 150]),
    pieces=st.sampled_from([None, 1, 3, 16, 50]),
    mapped=st.sampled_from([None, (0, -1), (4, -1), (3, 1)]),
)
def test_columnar_equals_reference_property(sources, unit, policy, separator, loss_mask, seq_len, lanes, per_lane,
                                            order, seed, resume, max_len, pieces, mapped):
    srcs = [(f"s{i}", counts, w, r) for i, (counts, w, r) in enumerate(sources)]
    if all(w == "0" for _, _, w, _ in srcs):
        srcs[0] = (srcs[0][0], srcs[0][1], "1", srcs[0][3])
    got, want = both(srcs, 10, state_at=resume, max_len=max_len, unit=unit, policy=policy, separator=separator,
                     loss_mask=loss_mask, seq_len=seq_len, seed=seed, lanes=lanes, global_batch=lanes * per_lane,
                     micro_batch=1, order=order, piece_tokens=pieces if unit in ("tokens", "loss_tokens") else None,
                     mapped=mapped)
    assert got == want


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(0, 1 << 33), min_size=1, max_size=5), seed=st.integers(0, 2**32),
       first=st.integers(0, 1 << 40), mask=st.integers(0, 31))
def test_categorical_picks_equal_one_at_a_time(weights, seed, first, mask):
    active = [bool(mask >> i & 1) or i == 0 for i in range(len(weights))]
    rng = CounterRNG("b3:x", seed, 3)
    got = categorical_picks(weights, active, rng.key, first, 50)
    if sum(w for w, a in zip(weights, active) if a) > 1 << 32 or not any(w and a for w, a in zip(weights, active)):
        assert got is None
        return
    assert got.tolist() == [categorical_pick(weights, active, rng.u64(first + i)) for i in range(50)]


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(0, 9), min_size=1, max_size=5), counts=st.lists(st.integers(0, 50), min_size=5,
       max_size=5), mask=st.integers(0, 31), n=st.integers(0, 100), first=st.integers(0, 40))
def test_counted_quota_picks_equal_one_at_a_time(weights, counts, mask, n, first):
    active = [bool(mask >> i & 1) or i == 0 for i in range(len(weights))]
    c = counts[: len(weights)]
    want, cw = [], list(c)
    for _ in range(first + n):
        s = quota_pick(weights, cw, active, True)
        want.append(s)
        if s >= 0:
            cw[s] += 1
    memo: dict = {}
    assert counted_quota_picks(weights, c, active, n, memo) == want[:n]
    assert counted_quota_picks(weights, c, active, n, memo) == want[:n]  # from the memo
    # from the counts after `first` picks, with runs the memo holds from other starts
    later = list(c)
    for s in want[:first]:
        if s >= 0:
            later[s] += 1
    assert counted_quota_picks(weights, later, active, n, memo) == want[first:]


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_micro_batches_from_the_block_equal_the_stacked_rows(replicas):
    """The columnar plane hands micro-batches out as slices of its step block: the same arrays as the
    reference's stacked rows, for every replica, whether the step computed all lanes or the replica's."""
    manifest, spec = make_manifest(SOURCES), make_spec(lanes=8, global_batch=16, micro_batch=2)
    fast, ref = Plan(manifest, spec), Plan(manifest, spec, reference=True)
    docs = fake_docs()
    for r in range(replicas):
        lanes_sets = [None, list(fast.lanes_of(replicas, r))]
        for lanes in lanes_sets:
            state_f, state_r = fast.initial_state(), ref.initial_state()
            for _ in range(3):
                batch_f, state_f = fast.step(state_f, docs, lanes)
                batch_r, state_r = ref.step(state_r, docs, lanes)
                assert batch_f.block is not None
                got = fast.replica_micro_batches(batch_f, replicas, r)
                want = ref.replica_micro_batches(batch_r, replicas, r)
                assert [m.arrays().keys() for m in got] == [m.arrays().keys() for m in want]
                for g, w in zip(got, want):
                    for name, arr in w.arrays().items():
                        assert g.arrays()[name].dtype == arr.dtype and g.arrays()[name].tobytes() == arr.tobytes()
                    assert g.segments == w.segments
                    assert g.input_ids.base is batch_f.block  # a view, not a copy
