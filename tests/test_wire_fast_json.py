"""Spec: headers parse to the same values, or the same refusal, with msgspec's decoder as with the stdlib's.

`decoding._json_value` lets msgspec (the "fast" extra) parse a header first and
hands whatever it refuses to the stdlib decoder (`decoding._DECODER`, which
refuses NaN and the infinities). Both must agree on every text: the value
(types included: ints of any size stay ints) or the exception's class.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, errorcodes, protocol

pytestmark = pytest.mark.skipif(decoding._msgspec_decode is None, reason="msgspec (the fast extra) not installed")


def outcome(fn, text):
    try:
        return ("value", _typed(fn(text)))
    except Exception as exc:  # noqa: BLE001 - the class is the outcome compared
        return ("error", type(exc).__name__)


def _typed(v):
    """`v` with each scalar's type beside it (1 == 1.0 == True in Python; on the wire they differ)."""
    if isinstance(v, dict):
        return ("dict", [(k, _typed(x)) for k, x in v.items()])
    if isinstance(v, list):
        return ("list", [_typed(x) for x in v])
    if isinstance(v, float) and math.isnan(v):
        return ("float", "nan")
    return (type(v).__name__, repr(v))


def same(text: str) -> None:
    assert outcome(decoding._json_value, text) == outcome(decoding._DECODER.decode, text), text[:200]


_scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**40), max_value=10**40)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=20)


@settings(max_examples=examples(300), deadline=None)
@given(_values, st.booleans())
def test_every_json_value_parses_alike(value, ascii_only):
    same(json.dumps(value, ensure_ascii=ascii_only))


@settings(max_examples=examples(400), deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-truefalsn \t\r\n\x0c\\/uINaf\x00\ud800\u00e9', max_size=30))
def test_any_text_of_json_characters_gets_the_same_value_or_refusal(text):
    same(text)


@pytest.mark.parametrize("text", [
    "NaN", "Infinity", "-Infinity", "[NaN]", '{"a":Infinity}', "1e400", "-1e400", "1e-400", "1" * 4301, "1" * 4300,
    "0." + "1" * 5000, '"\\ud800"', '"\\udc00\\ud800"', "\ufeff{}", '{"a":1,"a":2}', '{"a":1} x', "[1,]", "01",
    "[" * 3000 + "]" * 3000, '"a\x01b"', '"\\u0000"', " \t\r\n{}\n", "\x0c{}", "1.", ".5", "-0", "-0.0", "1E5",
    '{"arrays":[],"body":{"input_wait_s":1e-07}}', "18446744073709551616", "-9223372036854775809",
])
def test_edge_cases_parse_alike(text):
    same(text)


def test_a_refused_constant_still_names_itself_through_the_header_parser():
    with pytest.raises(WireError) as err:
        decoding.parse_header(b'{"proto":1,"kind":"GET","body":{"x":NaN}}', protocol.Limits())
    assert err.value.code == errorcodes.E_MALFORMED and "NaN" in str(err.value)
