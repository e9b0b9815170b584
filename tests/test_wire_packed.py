"""Spec: packed BATCH frames (a GET with body `packed`: docs/protocol.md, "Messages").

The daemon puts a micro-batch's arrays that lie back to back in one buffer (its ids, labels and
position ids: rows of the producer's step block) in one frame; the receiver maps arrays to frames by
their sizes: a frame of n bytes holds the next arrays in order, at least one, then more while they sum
under n, and they must sum to n. One array per frame is the case where each frame holds one, so every
unpacked message decodes as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import WireError
from sluice.wire import decoding, encoding, errorcodes, protocol

LIMIT = 512 << 10


def _heads() -> encoding.BatchHeaders:
    return encoding.BatchHeaders(run_id="r", dataset_id="d", generation=1, replica=0, instance="i")


def _micro(block: np.ndarray, j: int, r0: int, r1: int, segs: int = 3) -> dict[str, np.ndarray]:
    """A micro-batch as the producer makes it: row ranges of step j's planes, cu_seqlens apart."""
    return {"input_ids": block[j, 0, r0:r1], "labels": block[j, 1, r0:r1], "position_ids": block[j, 2, r0:r1],
            "cu_seqlens": np.arange(segs, dtype="<i4")}


def _block(steps: int = 2, rows: int = 4, length: int = 16) -> np.ndarray:
    return np.arange(steps * 3 * rows * length, dtype="<i4").reshape(steps, 3, rows, length)


def _frames(arrays, pack_below=LIMIT):
    return _heads().frames(step=3, micro=0, request_id=9, body=encoding.BatchHeaders.body(1), arrays=arrays,
                           pack_below=pack_below)


def _same_arrays(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and np.array_equal(got[k], want[k])


def test_a_whole_step_of_planes_goes_in_one_frame_and_decodes_to_the_same_arrays():
    block = _block()
    arrays = _micro(block, 1, 0, 4)
    packed, plain = _frames(arrays), _frames(arrays, pack_below=0)
    assert len(plain) == 5 and len(packed) == 3
    assert packed[0] == plain[0]  # the header does not change: the sizes say where each array is
    assert bytes(packed[1]) == b"".join(bytes(f) for f in plain[1:4]) and bytes(packed[2]) == bytes(plain[4])
    _same_arrays(decoding.decode([bytes(f) for f in packed], protocol.Limits.for_client()).arrays, arrays)
    _same_arrays(decoding.decode([bytes(f) for f in plain], protocol.Limits.for_client()).arrays, arrays)


@pytest.mark.parametrize("arrays", [
    _micro(_block(rows=4), 0, 0, 2),                                    # rows of a step with 2 micro-batches
    {k: v.copy() for k, v in _micro(_block(), 0, 0, 4).items()},        # separate buffers
    {**_micro(_block(), 0, 0, 4), "labels": _block()[0, 1]},            # another block's plane
])
def test_arrays_that_do_not_follow_each_other_in_one_buffer_keep_a_frame_each(arrays):
    assert len(_frames(arrays)) == 5
    _same_arrays(decoding.decode([bytes(f) for f in _frames(arrays)], protocol.Limits.for_client()).arrays, arrays)


def test_a_run_at_or_over_the_limit_or_read_only_is_not_packed():
    block = _block()
    arrays = _micro(block, 0, 0, 4)
    assert len(_frames(arrays, pack_below=3 * arrays["input_ids"].nbytes)) == 5
    assert len(_frames(arrays, pack_below=3 * arrays["input_ids"].nbytes + 1)) == 3
    block.flags.writeable = False
    assert len(_frames(_micro(block, 0, 0, 4))) == 5


ARRAYS = {"a": np.arange(6, dtype="<i4"), "b": np.zeros((0, 3), dtype="<i4"), "c": np.arange(4, dtype="<u2"),
          "d": np.arange(3, dtype="|u1"), "e": np.zeros(0, dtype="<i8")}


def _message(cuts: list[int], extra: bytes = b"") -> list[bytes]:
    """ARRAYS' header, then their bytes back to back cut into frames after the arrays at `cuts`."""
    plain = _frames(ARRAYS, pack_below=0)
    data, out, prev = [bytes(f) for f in plain[1:]], [plain[0]], 0
    for cut in [*cuts, len(data)]:
        out.append(b"".join(data[prev:cut]))
        prev = cut
    out[-1] += extra
    return out


def _sender_form(cuts: list[int]) -> bool:
    """Whether no frame ends with a zero-size array after bytes of others (the daemon packs non-empty
    arrays only); the rule would read such an array into the next frame."""
    sizes = [a.nbytes for a in ARRAYS.values()]
    bounds = [0, *cuts, len(sizes)]
    return all(not (sizes[hi - 1] == 0 and sum(sizes[lo:hi]) > 0) for lo, hi in zip(bounds, bounds[1:]))


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.integers(1, 4), unique=True, max_size=4).map(sorted))
def test_arrays_cut_into_frames_at_their_bounds_decode_to_the_same_arrays_or_are_truncated(cuts):
    frames = _message(cuts)
    try:
        got = decoding.decode(frames, protocol.Limits.for_client()).arrays
    except WireError as exc:
        assert exc.code == errorcodes.E_TRUNCATED and not _sender_form(cuts)
    else:
        _same_arrays(got, ARRAYS)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.integers(1, 40), unique=True, max_size=4).map(sorted))
def test_bytes_cut_anywhere_decode_to_the_same_arrays_or_are_truncated(cuts):
    plain = _frames(ARRAYS, pack_below=0)
    data = b"".join(bytes(f) for f in plain[1:])
    bounds = [0, *[c for c in cuts if c < len(data)], len(data)]
    frames = [plain[0], *(data[lo:hi] for lo, hi in zip(bounds, bounds[1:]))]
    try:
        got = decoding.decode(frames, protocol.Limits.for_client()).arrays
    except WireError as exc:
        assert exc.code == errorcodes.E_TRUNCATED
    else:
        _same_arrays(got, ARRAYS)


@pytest.mark.parametrize("frames", [
    _message([2], extra=b"\x00"),                                   # a frame longer than its arrays
    _message([2])[:-1],                                             # arrays without a frame
    [*_message([2]), b"x"],                                         # a frame without arrays
    [_message([2])[0], _message([2])[1][:-1], _message([2])[2]],    # a frame cut inside an array
    [_message([])[0], _message([])[1][:5], _message([])[1][5:]],    # cut inside an array, sizes still sum
])
def test_frames_that_do_not_hold_the_listed_arrays_exactly_are_truncated(frames):
    with pytest.raises(WireError) as err:
        decoding.decode(frames, protocol.Limits.for_client())
    assert err.value.code == errorcodes.E_TRUNCATED
