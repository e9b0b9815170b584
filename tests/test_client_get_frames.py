"""GET requests built from pre-encoded parts are the very bytes the generic encoder writes.

The client sends its GETs with `GetFrames` (constant fields encoded once per
connection); the daemon must not be able to tell: every frame equals
``encoding.encode(Header(kind=GET, ...))``'s, for any field values.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.client.requests import GetFrames
from sluice.wire import decoding, encoding, protocol

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=examples(80), deadline=None)
@given(run_id=st.none() | text, dataset_id=st.none() | text, instance=text, generation=st.integers(0, 2**40),
       replica=st.integers(0, 1024), step=st.integers(-1, 2**40), micro=st.integers(0, 64),
       request_id=st.integers(0, 2**40), token=st.none() | text, samples=st.booleans(), observe=st.booleans(),
       wait=st.floats(0, 1e6, allow_nan=False, allow_infinity=False), ring=st.booleans(),
       release=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 2**40)), max_size=8),
       count=st.integers(1, 16), joined=st.booleans())
def test_get_frames_equal_the_generic_encoding(run_id, dataset_id, instance, generation, replica, step, micro,
                                               request_id, token, samples, observe, wait, ring, release, count,
                                               joined):
    wait = round(wait, 6)
    body = {**({"count": count} if count > 1 else {}), "input_wait_s": wait, **({"joined": True} if joined else {}),
            "samples": samples, "observe": observe, "packed": True, **({"ring": True} if ring else {})}
    if release:  # (a leased ring's released slots, as `ClientRing.release_field` writes them)
        body["release"] = [list(p) for p in release]
    if token is not None:
        body["token"] = token
    want = encoding.encode(protocol.Header(kind=protocol.GET, run_id=run_id, dataset_id=dataset_id,
                                           generation=generation, replica=replica, step=step, micro=micro,
                                           request_id=request_id, instance=instance, body=body))
    gets = GetFrames(run_id=run_id, dataset_id=dataset_id, generation=generation, replica=replica,
                     instance=instance, token=token, samples=samples, observe=observe, ring=ring, joined=joined)
    field = b',"release":[' + b",".join(b"[%d,%d]" % p for p in release) + b"]" if release else b""
    got = gets.frames(step=step, micro=micro, request_id=request_id, input_wait_s=wait, release=field, count=count)
    assert [bytes(f) for f in got] == [bytes(f) for f in want]
    if run_id is not None and dataset_id is not None:  # what the daemon parses is what was meant
        h = decoding.decode(got, protocol.Limits()).header
        assert (h.kind, h.step, h.micro, h.request_id, h.generation, dict(h.body)) == (
            protocol.GET, step, micro, request_id, generation, body)
