"""Spec: a header whose array specs were seen before parses to the same Header, or the same refusal, with
msgspec's typed decode of its rest (`decoding._REST`, the "fast" extra) as with the stdlib parse and the
field checks alone.

The typed decode only accepts; whatever it refuses goes to the checks, so the two paths must agree on
every header: the one a daemon or client sends, and every field of it made odd (wrong types, bounds,
lengths, duplicated or unknown keys, a second "arrays", bad UTF-8).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, protocol

pytestmark = pytest.mark.skipif(decoding._REST is None, reason="msgspec (the fast extra) not installed")

SPECS = b'[{"dtype":"<i4","name":"input_ids","shape":[2,3]}]'
LIMITS = protocol.Limits.for_client()


def outcome(raw: bytes):
    try:
        h, layout = decoding._parse_header(raw, LIMITS)
    except WireError as exc:
        return ("error", exc.code, str(exc))
    return ("header", tuple((k, type(v).__name__, repr(v)) for k, v in sorted(vars(h).items())), layout)


def both(raw: bytes):
    decoding._parse_header(b'{"arrays":' + SPECS + b',"body":{},"dataset_id":"d","generation":0,"instance":"",'
                           b'"kind":"BATCH","micro":0,"proto":1,"replica":0,"request_id":1,"run_id":"r","step":0}',
                           LIMITS)  # the specs are now kept: the fast path applies to `raw`
    fast = outcome(raw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decoding, "_REST", None)
        slow = outcome(raw)
    assert fast == slow, raw[:300]
    return fast


def header_bytes(fields: dict, *, specs: bytes = SPECS) -> bytes:
    rest = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)[1:]
    return b'{"arrays":' + specs + (b"," + rest.encode("utf-8", "surrogatepass") if fields else b"}")


GOOD = {"body": {"micro_per_step": 1, "state": {"step": 4, "lanes": {"0": [1, 2]}}}, "dataset_id": "b3:abc",
        "generation": 3, "instance": "12-ab", "kind": "BATCH", "micro": 0, "proto": 1, "replica": 0,
        "request_id": 7, "run_id": "r1", "step": 4}


def test_a_daemons_header_takes_the_typed_path_and_parses_to_the_same_header(monkeypatch):
    got = both(header_bytes(GOOD))
    assert got[0] == "header"
    calls = []
    real = decoding._REST

    class Spy:
        def decode(self, data):
            calls.append(data)
            return real.decode(data)

    monkeypatch.setattr(decoding, "_REST", Spy())
    decoding._parse_header(header_bytes(GOOD), LIMITS)
    assert calls, "a kept-specs header must be decoded by the typed path"


_odd_values = (st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
               | st.sampled_from([2**62 - 1, 2**62, -1, -2, 0, 1.0, 1e3, -0.0, "1", "", "é" * 256, "é" * 257,
                                  "x" * 256, "x" * 257, "\ud800", [], {}, {"a": 1}, [1]])
               | st.text(max_size=12))


@settings(max_examples=examples(400), deadline=None)
@given(st.sampled_from(sorted(GOOD) + ["arrays", "extra"]), _odd_values)
def test_any_field_made_odd_gets_the_same_header_or_refusal(key, value):
    fields = dict(GOOD)
    fields[key] = value
    both(header_bytes(fields))


@settings(max_examples=examples(200), deadline=None)
@given(st.sets(st.sampled_from(sorted(GOOD)), max_size=3))
def test_missing_fields_get_the_same_refusal(missing):
    both(header_bytes({k: v for k, v in GOOD.items() if k not in missing}))


@pytest.mark.parametrize("raw", [
    header_bytes(GOOD)[:-1] + b',"step":5}',                          # a duplicated key: the last counts
    header_bytes(GOOD)[:-1] + b',"arrays":[]}',                        # a second "arrays"
    header_bytes(GOOD).replace(b'"r1"', b'"r\xff"'),                   # not UTF-8
    header_bytes(GOOD).replace(b'"r1"', b'"\\ud800"'),                 # a lone surrogate escape
    header_bytes(GOOD).replace(b'"micro_per_step":1', b'"m":NaN'),     # NaN in the body
    header_bytes(GOOD).replace(b'"proto":1', b'"proto":1.0'),          # 1.0 == 1 to the checks
    header_bytes(GOOD).replace(b'"proto":1', b'"proto":true'),
    header_bytes(GOOD).replace(b'"step":4', b'"step":4.0'),
    header_bytes(GOOD).replace(b'"step":4', b'"step":1e2'),
    header_bytes(GOOD).replace(b'"body":{', b'"body":[{').replace(b'},"dataset_id"', b'}],"dataset_id"'),
    header_bytes(GOOD) + b" ",
    header_bytes(GOOD) + b"x",
    header_bytes(GOOD)[:-1],
])
def test_odd_texts_get_the_same_header_or_refusal(raw):
    both(raw)
