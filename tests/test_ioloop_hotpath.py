"""The IO thread's per-GET shortcuts give what the general paths give (issue 23, item 3).

Each shortcut replaced several calls on the daemon's IO thread with fewer; none may change a
value a client, a scrape or the producer sees:

* `Metrics.sent.batch` counts one BATCH as the separate `observe`/`inc` calls did (scraped text equal);
* `decoding.decode_header` returns `decode(...).header`, or the same refusal, for any frames;
* the BATCH header's %-template writes `encode_header`'s bytes when the IDs hold a ``%``;
* a release wakes a producer that waits for room, and notifies nobody when no producer waits;
* an offer of parked GETs keeps, serves and fences each as the call per GET did.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from support import examples

from sluice.client.requests import GetFrames
from sluice.errors import WireError
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.parking import Parked, Parking
from sluice.loaderd.physical.stepqueue import StepEntry, StepQueue
from sluice.wire import decoding, encoding, protocol


def _scraped(m: Metrics) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(m.registry).decode())


@settings(max_examples=examples(30), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(0, 20, allow_nan=False), st.integers(0, 3),
                          st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5000)), max_size=3),
                          st.booleans()), max_size=12))
def test_sent_batch_counts_a_batch_as_the_separate_calls_did(sends):
    one, calls = (Metrics("r", "d", ["a", "b", "c"], [1.0, 2.0, 3.0], unit="tokens") for _ in range(2))
    for replica, waited, rows, sources, counted in sends:
        arrays = {"input_ids": np.zeros((rows, 4), "<i4"), "labels": np.zeros((rows, 4), "<i4"),
                  "cu_seqlens": np.arange(rows + 1, dtype="<i4")}
        src = tuple(sources) if counted else None
        one.sent.batch(replica, arrays, src, waited)
        calls.time_to_batch.observe(waited)  # what handlers.py called before sent.batch
        calls.batches.inc()
        calls.served_bytes.inc(sum(a.nbytes for a in arrays.values()))
        calls.served_tokens.inc(int(arrays["input_ids"].size))
        if src is not None:
            calls.served_sources(replica, src)
    assert _scraped(one) == _scraped(calls)


def _get_header(**over) -> bytes:
    fields = {"run_id": "run", "dataset_id": "ds", "generation": 2, "replica": 0, "instance": "41-abc",
              "token": "t" * 32, "samples": False, "observe": False}
    step = over.pop("step", 5)
    fields.update(over)
    return GetFrames(**fields).frames(step=step, micro=0, request_id=7, input_wait_s=0.25)[0]


def _outcome(fn, frames):
    try:
        return fn(frames, protocol.Limits())
    except WireError as exc:
        return (exc.code, str(exc))


_headers = st.sampled_from([
    _get_header(), _get_header(step=-1), _get_header(run_id="%s%d", instance="%%"),
    encoding.encode_header(protocol.Header(kind=protocol.BATCH, arrays=(("input_ids", "<i4", (2,)),))),
    encoding.encode_header(protocol.Header(kind=protocol.STATS)),
])


@settings(max_examples=examples(150), deadline=None)
@given(head=_headers, cut=st.integers(0, 400), flip=st.integers(0, 400), byte=st.integers(0, 255),
       extra=st.integers(0, 9), mutate=st.booleans())
def test_decode_header_reads_a_request_as_decode_does(head, cut, flip, byte, extra, mutate):
    """The header `decode` gives, or its refusal (code and message), for one frame or several, intact or not."""
    raw = bytearray(head)
    if mutate and raw:
        raw[flip % len(raw)] = byte
        raw = raw[: max(1, len(raw) - cut % 8)]
    frames = [bytes(raw)] + [b"\0" * 8] * extra
    want = _outcome(lambda f, lim: decoding.decode(f, lim).header, frames)
    assert _outcome(decoding.decode_header, frames) == want
    assert _outcome(decoding.decode_header, []) == _outcome(lambda f, lim: decoding.decode(f, lim).header, [])


@pytest.mark.parametrize("ids", ["%s", "%d%%", "100%", "a%(x)b"])
def test_a_percent_in_an_id_is_written_as_encode_header_writes_it(ids):
    heads = encoding.BatchHeaders(run_id=ids, dataset_id=ids + "d", generation=3, replica=1, instance=ids + "i")
    arrays = {"input_ids": np.arange(8, dtype="<i4").reshape(2, 4)}
    body = encoding.BatchHeaders.body(2, encoding.json_bytes(["s%d"]), encoding.json_bytes({"k": "%"}))
    got = heads.frames(step=9, micro=1, request_id=4, body=body, arrays=arrays)
    want = encoding.encode(protocol.Header(kind=protocol.BATCH, run_id=ids, dataset_id=ids + "d", generation=3,
                                           replica=1, step=9, micro=1, request_id=4, instance=ids + "i",
                                           body={"micro_per_step": 2, "samples": ["s%d"], "state": {"k": "%"}}),
                           arrays)
    assert got[0] == want[0]


def _entry(step: int) -> StepEntry:
    arrays = [{"input_ids": np.zeros((1, 4), "<i4")}]
    return StepEntry(step=step, micros=arrays, samples=[[]], state={"step": step}, nbytes=16,
                     created=time.monotonic(), delivered=[set()])


class _Counting(threading.Condition):
    """The stdlib condition, counting `notify_all` calls."""

    notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_a_release_wakes_a_producer_waiting_for_room_and_nobody_when_none_waits():
    q = StepQueue(1 << 20, 2)
    q.cond = _Counting(q.lock)
    for s in (0, 1):
        q.put(_entry(s))
    q.answer(0, 0, 0, ahead=4, peers=1, send=lambda e: b"a")  # released with no producer waiting
    assert q.floor == 1 and q.cond.notified == 0
    q.put(_entry(2))  # full again: a producer waits for room for step 3, as pipeline.ReplicaPipeline.wait does
    woke = threading.Event()

    def producer() -> None:
        with q.cond:
            while not q.room_for(3):
                q.waiting_for = 3
                q.cond.wait(5.0)
            q.waiting_for = None
        woke.set()

    t = threading.Thread(target=producer)
    t.start()
    deadline = time.monotonic() + 5.0
    while q.waiting_for is None and time.monotonic() < deadline:  # (it sets it under the lock, then waits)
        time.sleep(0.001)
    q.answer(1, 0, 0, ahead=4, peers=1, send=lambda e: b"a")
    assert woke.wait(2.0), "a release that made room did not wake the waiting producer"
    t.join(5.0)
    assert q.cond.notified == 1


def test_an_offer_keeps_what_waits_serves_what_is_decided_and_fences_older_generations():
    """`Parking.offer` (each announcement): its look without the lock keeps the GETs that wait; a GET whose
    step another GET's release just passed is offered, and refused, in the same pass."""
    q = StepQueue(1 << 20, 4)
    q.put(_entry(0))
    parking = Parking([0], max_pending=8)

    def get(step: int, generation: int = 1) -> Parked:
        h = protocol.Header(kind=protocol.GET, generation=generation, replica=0, step=step, micro=0)
        return Parked(b"c%d" % step, h, 0.0)

    for item in (get(0), get(0), get(2), get(1, generation=0), get(9)):
        parking.park(item)
    served, refused, fenced = [], [], []

    def serve(item: Parked) -> bool:
        try:
            return q.answer(item.header.step, 0, 0, ahead=4, peers=1, send=lambda e: served.append(e.step) or b"c")
        except WireError as exc:
            refused.append((item.header.step, exc.code))
            return True

    parking.offer(0, q, 4, 1, serve, fenced.append)
    assert served == [0] and q.floor == 1  # the first GET of step 0 released it
    assert refused == [(0, "OUT_OF_RANGE"), (9, "TOO_FAR_AHEAD")]  # the second, in the same pass
    assert [i.header.generation for i in fenced] == [0]
    assert parking.count(0) == 1  # step 2: not made, kept
