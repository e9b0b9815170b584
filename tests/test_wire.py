"""The wire format (sluice/wire.py): golden headers, zero-copy arrays, and every refusal code."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice import wire

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


def _get() -> wire.Header:
    return wire.Header(kind=wire.GET, run_id="r1", dataset_id=DS, generation=3, replica=1, step=12, micro=0,
                       request_id=7, body={"input_wait_s": 0.001, "samples": False})


def test_golden_headers():
    assert wire.encode(_get())[0] == GOLDEN_GET
    batch = wire.Header(kind=wire.BATCH, run_id="r1", dataset_id=DS, generation=3, replica=1, step=12, micro=1,
                        request_id=7, instance="i-1", body={"micro_per_step": 2})
    frames = wire.encode(batch, {"input_ids": np.zeros((2, 4), "<i4"), "cu_seqlens": np.array([0, 8], "<i4")})
    assert frames[0] == GOLDEN_BATCH and len(frames) == 3
    assert wire.encode(wire.error_reply(_get(), wire.E_FENCED, "old", instance="i-1"))[0] == GOLDEN_FENCED
    # and they parse back to the same headers
    assert wire.parse_header(GOLDEN_GET, wire.Limits()) == _get()


def test_arrays_cross_a_real_socket_without_copies():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        ids = np.arange(4 * 4096, dtype=np.int32).reshape(4, 4096)
        cu = np.array([0, 100, 16384], dtype=np.int32)
        a.send_multipart(wire.encode(_get(), {"input_ids": ids, "cu_seqlens": cu}), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        msg = wire.decode(frames, wire.Limits.for_client())
        got = msg.arrays["input_ids"]
        assert got.dtype == np.dtype("<i4") and got.shape == (4, 4096)
        np.testing.assert_array_equal(got, ids)
        np.testing.assert_array_equal(msg.arrays["cu_seqlens"], cu)
        # a view on the received frame's buffer, not an owned copy
        assert not got.flags.owndata
        assert np.shares_memory(got, np.frombuffer(frames[1].buffer, dtype=np.uint8))
        tensors = wire.to_tensors(msg.arrays)
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
        ([], wire.E_TRUNCATED),
        ([b"\xff\xfe"], wire.E_MALFORMED),
        ([b"[1,2]"], wire.E_MALFORMED),
        ([b'{"proto": NaN}'], wire.E_MALFORMED),
        (_frames(_base(proto=2)), wire.E_VERSION),
        (_frames(_base(proto=True)), wire.E_VERSION),
        (_frames(_base(kind="PICKLE")), wire.E_UNKNOWN_KIND),
        (_frames(_base(extra=1)), wire.E_MALFORMED),
        (_frames(_base(step="12")), wire.E_MALFORMED),
        (_frames(_base(generation=-1)), wire.E_MALFORMED),
        (_frames(_base(body=[1])), wire.E_MALFORMED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [2]}])), wire.E_TRUNCATED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [2]}]), b"\x00" * 7), wire.E_TRUNCATED),
        (_frames(_base(arrays=[{"name": "x", "dtype": "O", "shape": [1]}]), b"\x00" * 8), wire.E_BAD_ARRAY),
        (_frames(_base(arrays=[{"name": "x", "dtype": "<i4", "shape": [-1]}]), b""), wire.E_BAD_ARRAY),
        (_frames(_base(), b"\x00" * 4), wire.E_TRUNCATED),
        (_frames(_base(), *[b""] * 9), wire.E_TOO_MANY_FRAMES),
        ([b" " * (4 << 20) + b"{}"], wire.E_OVERSIZED),
    ],
)
def test_every_defect_has_a_code(frames, code):
    with pytest.raises(wire.WireError) as info:
        wire.decode(frames, wire.Limits())
    assert info.value.code == code
    assert code in wire.ERROR_CODES


def test_oversized_array_frame_refused_before_parsing():
    limits = wire.Limits(max_frame_bytes=1024)
    big = _frames(_base(arrays=[{"name": "x", "dtype": "|u1", "shape": [2048]}]), b"\x00" * 2048)
    with pytest.raises(wire.WireError) as info:
        wire.decode(big, limits)
    assert info.value.code == wire.E_OVERSIZED


def test_encode_refuses_dtypes_outside_the_whitelist():
    with pytest.raises(wire.WireError) as info:
        wire.encode(_get(), {"x": np.zeros(3, dtype=np.float64)})
    assert info.value.code == wire.E_BAD_ARRAY
    # big-endian input is converted to the little-endian wire form
    frames = wire.encode(_get(), {"x": np.arange(3, dtype=">i4")})
    msg = wire.decode(frames, wire.Limits())
    np.testing.assert_array_equal(msg.arrays["x"], [0, 1, 2])


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=10))
def test_random_frames_only_ever_raise_wire_errors(frames):
    try:
        wire.decode(frames, wire.Limits())
    except wire.WireError as exc:
        assert exc.code in wire.ERROR_CODES


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(0, len(GOLDEN_BATCH)), st.integers(0, 40))
def test_truncated_golden_batch_is_refused_or_exact(cut, data_len):
    frames = [GOLDEN_BATCH[:cut], b"\x00" * data_len, b"\x00" * 8]
    try:
        msg = wire.decode(frames, wire.Limits())
    except wire.WireError as exc:
        assert exc.code in wire.ERROR_CODES
    else:  # only the complete header with exactly 32 bytes of input_ids decodes
        assert cut == len(GOLDEN_BATCH) and data_len == 32
        assert msg.arrays["input_ids"].shape == (2, 4)


def test_every_error_code_maps_to_one_exception_and_back():
    from sluice.errors import DaemonError, FencedError, SluiceError, SourceReadError, StateError, WireError

    for code in wire.ERROR_CODES:
        reply = wire.Message(wire.error_reply(_get(), code, "why"), {})
        exc = wire.exception_for(reply)
        assert isinstance(exc, SluiceError) and "why" in str(exc)
        if isinstance(exc, DaemonError):  # the generic case keeps code, step and replica as fields
            assert (exc.code, exc.step, exc.replica) == (code, 12, 1)
        else:  # the typed ones map back to the same code on the daemon side
            assert wire.code_for(exc) == code
    assert isinstance(wire.exception_for(wire.Message(wire.error_reply(_get(), wire.E_FENCED, "x"), {})), FencedError)
    assert isinstance(wire.exception_for(wire.Message(wire.error_reply(_get(), wire.E_BAD_STATE, "x"), {})), StateError)
    obj = wire.Message(wire.error_reply(_get(), wire.E_OBJECT, "bad bytes", object="s/0.jsonl"), {})
    assert isinstance(wire.exception_for(obj), SourceReadError) and "s/0.jsonl" in str(wire.exception_for(obj))
    assert wire.code_for(WireError(wire.E_OVERSIZED, "big")) == wire.E_OVERSIZED
    assert wire.code_for(SluiceError("anything else")) == wire.E_INTERNAL


def test_an_unknown_error_code_is_a_bug_in_sluice():
    from sluice.errors import InternalError

    with pytest.raises(InternalError, match="bug in sluice: unknown error code 'NOPE'"):
        wire.error_reply(_get(), "NOPE", "x")


def test_run_token_rules(tmp_path):
    from sluice.errors import SpecError

    token = "a" * 16
    assert wire.token_matches(token, token)
    for given_ in (None, "", "a" * 15, "a" * 17, "b" * 16, 16, ["a" * 16], "x" * 10_000):
        assert not wire.token_matches(token, given_)
    for bad in ("short", "a" * 257, "with space" * 3, "é" * 20):
        with pytest.raises(SpecError, match="a run token must be 16 to 256 printable ASCII"):
            wire.check_token(bad, "t")
    f = tmp_path / "token"
    f.write_text(token + "\n")
    f.chmod(0o600)
    assert wire.read_token_file(str(f)) == token
    f.chmod(0o640)
    with pytest.raises(SpecError, match="mode 0640 lets other users read it"):
        wire.read_token_file(str(f))
    with pytest.raises(SpecError, match="cannot open"):
        wire.read_token_file(str(tmp_path / "missing"))
    (tmp_path / "d").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block an open without O_NONBLOCK
    for odd in ("d", "fifo"):
        with pytest.raises(SpecError, match="not a regular file"):
            wire.read_token_file(str(tmp_path / odd))
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(SpecError, match="cannot open"):
        wire.read_token_file(str(tmp_path / "link"))
