"""BATCH headers built from pre-encoded parts are the very bytes the generic encoder writes.

The daemon formats BATCH replies with `encoding.BatchHeaders` (constant fields
encoded once per generation, the data state once per step by the producer);
a client must not be able to tell: every frame equals `encoding.encode`'s.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.wire import decoding, encoding, protocol

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
state = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | text,
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3), max_leaves=12)


@settings(max_examples=examples(60), deadline=None)
@given(run_id=text, dataset_id=text, instance=text, generation=st.integers(0, 2**40), replica=st.integers(0, 1024),
       step=st.integers(-1, 2**40), micro=st.integers(0, 64), request_id=st.integers(0, 2**40),
       mps=st.integers(1, 64), samples=st.none() | st.lists(text, max_size=4), data_state=st.none() | state,
       rows=st.integers(0, 3), segs=st.integers(0, 5))
def test_batch_headers_equal_the_generic_encoding(run_id, dataset_id, instance, generation, replica, step, micro,
                                                  request_id, mps, samples, data_state, rows, segs):
    arrays = {"input_ids": np.arange(rows * 4, dtype="<i4").reshape(rows, 4),
              "labels": np.zeros((rows, 4), dtype="<i4"), "position_ids": np.ones((rows, 4), dtype="<i4"),
              "cu_seqlens": np.arange(segs, dtype="<i4")}
    body: dict = {"micro_per_step": mps}
    if samples is not None:
        body["samples"] = samples
    if data_state is not None:
        body["state"] = data_state
    want = encoding.encode(protocol.Header(kind=protocol.BATCH, run_id=run_id, dataset_id=dataset_id,
                                           generation=generation, replica=replica, step=step, micro=micro,
                                           request_id=request_id, instance=instance, body=body), arrays)
    heads = encoding.BatchHeaders(run_id=run_id, dataset_id=dataset_id, generation=generation, replica=replica,
                                  instance=instance)
    got = heads.frames(step=step, micro=micro, request_id=request_id, arrays=arrays, body=encoding.BatchHeaders.body(
        mps, None if samples is None else encoding.json_bytes(samples),
        None if data_state is None else encoding.json_bytes(data_state)))
    assert got[0] == want[0]
    assert [bytes(f) for f in got[1:]] == [bytes(f) for f in want[1:]]
    msg = decoding.decode(got, protocol.Limits.for_client())
    assert msg.header.kind == protocol.BATCH and dict(msg.header.body) == body


dtypes = st.sampled_from(["<i4", ">i4", "<i8", "<u2", "|u1", ">f4"])


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), dtypes, st.booleans()), min_size=1,
                        max_size=8))
def test_one_batch_headers_serves_changing_arrays_as_the_generic_encoding(batches):
    """The array-spec JSON a BatchHeaders keeps per (names, dtypes, shapes) never goes stale: arrays whose
    shapes, dtypes (big-endian too) or layout (a strided view) change between replies still give exactly
    `encoding.encode`'s frames, with a bounded number kept."""
    heads = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=0, replica=0, instance="i")
    heads.SPECS_KEPT = 3
    for rows, segs, dtype, strided in batches:
        ids = np.arange(rows * 8, dtype=dtype).reshape(rows, 8)
        arrays = {"input_ids": ids[:, ::2] if strided else ids[:, :4], "labels": np.zeros((rows, 4), dtype=dtype),
                  "cu_seqlens": np.arange(segs, dtype="<i4")}
        want = encoding.encode(protocol.Header(kind=protocol.BATCH, run_id="r", dataset_id="d", generation=0, replica=0,
                                               step=3, micro=0, request_id=1, instance="i",
                                               body={"micro_per_step": 1}), arrays)
        got = heads.frames(step=3, micro=0, request_id=1, arrays=arrays, body=encoding.BatchHeaders.body(1))
        assert got[0] == want[0]
        assert [bytes(f) for f in got[1:]] == [bytes(f) for f in want[1:]]
        assert len(heads._specs) <= heads.SPECS_KEPT


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from([protocol.BATCH, protocol.GET, protocol.HELLO, protocol.STATS]), run_id=st.none() | text,
       dataset_id=st.none() | text, instance=text, generation=st.integers(0, 2**40), replica=st.integers(-1, 1024),
       step=st.integers(-1, 2**40), micro=st.integers(-1, 64), request_id=st.integers(0, 2**40),
       body=st.dictionaries(text, state, max_size=3))
def test_the_one_header_writer_equals_the_generic_encoding(kind, run_id, dataset_id, instance, generation, replica,
                                                           step, micro, request_id, body):
    """`encoding.HeaderWriter`, which the daemon's BATCH replies and the client's GETs both use, for any kind."""
    h = protocol.Header(kind=kind, run_id=run_id, dataset_id=dataset_id, generation=generation, replica=replica,
                        step=step, micro=micro, request_id=request_id, instance=instance, body=body)
    writer = encoding.HeaderWriter(kind=kind, run_id=run_id, dataset_id=dataset_id, generation=generation,
                                   replica=replica, instance=instance)
    got = writer.frame(arrays=b"[]", body=encoding.json_bytes(body), step=step, micro=micro, request_id=request_id)
    assert got == encoding.encode_header(h)
