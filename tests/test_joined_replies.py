"""Ring replies joined in one message (GET ``joined``; docs/protocol.md, "Joined replies").

A client that reads its arrays in its ring and says ``joined: true`` takes the
ring replies one turn of the daemon makes for it in one message: each reply's
header and ring reference, exactly as sent alone, back to back. Nothing else
changes: the same bytes, the same request IDs, and a position counts as
delivered only once the message holding it left.
"""

from __future__ import annotations

import time

import pytest
import zmq

from loaderd_support import Daemon, build_corpus, dealer, reference, stream_digests

from sluice.client import ring as client_ring
from sluice.client.replies import read_reply
from sluice.loaderd.joined import JoinedReplies
from sluice.wire import decoding, encoding, protocol

STEPS = 12
MPS = 4  # micro_batch 2 of global 8: four micro-batches a step
LIMITS = protocol.Limits.for_client()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("joined"), "jsonl.zst", tokenizer_file, max_steps=STEPS)


def send(s: zmq.Socket, d: Daemon, kind: str, request_id: int, step: int = -1, micro: int = -1, **body) -> None:
    s.send_multipart(encoding.encode(protocol.Header(
        kind=kind, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0, step=step, micro=micro,
        request_id=request_id, body=body)))


def recv(s: zmq.Socket, what: str) -> list[zmq.Frame]:
    assert s.poll(20_000), f"no reply within 20 s: {what}"
    return s.recv_multipart(copy=False)


def hello_with_ring(s: zmq.Socket, d: Daemon, slots: int = 16) -> client_ring.ClientRing:
    send(s, d, protocol.HELLO, 1, replicas=1, ring={"slots": slots, "lease": True})
    hello = decoding.decode(recv(s, "HELLO"), LIMITS)
    assert hello.kind == protocol.HELLO_OK and hello.body["ring"] is not None, hello.body
    return client_ring.ClientRing(hello.body["ring"], slots)


def stats(s: zmq.Socket, d: Daemon) -> dict:
    send(s, d, protocol.STATS, 999_999)
    return dict(decoding.decode(recv(s, "STATS"), LIMITS).body["stats"])


def wait_stats(s: zmq.Socket, d: Daemon, ok, what: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = stats(s, d)
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s (stats {st})"
        time.sleep(0.05)


GET_BODY = {"input_wait_s": 0.0, "samples": False, "observe": False, "packed": True, "ring": True}


def test_a_span_of_ring_replies_comes_in_one_message_of_the_plans_bytes(corpus, tmp_path):
    ref = reference(corpus, 4, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        s = dealer(d)
        ring = hello_with_ring(s, d)
        try:
            send(s, d, protocol.GET, 10, 0, 0, **GET_BODY, joined=True)  # the first step, alone
            (first,) = client_ring.resolve(ring, recv(s, "step 0 micro 0"))
            wait_stats(s, d, lambda st: st["replicas"]["0"]["queued_steps"] >= 4, "four steps made")
            send(s, d, protocol.GET, 11, 0, 1, **GET_BODY, joined=True, count=8)  # all decided: one message
            frames = recv(s, "the joined span")
            assert len(frames) == 16 and not s.poll(300), "eight ring replies in one message, and nothing else"
            joined = client_ring.resolve(ring, frames)
            send(s, d, protocol.GET, 19, 2, 1, **GET_BODY, count=3)  # not joined: a message each, as before
            alone = [client_ring.resolve(ring, recv(s, f"position {i}")) for i in range(3)]
            assert all(len(m) == 1 and len(m[0]) == 2 for m in alone)
            st = stats(s, d)
        finally:
            s.close(0)
            client_ring.released(ring)
    msgs = [read_reply(f, LIMITS) for f in [first, *joined, *(m[0] for m in alone)]]  # (message, header)
    assert [(m.kind, h.step, h.micro, h.request_id) for m, h in msgs] == [
        (protocol.BATCH, i // MPS, i % MPS, 10 + i) for i in range(12)]
    batches = [{**m.arrays, "step": h.step} for m, h in msgs]
    assert stream_digests(batches, MPS) == {k: ref[(k, 0)][0] for k in range(3)}
    assert st["joined"]["replies"] >= 9 and st["joined"]["messages"] <= st["joined"]["replies"] - 7


def test_a_joined_message_to_a_client_that_went_away_delivers_none_of_its_positions(corpus, tmp_path):
    # Parked GETs of a future step, from a client with a ring that then goes away: when the step is made the
    # joined message cannot leave (ROUTER_MANDATORY). Counting its positions as delivered would release the
    # step before the live client gets it (OUT_OF_RANGE, data lost).
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--request-ttl", "600", "--lead-steps", "2")) as d:
        probe = dealer(d)
        try:
            wait_stats(probe, d, lambda st: st["connections"] == 1, "the probe is the only connection")
            floor = stats(probe, d)["replicas"]["0"]["floor_step"]
            far = floor + 3  # beyond the lead: parked
            gone = dealer(d)
            ring = hello_with_ring(gone, d)
            send(gone, d, protocol.GET, 100, far, 0, **GET_BODY, joined=True, count=MPS)
            wait_stats(probe, d, lambda st: st["replicas"]["0"]["pending"] == MPS, "the gone client's GETs parked")
            gone.close(0)
            client_ring.released(ring)
            before = wait_stats(probe, d, lambda st: st["connections"] == 1, "the daemon sees the disconnect")
            assert before["replicas"]["0"]["pending"] == MPS  # still parked: the step was not made yet
            live = d.client(0, 1, timeout_s=30, credits=1)  # asks for step `far` only once it took the one before
            got = []
            for mb in live:
                got.append({k: v.copy() if hasattr(v, "copy") else v for k, v in mb.items()})
                if mb["step"] == far + 1 and mb["micro"] == MPS - 1:
                    break
            live.close()
            after = stats(probe, d)
        finally:
            probe.close(0)
    ref = reference(corpus, far + 2, 1)
    assert stream_digests(got, MPS) == {k: ref[(k, 0)][0] for k in range(far + 2)}
    assert after["undeliverable"] - before["undeliverable"] >= 1  # one message for the four positions
    assert after["joined"]["messages"] > before["joined"]["messages"]


def test_the_client_takes_joined_replies_and_receives_the_plans_stream(corpus, tmp_path):
    ref = reference(corpus, STEPS, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        c = d.client(credits=8)
        try:
            got = [{k: v.copy() if hasattr(v, "copy") else v for k, v in mb.items()} for mb in c]
            st = c.stats()
        finally:
            c.close()
    assert stream_digests(got, MPS) == {k: ref[(k, 0)][0] for k in range(STEPS)}
    assert st["rings"]["batches"] == len(got) == st["joined"]["replies"]
    assert st["joined"]["messages"] < st["joined"]["replies"], st["joined"]  # some came joined


def test_a_turns_replies_leave_a_message_per_client_in_order_within_the_wires_bound():
    j = JoinedReplies()
    j.add(b"a", [b"h0", b"r0"], 0)
    j.add(b"b", [b"hb", b"rb"], "b0")
    j.add(b"a", [b"h1", b"r1"], 1)
    for i in range(40):
        j.add(b"c", [b"h", b"r"], i)
    out = j.take()
    assert [(who, len(frames), positions[0]) for who, frames, positions in out] == [
        (b"a", 4, 0), (b"b", 2, "b0"), (b"c", 32, 0), (b"c", 32, 16), (b"c", 16, 32)]
    assert out[0][1:] == ([b"h0", b"r0", b"h1", b"r1"], [0, 1])
    assert j.stats() == {"messages": 5, "replies": 43} and j.take() == []


def test_at_a_trainers_pace_no_next_both_sends_a_get_and_reads_a_joined_message(corpus, tmp_path):
    """The client's top-up GET goes out in a ``next()`` whose reply was already received, never in the one
    that receives (and reads) a joined message: the two together were the tail of the wait at a trainer's pace
    (bench/serve.py's paced row). The stream is still the plan's."""
    ref = reference(corpus, STEPS, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        c = d.client(credits=8)
        calls: list[list[str]] = []
        try:
            it = iter(c)
            got = [dict(next(it))]  # (connected: its socket is there to watch)
            sock = c._sock
            real_send, real_recv = sock.send, sock.recv

            def send(*a, **k):
                calls[-1].append("send")
                return real_send(*a, **k)

            def recv(*a, **k):
                calls[-1].append("recv")
                return real_recv(*a, **k)

            sock.send, sock.recv = send, recv
            for _ in range(STEPS * MPS - 1):
                calls.append([])
                time.sleep(0.005)  # the trainer's step: every reply asked for is here by now
                got.append({k: v.copy() if hasattr(v, "copy") else v for k, v in next(it).items()})
        finally:
            c.close()
    assert stream_digests(got, MPS) == {k: ref[(k, 0)][0] for k in range(STEPS)}
    assert any("recv" in x for x in calls) and any("send" in x for x in calls), calls
    both = [i for i, x in enumerate(calls) if "send" in x and "recv" in x]
    assert not both, f"next() calls {both} both sent a GET and read a message: {calls}"
