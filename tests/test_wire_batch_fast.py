"""Spec: `decoding.decode_batch` (the client's one typed pass over a BATCH) takes only what `decoding.decode`
accepts and reads the same values from it; anything else is None, left to `decode` to decide or refuse.

Same values: every header field, the body's micro_per_step and samples, the arrays (dtype, shape, bytes),
and the data state, which it leaves as JSON bytes that `decoding.json_value` decodes to `decode`'s value.
Frames that do not match a header it took raise `decode`'s WireError. The headers are the daemon's
(`encoding.BatchHeaders`, packed or not) and each made odd: a field's type or bound, an unknown or
duplicated key, another kind, a non-ASCII or malformed state, arrays not validated yet.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, encoding, errorcodes, protocol

pytestmark = pytest.mark.skipif(decoding._BATCH is None, reason="msgspec (the fast extra) not installed")

LIMITS = protocol.Limits.for_client()
STATE = {"dataset_id": "b3:d", "kind": "sluice.data-state", "lanes": {"0": {"draws": 3, "rows": [1, 2]}},
         "schema": 2, "step": 4}


def _frames(*, packed: bool = True, state: bytes | None = None, samples: bytes | None = None,
            micro_per_step: int = 1) -> list[bytes]:
    block = np.arange(3 * 2 * 8, dtype="<i4").reshape(3, 2, 8)
    arrays = {"input_ids": block[0], "labels": block[1], "position_ids": block[2],
              "cu_seqlens": np.array([0, 8, 16], dtype="<i4")}
    headers = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=2, replica=0, instance="i-1")
    body = headers.body(micro_per_step, samples, encoding.json_bytes(STATE) if state is None else state)
    frames = headers.frames(step=4, micro=0, request_id=9, body=body, arrays=arrays,
                            pack_below=1 << 20 if packed else 0)
    return [bytes(memoryview(f).cast("B")) for f in frames]


def _compare(frames: list[bytes]) -> object:
    """`decode_batch`'s answer checked against `decode`'s; returns what decode_batch did ("fast"/"left"/"refused")."""
    try:
        want = decoding.decode(frames, LIMITS)  # (also keeps the arrays' layout, as the client's first reply does)
    except WireError as exc:
        want = exc
    try:
        got = decoding.decode_batch(frames, LIMITS)
    except WireError as exc:
        assert isinstance(want, WireError) and (exc.code, str(exc)) == (want.code, str(want))
        return "refused"
    if got is None:
        return "left"
    assert not isinstance(want, WireError), want
    fields, state, arrays = got
    h = want.header
    assert (want.kind, fields.run_id, fields.dataset_id, fields.generation, fields.replica, fields.step,
            fields.micro, fields.request_id, fields.instance) == (
        protocol.BATCH, h.run_id, h.dataset_id, h.generation, h.replica, h.step, h.micro, h.request_id, h.instance)
    assert fields.body.micro_per_step == want.body["micro_per_step"]
    assert ("samples" in want.body) == isinstance(fields.body.samples, list)
    if "samples" in want.body:
        assert fields.body.samples == want.body["samples"]
    assert ("state" in want.body) == (state is not None)
    if state is not None:
        assert decoding.json_value(state) == want.body["state"]
    assert {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()} == {
        k: (v.dtype.str, v.shape, v.tobytes()) for k, v in want.arrays.items()}
    return "fast"


@pytest.mark.parametrize("packed", [True, False])
def test_the_daemons_batch_takes_the_fast_path_with_the_same_values(packed):
    frames = _frames(packed=packed, samples=encoding.json_bytes(["a/1", "b/2"]))
    decoding._SPECS.clear()
    assert decoding.decode_batch(frames, LIMITS) is None  # arrays not validated yet: left to decode
    assert _compare(frames) == "fast"  # (decode kept them)
    assert _compare(_frames(packed=packed, state=None, micro_per_step=3)) == "fast"


def test_a_batch_without_a_state_has_none():
    headers = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=0, replica=0, instance="i")
    frames = [bytes(memoryview(f).cast("B")) for f in headers.frames(
        step=0, micro=0, request_id=1, body=headers.body(2), arrays={"input_ids": np.zeros((1, 2), "<i4")})]
    assert _compare(frames) == "fast"
    assert decoding.decode_batch(frames, LIMITS)[1] is None


@pytest.mark.parametrize("edit, path", [
    (lambda h: h.replace(b'"kind":"BATCH"', b'"kind":"STATS_OK"'), "left"),
    (lambda h: h.replace(b'"generation":2', b'"generation":-1'), "left"),
    (lambda h: h.replace(b'"generation":2', b'"generation":2.0'), "left"),
    (lambda h: h.replace(b'"request_id":9', b'"request_id":true'), "left"),
    (lambda h: h.replace(b'"proto":1', b'"proto":2'), "left"),
    (lambda h: h.replace(b'"run_id":"r"', b'"run_id":"' + b"r" * 300 + b'"'), "left"),
    (lambda h: h.replace(b'"micro_per_step":1', b'"micro_per_step":"1"'), "left"),
    (lambda h: h.replace(b'"micro_per_step":1', b'"micro_per_step":1,"extra":0'), "left"),
    (lambda h: h.replace(b'"micro_per_step":1', b'"micro_per_step":1,"samples":null'), "left"),
    (lambda h: h.replace(b'"micro_per_step":1', b'"micro_per_step":1,"samples":[1]'), "left"),
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":"\xc3\xa9"}', 1), "left"),  # non-ASCII in the state
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":"\xff"}', 1), "left"),  # not UTF-8 in the state
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":1e999}', 1), "fast"),  # out of a float's range: the stdlib's inf
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":"\\ud800"}', 1), "left"),  # a lone surrogate: the stdlib takes it
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":NaN}', 1), "left"),
    (lambda h: h.replace(b'"step":4}', b'"step":4,"x":[1,]}', 1), "left"),
    (lambda h: h.replace(b'"schema":2', b'"schema":2,"step":3', 1), "fast"),  # a repeated key: the last wins
    (lambda h: h.replace(b'"instance":"i-1"', b'"instance":"i-1","instance":"i-2"'), "fast"),
    (lambda h: h.replace(b'"instance":"i-1"', b'"instance":"i-1","extra":0'), "left"),
    (lambda h: h.replace(b'{"arrays":', b'{"arrays":[],"arrays":', 1), "fast"),  # arrays twice: the last wins
    (lambda h: h.replace(b'"body":{', b'"body":{"micro_per_step":0,', 1), "fast"),
    (lambda h: h[:-1], "left"),
    (lambda h: h + b" ", "fast"),
    (lambda h: h.replace(b',"dataset_id"', b' , "dataset_id"'), "fast"),
])
def test_an_odd_header_gets_decodes_answer(edit, path):
    frames = _frames()
    _compare(frames)  # the arrays are kept
    assert _compare([edit(frames[0]), *frames[1:]]) == path


def test_frames_that_do_not_match_the_header_raise_decodes_error():
    frames = _frames()
    _compare(frames)
    assert _compare([frames[0], frames[1][:-4], frames[2]]) == "refused"
    assert _compare([frames[0], frames[1]]) == "refused"
    with pytest.raises(WireError) as got:
        decoding.decode_batch([frames[0], frames[1][:-4], frames[2]], LIMITS)
    assert got.value.code == errorcodes.E_TRUNCATED


def test_limits_leave_the_message_to_decode():
    frames = _frames()
    _compare(frames)
    tight = protocol.Limits(max_header_bytes=100, max_frames=16, max_frame_bytes=1 << 20)
    assert decoding.decode_batch(frames, tight) is None
    assert decoding.decode_batch(frames, protocol.Limits(max_frames=2, max_frame_bytes=1 << 20,
                                                         max_header_bytes=1 << 20)) is None
    assert decoding.decode_batch(frames, protocol.Limits(max_frames=16, max_frame_bytes=64,
                                                         max_header_bytes=1 << 20)) is None


json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


@settings(max_examples=examples(150), deadline=None)
@given(state=st.dictionaries(st.text(max_size=6), json_value, max_size=4), ascii_only=st.booleans(),
       spaces=st.booleans())
def test_any_state_reads_as_decode_reads_it(state, ascii_only, spaces):
    text = json.dumps(state, ensure_ascii=ascii_only, separators=(", ", ": ") if spaces else (",", ":"))
    frames = _frames(state=text.encode("utf-8", "surrogatepass"))
    _compare(_frames())
    _compare(frames)
