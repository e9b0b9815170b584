"""The wire format (the sluice.wire package): golden headers, zero-copy arrays, and every refusal code."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, encoding, errorcodes, protocol, runtoken

DS = "b3:" + "0" * 64

# Golden frame-0 bytes: a change to the header encoding must change these on purpose
# (and docs/protocol.md with them).
GOLDEN_GET = (
    b'{"arrays":[],"body":{"input_wait_s":0.001,"samples":false},"dataset_id":"b3:'
    + b"0" * 64
    + b'","generation":3,"instance":"","kind":"GET","micro":0,"proto":1,"replica":1,"request_id":7,'
    b'"run_id":"r1","step":12}'
)
GOLDEN_BATCH = (
    b'{"arrays":[{"dtype":"<i4","name":"input_ids","shape":[2,4]},{"dtype":"<i4","name":"cu_seqlens","shape":[2]}],'
    b'"body":{"micro_per_step":2},"dataset_id":"b3:'
    + b"0" * 64
    + b'","generation":3,"instance":"i-1","kind":"BATCH","micro":1,"proto":1,"replica":1,"request_id":7,'
    b'"run_id":"r1","step":12}'
)
GOLDEN_FENCED = (
    b'{"arrays":[],"body":{"code":"FENCED","in_reply_to":"GET","message":"old"},"dataset_id":"b3:'
    + b"0" * 64
    + b'","generation":3,"instance":"i-1","kind":"ERROR","micro":0,"proto":1,"replica":1,"request_id":7,'
    b'"run_id":"r1","step":12}'
)


def _get() -> protocol.Header:
    return protocol.Header(kind=protocol.GET, run_id="r1", dataset_id=DS, generation=3, replica=1, step=12, micro=0,
                           request_id=7, body={"input_wait_s": 0.001, "samples": False})


def test_golden_headers():
    assert encoding.encode(_get())[0] == GOLDEN_GET
    batch = protocol.Header(kind=protocol.BATCH, run_id="r1", dataset_id=DS, generation=3, replica=1, step=12, micro=1,
                            request_id=7, instance="i-1", body={"micro_per_step": 2})
    frames = encoding.encode(batch, {"input_ids": np.zeros((2, 4), "<i4"), "cu_seqlens": np.array([0, 8], "<i4")})
    assert frames[0] == GOLDEN_BATCH and len(frames) == 3
    fenced = errorcodes.error_reply(_get(), errorcodes.E_FENCED, "old", instance="i-1")
    assert encoding.encode(fenced)[0] == GOLDEN_FENCED
    # and they parse back to the same headers
    assert decoding.parse_header(GOLDEN_GET, protocol.Limits()) == _get()


def test_arrays_cross_a_real_socket_without_copies():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        ids = np.arange(4 * 4096, dtype=np.int32).reshape(4, 4096)
        cu = np.array([0, 100, 16384], dtype=np.int32)
        a.send_multipart(encoding.encode(_get(), {"input_ids": ids, "cu_seqlens": cu}), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        msg = decoding.decode(frames, protocol.Limits.for_client())
        got = msg.arrays["input_ids"]
        assert got.dtype == np.dtype("<i4") and got.shape == (4, 4096)
        np.testing.assert_array_equal(got, ids)
        np.testing.assert_array_equal(msg.arrays["cu_seqlens"], cu)
        # a view on the received frame's buffer, not an owned copy
        assert not got.flags.owndata
        assert np.shares_memory(got, np.frombuffer(frames[1].buffer, dtype=np.uint8))
        tensors = decoding.to_tensors(msg.arrays)
        import torch

        assert isinstance(tensors["input_ids"], torch.Tensor)
        assert tensors["input_ids"].data_ptr() == got.ctypes.data  # shares memory with the frame
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _frames(header: dict | bytes, *arrays: bytes) -> list[bytes]:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [head, *arrays]


def _base(**kw) -> dict:
    obj = json.loads(GOLDEN_GET)
    obj.update(kw)
    return obj


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([], errorcodes.E_TRUNCATED),
        ([b"\xff\xfe"], errorcodes.E_MALFORMED),
        ([b"[1,2]"], errorcodes.E_MALFORMED),
        ([b'{"proto": NaN}'], errorcodes.E_MALFORMED),
        (_frames(_base(proto=2)), errorcodes.E_VERSION),
        (_frames(_base(proto=True)), errorcodes.E_VERSION),
        (_frames(_base(kind="PICKLE")), errorcodes.E_UNKNOWN_KIND),
        (_frames(_base(extra=1)), errorcodes.E_MALFORMED),
        (_frames(_base(step="12")), errorcodes.E_MALFORMED),
        (_frames(_base(generation=-1)), errorcodes.E_MALFORMED),
        (_frames(_base(body=[1])), errorcodes.E_MALFORMED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [2]}])), errorcodes.E_TRUNCATED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [2]}]), b"\x00" * 7), errorcodes.E_TRUNCATED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "O", "shape": [1]}]), b"\x00" * 8), errorcodes.E_BAD_ARRAY),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [-1]}]), b""), errorcodes.E_BAD_ARRAY),
        (_frames(_base(), b"\x00" * 4), errorcodes.E_TRUNCATED),
        (_frames(_base(), *[b""] * 9), errorcodes.E_TOO_MANY_FRAMES),
        ([b" " * (4 << 20) + b"{}"], errorcodes.E_OVERSIZED),
    ],
)
def test_every_defect_has_a_code(frames, code):
    with pytest.raises(WireError) as info:
        decoding.decode(frames, protocol.Limits())
    assert info.value.code == code
    assert code in errorcodes.ERROR_CODES


def test_oversized_array_frame_refused_before_parsing():
    limits = protocol.Limits(max_frame_bytes=1024)
    big = _frames(_base(arrays=[{"name": "x", "dtype": "|u1", "shape": [2048]}]), b"\x00" * 2048)
    with pytest.raises(WireError) as info:
        decoding.decode(big, limits)
    assert info.value.code == errorcodes.E_OVERSIZED


def test_encode_refuses_dtypes_outside_the_whitelist():
    with pytest.raises(WireError) as info:
        encoding.encode(_get(), {"x": np.zeros(3, dtype=np.float64)})
    assert info.value.code == errorcodes.E_BAD_ARRAY
    # big-endian input is converted to the little-endian wire form
    frames = encoding.encode(_get(), {"x": np.arange(3, dtype=">i4")})
    msg = decoding.decode(frames, protocol.Limits())
    np.testing.assert_array_equal(msg.arrays["x"], [0, 1, 2])


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=10))
def test_random_frames_only_ever_raise_wire_errors(frames):
    try:
        decoding.decode(frames, protocol.Limits())
    except WireError as exc:
        assert exc.code in errorcodes.ERROR_CODES


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(0, len(GOLDEN_BATCH)), st.integers(0, 40))
def test_truncated_golden_batch_is_refused_or_exact(cut, data_len):
    frames = [GOLDEN_BATCH[:cut], b"\x00" * data_len, b"\x00" * 8]
    try:
        msg = decoding.decode(frames, protocol.Limits())
    except WireError as exc:
        assert exc.code in errorcodes.ERROR_CODES
    else:  # only the complete header with exactly 32 bytes of input_ids decodes
        assert cut == len(GOLDEN_BATCH) and data_len == 32
        assert msg.arrays["input_ids"].shape == (2, 4)


def test_every_error_code_maps_to_one_exception_and_back():
    from sluice.errors import DaemonError, FencedError, SluiceError, SourceReadError, StateError, WireError

    for code in errorcodes.ERROR_CODES:
        reply = protocol.Message(errorcodes.error_reply(_get(), code, "why"), {})
        exc = errorcodes.exception_for(reply)
        assert isinstance(exc, SluiceError) and "why" in str(exc)
        if isinstance(exc, DaemonError):  # the generic case keeps code, step and replica as fields
            assert (exc.code, exc.step, exc.replica) == (code, 12, 1)
        else:  # the typed ones map back to the same code on the daemon side
            assert errorcodes.code_for(exc) == code
    def reply(code: str, message: str, **extra) -> protocol.Message:
        return protocol.Message(errorcodes.error_reply(_get(), code, message, **extra), {})

    assert isinstance(errorcodes.exception_for(reply(errorcodes.E_FENCED, "x")), FencedError)
    assert isinstance(errorcodes.exception_for(reply(errorcodes.E_BAD_STATE, "x")), StateError)
    obj = reply(errorcodes.E_OBJECT, "bad bytes", object="s/0.jsonl")
    assert isinstance(errorcodes.exception_for(obj), SourceReadError)
    assert "s/0.jsonl" in str(errorcodes.exception_for(obj))
    assert errorcodes.code_for(WireError(errorcodes.E_OVERSIZED, "big")) == errorcodes.E_OVERSIZED
    assert errorcodes.code_for(SluiceError("anything else")) == errorcodes.E_INTERNAL


def test_an_unknown_error_code_is_a_bug_in_sluice():
    from sluice.errors import InternalError

    with pytest.raises(InternalError, match="bug in sluice: unknown error code 'NOPE'"):
        errorcodes.error_reply(_get(), "NOPE", "x")


def test_run_token_rules(tmp_path):
    from sluice.errors import SpecError

    token = "a" * 16
    assert runtoken.token_matches(token, token)
    for given_ in (None, "", "a" * 15, "a" * 17, "b" * 16, 16, ["a" * 16], "x" * 10_000):
        assert not runtoken.token_matches(token, given_)
    for bad in ("short", "a" * 257, "with space" * 3, "é" * 20):
        with pytest.raises(SpecError, match="a run token must be 16 to 256 printable ASCII"):
            runtoken.check_token(bad, "t")
    f = tmp_path / "token"
    f.write_text(token + "\n")
    f.chmod(0o600)
    assert runtoken.read_token_file(str(f)) == token
    f.chmod(0o640)
    with pytest.raises(SpecError, match="mode 0640 lets other users read it"):
        runtoken.read_token_file(str(f))
    with pytest.raises(SpecError, match="cannot open"):
        runtoken.read_token_file(str(tmp_path / "missing"))
    (tmp_path / "d").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block an open without O_NONBLOCK
    for odd in ("d", "fifo"):
        with pytest.raises(SpecError, match="not a regular file"):
            runtoken.read_token_file(str(tmp_path / odd))
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(SpecError, match="cannot open"):
        runtoken.read_token_file(str(tmp_path / "link"))
