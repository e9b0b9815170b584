"""Attacks on `datastate.state_json` (msgspec with the stdlib's bytes, or the stdlib itself).

The daemon's per-step state JSON must be `wire.json_bytes` of the state byte
for byte, or a client restoring from a checkpoint written under one encoder
could see other bytes than under the other. tests/test_stepqueue_state_json.py
covers non-negative ints, text and nesting; this adds what it did not draw:
negative and 64-bit-edge integers, integer, bool and None
keys (the stdlib turns them into strings and sorts them as numbers), tuples,
mixed key types (both refuse), and text with every kind of character.

Known and left (docstring of `state_json`): values outside JSON, which no
data state holds, are not refused by msgspec the way the stdlib refuses them:
NaN and infinities become null, bytes base64, sets lists; and floats, which
no state holds either (cursors, counters and pointers are ints, checked on
load), are written in another form (1e16 against the stdlib's 1e+16).
Refusing them would mean walking the state, the cost msgspec removes.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice import datastate
from sluice.datastate import state_json
from sluice.wire.encoding import json_bytes

pytest.importorskip("msgspec")


def _outcome(f, value):
    try:
        return ("ok", f(value))
    except (TypeError, ValueError) as exc:
        return ("refused", type(exc).__name__)


scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64])
           | st.text(max_size=8))
keys = st.text(max_size=4) | st.integers(-(2**65), 2**65) | st.booleans() | st.none()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=16)


@settings(max_examples=examples(300), deadline=None)
@given(values)
def test_any_json_value_encodes_as_json_bytes_or_is_refused_by_both(value):
    assert datastate._msgspec_encode is not None
    d = {"kind": "sluice.data-state", "step": 1, "lanes": {"0": value}}
    assert _outcome(state_json, d) == _outcome(json_bytes, d)
