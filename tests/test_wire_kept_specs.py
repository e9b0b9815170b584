"""A receiver that kept an "arrays" value it validated before refuses exactly what a fresh one refuses.

`decoding.decode` skips parsing and checking a BATCH header's arrays when their
exact bytes were validated before (the daemon's headers start with them). The
fast path must be invisible: for any frames, a warm decoder (the valid
message's arrays kept) and a cold one (nothing kept) return the same message
or raise the same WireError code and text.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, encoding, errorcodes, protocol

LIMITS = protocol.Limits.for_client()


def _valid() -> list[bytes]:
    arrays = {"input_ids": np.arange(8, dtype="<i4").reshape(2, 4), "labels": np.zeros((2, 4), dtype="<i4"),
              "cu_seqlens": np.array([0, 3, 8], dtype="<i4")}
    heads = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=2, replica=0, instance="i-1")
    body = encoding.BatchHeaders.body(1, state=encoding.json_bytes({"step": 4, "kind": "sluice.data-state"}))
    return [bytes(memoryview(f)) for f in heads.frames(step=4, micro=0, request_id=9, body=body, arrays=arrays)]


def _outcome(frames: list[bytes], limits: protocol.Limits, warm: bool) -> object:
    decoding._SPECS.clear()
    if warm:
        decoding.decode(_valid(), LIMITS)
        assert decoding._SPECS, "the valid BATCH header's arrays were not kept"
    try:
        msg = decoding.decode(frames, limits)
    except WireError as exc:
        return ("refused", exc.code, str(exc))
    return ("ok", msg.header, {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in msg.arrays.items()})


def _same(frames: list[bytes], limits: protocol.Limits = LIMITS) -> object:
    cold, warm = _outcome(frames, limits, False), _outcome(frames, limits, True)
    assert warm == cold
    return warm


def test_a_kept_layout_decodes_the_same_message_as_a_fresh_parse():
    assert _same(_valid())[0] == "ok"


@pytest.mark.parametrize("tail, code", [
    (b'{"micro_per_step":1},"arrays":[],"dataset_id":"d","generation":2,"instance":"i-1","kind":"BATCH",'
     b'"micro":0,"proto":1,"replica":0,"request_id":9,"run_id":"r","step":4}', errorcodes.E_TRUNCATED),  # arrays twice
    (b'[1],"dataset_id":"d","generation":2,"instance":"i-1","kind":"BATCH","micro":0,"proto":1,"replica":0,'
     b'"request_id":9,"run_id":"r","step":4}', errorcodes.E_MALFORMED),  # body not an object
    (b'{},"dataset_id":"d","generation":2,"instance":"i-1","kind":"NOPE","micro":0,"proto":1,"replica":0,'
     b'"request_id":9,"run_id":"r","step":4}', errorcodes.E_UNKNOWN_KIND),
    (b'{},"dataset_id":"d","generation":2,"instance":"i-1","kind":"BATCH","micro":0,"proto":2,"replica":0,'
     b'"request_id":9,"run_id":"r","step":4}', errorcodes.E_VERSION),
    (b'{},"dataset_id":"d","generation":2,"instance":"i-1","kind":"BATCH","micro":0,"proto":1,"replica":0,'
     b'"request_id":true,"run_id":"r","step":4}', errorcodes.E_MALFORMED),
    (b'{},"extra":1,"dataset_id":"d","generation":2,"instance":"i-1","kind":"BATCH","micro":0,"proto":1,'
     b'"replica":0,"request_id":9,"run_id":"r","step":4}', errorcodes.E_MALFORMED),
    (b'{},"dataset_id":"\xff","generation":2}', errorcodes.E_MALFORMED),  # not UTF-8
    (b'{}', errorcodes.E_MALFORMED),  # truncated JSON
])
def test_kept_arrays_with_a_bad_rest_are_refused_as_before(tail, code):
    frames = _valid()
    head = frames[0]
    cut = head.index(b',"body":') + len(b',"body":')
    got = _same([head[:cut] + tail, *frames[1:]])
    assert got[0] == "refused" and got[1] == code


def test_wrong_frames_under_kept_arrays_are_refused_as_before():
    frames = _valid()
    assert _same([frames[0], frames[1][:-4], *frames[2:]])[1] == errorcodes.E_TRUNCATED  # a short array frame
    assert _same(frames[:-1])[1] == errorcodes.E_TRUNCATED  # a missing frame
    assert _same([*frames, b"x"])[1] == errorcodes.E_TRUNCATED  # an extra frame
    assert _same(frames, protocol.Limits(max_header_bytes=1 << 20, max_frames=3, max_frame_bytes=1 << 20))[1] in (
        errorcodes.E_TOO_MANY_FRAMES,)  # a receiver allowing fewer arrays than the kept layout lists


def test_a_repeated_array_name_is_refused_on_every_decode():
    frames = _valid()
    head = frames[0].replace(b'"name":"labels"', b'"name":"input_ids"')
    for _ in range(2):  # the second decode meets the kept layout
        with pytest.raises(WireError, match="listed twice"):
            decoding.decode([head, *frames[1:]], LIMITS)
    assert _same([head, *frames[1:]])[1] == errorcodes.E_MALFORMED


@settings(max_examples=examples(150), deadline=None)
@given(data=st.data())
def test_any_byte_edit_of_a_batch_header_gets_the_same_answer_warm_or_cold(data):
    frames = _valid()
    head = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(head) - 1))
        op = data.draw(st.sampled_from(["set", "del", "ins"]))
        byte = data.draw(st.sampled_from(b'{}[],:"0129aA\\ \xff'))
        if op == "set":
            head[at] = byte
        elif op == "del":
            del head[at]
        else:
            head.insert(at, byte)
    _same([bytes(head), *frames[1:]])


def test_the_kept_layouts_are_bounded():
    decoding._SPECS.clear()
    heads = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=2, replica=0, instance="i-1")
    for n in range(decoding._SPECS_KEPT + 5):  # one distinct cu_seqlens length per message
        decoding.decode(heads.frames(step=n, micro=0, request_id=n + 1, body=encoding.BatchHeaders.body(1),
                                     arrays={"cu_seqlens": np.zeros(n, dtype="<i4")}), LIMITS)
        assert len(decoding._SPECS) <= decoding._SPECS_KEPT
