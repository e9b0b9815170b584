"""`recv_frames` receives one whole multipart message, as `recv_multipart(copy=False)` does, and no more."""

from __future__ import annotations

import zmq

from sluice.client.transport import recv_frames


def test_recv_frames_takes_exactly_one_message_frame_by_frame():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://sluice-test-recv-frames")
        b.connect("inproc://sluice-test-recv-frames")
        first = [b"head", b"", b"x" * 70000, b"tail"]  # an empty frame and one past zmq's small-message size
        a.send_multipart(first)
        a.send_multipart([b"next"])
        assert b.poll(5000)
        assert [bytes(f.buffer) for f in recv_frames(b)] == first
        assert [bytes(f.buffer) for f in recv_frames(b)] == [b"next"]
        assert not b.poll(0)  # nothing was left behind or taken from the next message
    finally:
        a.close(0)
        b.close(0)
