"""The IO thread's libzmq calls with the GIL kept (sluice/loaderd/heldzmq.py): what pyzmq's would do, on real sockets.

Each test sends or receives through a real ROUTER the daemon's way and checks
the bytes, the bounds and the errors against pyzmq on the other end.
"""

from __future__ import annotations

import errno
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.loaderd import endpoint, heldzmq
from sluice.wire import protocol

# heldzmq finds libzmq in /proc/self/maps: Linux only (elsewhere the daemon uses pyzmq's calls).
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="heldzmq reads /proc/self/maps (Linux)")


@pytest.fixture()
def pair(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/r.sock")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"rank-0")
    dealer.connect(f"ipc://{tmp_path}/r.sock")
    dealer.send(b"hello")  # (the ROUTER knows the peer once it has heard from it)
    assert router.poll(5000)
    router.recv_multipart()
    yield router, dealer
    dealer.close(0)
    router.close(0)
    ctx.term()


def test_the_library_is_the_one_pyzmq_loaded():
    assert heldzmq.available(), "libzmq not found in /proc/self/maps: the daemon would use pyzmq's calls"
    # (a second copy of libzmq would not know pyzmq's sockets: the send below would fail or crash)
    assert heldzmq._LIB.zmq_errno() >= 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=6), st.integers(0, 3))
def test_sent_frames_arrive_as_pyzmq_sends_them(tmp_path_factory, parts, arrays):
    d = tmp_path_factory.mktemp("held")
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{d}/r.sock")
        dealer.setsockopt(zmq.ROUTING_ID, b"peer")
        dealer.connect(f"ipc://{d}/r.sock")
        dealer.send(b"x")
        assert router.poll(5000)
        router.recv_multipart()
        rng = np.random.default_rng(len(parts))
        bufs = [rng.integers(0, 50_000, (2, 7 + i), dtype=np.int32) for i in range(arrays)]
        frames = [b"peer", *parts, *bufs, memoryview(b"tail")]
        assert heldzmq.send(router, frames, endpoint.COPY_BELOW)
        assert dealer.poll(5000)
        got = dealer.recv_multipart()
        assert got == [*parts, *(b.tobytes() for b in bufs), b"tail"]
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


def test_a_large_frame_is_left_to_pyzmq_and_nothing_is_sent(pair):
    router, dealer = pair
    big = np.zeros(endpoint.COPY_BELOW // 4, np.int32)
    assert not heldzmq.send(router, [b"rank-0", b"head", big], endpoint.COPY_BELOW)
    assert not dealer.poll(100)
    endpoint.send_frames(router, [b"rank-0", b"head", big])  # (pyzmq's zero-copy send)
    assert dealer.poll(5000)
    assert [len(f) for f in dealer.recv_multipart()] == [4, big.nbytes]


def test_an_unknown_peer_is_the_error_pyzmq_raises(pair):
    router, _ = pair
    with pytest.raises(zmq.ZMQError) as held:
        heldzmq.send(router, [b"nobody", b"head"], endpoint.COPY_BELOW)
    assert held.value.errno == errno.EHOSTUNREACH
    with pytest.raises(zmq.ZMQError) as plain:
        router.send_multipart([b"nobody", b"head"], zmq.NOBLOCK)
    assert plain.value.errno == held.value.errno


def test_nothing_waiting_raises_again(pair):
    router, _ = pair
    with pytest.raises(zmq.Again):
        heldzmq.receive_bounded(router, protocol.Limits())


@pytest.mark.parametrize("held", [True, False], ids=["heldzmq", "pyzmq"])
def test_received_frames_are_bounded_alike_either_way(pair, monkeypatch, held):
    """`endpoint.receive_bounded` through heldzmq, and through pyzmq where heldzmq is not available."""
    router, dealer = pair
    monkeypatch.setattr(endpoint, "_HELD", held)
    limits = protocol.Limits(max_frames=3, max_header_bytes=100)
    cases = [
        ([b"a" * 10, b"b" * 20], [b"a" * 10, b"b" * 20], 0),
        ([b"a" * 60, b"b" * 41, b"c"], [b"a" * 60], 2),  # over the header budget: it and all after it dropped
        ([b"x"] * 6, [b"x"] * 3, 3),  # over max_frames
        ([b"", b""], [b"", b""], 0),
    ]
    for sent, kept, dropped in cases:
        dealer.send_multipart(sent)
        assert router.poll(5000)
        frames, n = endpoint.receive_bounded(router, limits)
        assert ([bytes(f) for f in frames], n) == ([b"rank-0", *kept], dropped)
        assert type(frames[0]) is bytes  # (the identity, as `Requests.handle` reads it)
        assert not router.poll(0)  # (the dropped frames were read off the socket, not left behind)


def test_the_gil_is_kept_through_a_send(pair):
    """A thread waiting for the GIL gets no turn while sends go through heldzmq: libzmq is called without
    releasing it. (Through pyzmq, which releases it around each frame, the waiting thread got in during 11-16
    of these 200 sends.)"""
    router, dealer = pair
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # (no forced hand-off within the sends below: only a release lets it in)
    t = threading.Thread(target=spin)
    t.start()
    try:
        while not ticks[0]:
            time.sleep(0.001)
        frames = [b"rank-0", *[b"f"] * 64]
        for _attempt in range(3):
            got_in, t0 = False, time.monotonic()
            for _ in range(200):
                before = ticks[0]
                heldzmq.send(router, frames, endpoint.COPY_BELOW)  # 65 calls into libzmq each
                got_in = ticks[0] != before
                if got_in:
                    break
            # (past the switch interval the waiting thread forces a hand-off: a machine that stalled this loop
            # that long tries again; a release comes with that wait too, so it fails all three tries)
            if not got_in or time.monotonic() - t0 < 0.4:
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert not got_in
    while dealer.poll(200):
        assert len(dealer.recv_multipart()) == 64


def test_a_wake_up_is_received_whole_or_released_uncopied():
    """`receive_small` (the IO thread's read of its producers' wake-ups): a message's first frame when it is
    small, None for a longer one, its further frames released, `zmq.Again` once nothing waits."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://wake")
        push.connect("inproc://wake")
        assert heldzmq.send(push, [b"3"], 1 << 62)  # (the producer's side, `WireIO.notify`)
        push.send(b"x" * 100)
        push.send_multipart([b"7", b"more"])
        assert pull.poll(5000)
        assert [heldzmq.receive_small(pull, 32) for _ in range(3)] == [b"3", None, b"7"]
        with pytest.raises(zmq.Again):
            heldzmq.receive_small(pull, 32)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
