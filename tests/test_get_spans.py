"""A GET of several positions (body ``count``; docs/protocol.md, "Spans") is answered as that many GETs.

The client asks for its free credits in one GET where the daemon says it
takes spans (HELLO_OK ``max_count``): the daemon reads one request where it
read one per micro-batch. Each position is answered (or parked, expired,
refused) exactly as a GET of its own under its own request ID, so what a
client receives does not change: the same bytes, the same errors.
"""

from __future__ import annotations

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd_support import Daemon, build_corpus, dealer, reference, stream_digests
from support import examples

from sluice.errors import WireError
from sluice.loaderd.handlers import MAX_SPAN, span
from sluice.wire import decoding, encoding, errorcodes, protocol


ABSENT = object()


def get(count, *, step=3, micro=1, request_id=100, **body) -> protocol.Header:
    return protocol.Header(kind=protocol.GET, run_id="r", dataset_id="d", generation=2, replica=1, step=step,
                           micro=micro, request_id=request_id, instance="i",
                           body={"input_wait_s": 0.5, **({} if count is ABSENT else {"count": count}), **body})


# -- the positions: pure -------------------------------------------------------------------
@settings(max_examples=examples(200), deadline=None)
@given(mps=st.integers(1, 16), step=st.integers(0, 2**40), micro=st.integers(0, 15), count=st.integers(1, MAX_SPAN),
       request_id=st.integers(0, 2**61))
def test_a_span_is_count_consecutive_positions_in_stream_order_under_consecutive_ids(mps, step, micro, count,
                                                                                       request_id):
    h = get(count, step=step, micro=micro % mps, request_id=request_id)
    got = span(h, mps)
    want, s, m = [], step, micro % mps
    for i in range(count):
        want.append((s, m, request_id + i))
        s, m = (s, m + 1) if m + 1 < mps else (s + 1, 0)
    assert [(a.step, a.micro, a.request_id) for a in got] == want
    for a in got:  # every other field is the GET's
        assert (a.kind, a.run_id, a.dataset_id, a.generation, a.replica, a.instance, a.body) == (
            h.kind, h.run_id, h.dataset_id, h.generation, h.replica, h.instance, h.body)
    assert got[0] == h


def test_a_get_without_count_is_its_own_one_position():
    h = get(ABSENT)
    assert span(h, 4) == [h]


@pytest.mark.parametrize("count", [0, -1, MAX_SPAN + 1, True, 2.0, "4", None, [2]])
def test_a_count_that_is_not_an_integer_from_1_to_the_most_is_refused_malformed(count):
    h = get(count)
    with pytest.raises(WireError) as e:
        span(h, 4)
    assert e.value.code == errorcodes.E_MALFORMED and "GET count" in str(e.value)


def test_a_span_whose_request_ids_would_pass_the_bound_is_refused():
    with pytest.raises(WireError) as e:
        span(get(4, request_id=2**62 - 2), 4)
    assert e.value.code == errorcodes.E_MALFORMED


# -- a real daemon ----------------------------------------------------------------------------
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    # micro_batch 2 of global 8: four micro-batches a step, so a span crosses steps
    return build_corpus(tmp_path_factory.mktemp("spans"), "jsonl.zst", tokenizer_file, max_steps=STEPS)


def send_get(s: zmq.Socket, d: Daemon, step: int, micro: int, request_id: int, **body) -> None:
    s.send_multipart(encoding.encode(protocol.Header(
        kind=protocol.GET, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0, step=step,
        micro=micro, request_id=request_id, body={"input_wait_s": 0.0, "samples": False, "observe": False, **body})))


def replies(s: zmq.Socket, n: int) -> list[protocol.Message]:
    out = []
    for _ in range(n):
        assert s.poll(20000), f"no reply within 20 s (after {len(out)} of {n})"
        out.append(decoding.decode(s.recv_multipart(copy=False), protocol.Limits.for_client()))
    assert not s.poll(300), "more replies than positions"
    return sorted(out, key=lambda m: m.header.request_id)


def test_a_span_is_answered_position_by_position_with_the_plans_bytes_and_the_end_after_the_last(corpus,
                                                                                                   tmp_path):
    ref = reference(corpus, STEPS, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        s = dealer(d)
        try:
            send_get(s, d, 0, 0, 10, count=MAX_SPAN)  # steps 0-3, four micro-batches each
            got = replies(s, MAX_SPAN)
            send_get(s, d, STEPS - 1, 2, 40, count=5)  # two micro-batches of the last step, then three past it
            tail = replies(s, 5)
            send_get(s, d, 0, 0, 60, count=0)
            (bad,) = replies(s, 1)
        finally:
            s.close(0)
    assert [(m.kind, m.header.step, m.header.micro, m.header.request_id) for m in got] == [
        (protocol.BATCH, i // 4, i % 4, 10 + i) for i in range(MAX_SPAN)]
    batches = [{**m.arrays, "step": m.header.step} for m in got]
    assert stream_digests(batches, 4) == {k: ref[(k, 0)][0] for k in range(4)}
    assert [(m.kind, m.header.step, m.header.micro, m.header.request_id) for m in tail] == [
        (protocol.BATCH, STEPS - 1, 2, 40), (protocol.BATCH, STEPS - 1, 3, 41),
        *[(protocol.ERROR, STEPS, i, 42 + i) for i in range(3)]]
    assert {m.body["code"] for m in tail[2:]} == {errorcodes.E_END}
    assert (bad.kind, bad.body["code"], bad.header.request_id) == (protocol.ERROR, errorcodes.E_MALFORMED, 60)
    assert "GET count" in bad.body["message"]


def test_the_client_asks_in_spans_and_receives_the_plans_stream(corpus, tmp_path):
    ref = reference(corpus, STEPS, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        c = d.client(credits=8)
        try:
            got = list(c)
            assert c.info["max_count"] == MAX_SPAN
            s = dealer(d)
            try:
                s.send_multipart(encoding.encode(protocol.Header(kind=protocol.STATS, request_id=1)))
                (st_,) = replies(s, 1)
            finally:
                s.close(0)
        finally:
            c.close()
    assert stream_digests(got, 4) == {k: ref[(k, 0)][0] for k in range(STEPS)}
    # 24 micro-batches in GETs of 4 (credits topped up once half are free) and one HELLO, not 24 GETs
    assert st_.body["stats"]["requests"] <= len(got) // 4 + 4, st_.body["stats"]["requests"]
