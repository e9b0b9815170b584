"""A step's state JSON (`datastate.state_json`) is exactly `wire.json_bytes` of the state.

The producer encodes every step's state with msgspec when it is installed
(a tenth of the stdlib encoder's cost); the BATCH header must carry the same
bytes either way: for real states of `Plan.step` and of the fast path,
and for any state-shaped value, where output that could differ (non-ASCII,
escapes) or a value msgspec refuses goes to the stdlib encoder.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from logical_helpers import fake_docs, make_manifest, make_spec
from sluice.loaderd.logical import Plan
from sluice import datastate
from sluice.datastate import state_json
from sluice.wire.encoding import json_bytes

pytest.importorskip("msgspec")  # the test extra installs it; without it state_json is json_bytes itself


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_real_states_encode_as_json_bytes(algorithm):
    assert datastate._msgspec_encode is not None
    m = make_manifest([("a", [30, 12], "1", "repeat"), ("b\u00e9", [25], "2", "repeat")], algorithm=algorithm)
    plan = Plan(m, make_spec(lanes=4, global_batch=4, micro_batch=1))
    docs, state = fake_docs(), plan.initial_state()
    for _ in range(12):
        d = state.state_dict()
        assert state_json(d) == json_bytes(d)
        _, state = plan.step(state, docs, range(4))


ints = st.integers(min_value=0, max_value=2**63 - 1)
keys = st.text(max_size=6)  # any text: non-ASCII and control characters take the stdlib path
values = st.recursive(st.none() | st.booleans() | ints | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=examples(200), deadline=None)
@given(values, st.integers(min_value=2**64, max_value=2**80))
def test_any_state_shaped_value_encodes_as_json_bytes(value, huge):
    d = {"kind": "sluice.data-state", "step": 3, "lanes": {"0": {"packers": value, "draws": 1}}}
    assert state_json(d) == json_bytes(d)
    d["lanes"]["0"]["draws"] = huge  # beyond msgspec's integers: the stdlib encoder's
    assert state_json(d) == json_bytes(d)
