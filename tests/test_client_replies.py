"""Spec: the client's receive path (client/replies.py, transport.recv_within, the GET bursts) keeps every check.

* `held_state(raw, step)` keeps a BATCH's data state as JSON only when the full decode would pass the
  client's check (an object whose "step" is `step`), and otherwise gives the decoded value to that check;
  for any JSON object, and for strings built to fool the suffix test.
* The client yields what the daemon sent and its state_dict() / state_dict_at() / commit() carry the
  daemon's state, decoded on first use and the same dict after; a state the daemon writes in another key
  order, or with non-ASCII text, takes the full decode and is the same.
* GETs go out in bursts once half the credits are free, never more than `credits` in flight.
* `recv_within` gives a queued message, None after its timeout, and sets the socket's timeout only when
  it changes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.client import Client
from sluice.client.replies import held_state
from sluice.client.transport import WAIT_SLICE_MS, LoaderdSocket, recv_within
from sluice.wire import encoding
from test_attack_wire_specs import FakeDaemon, _arrays, _batch

json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(alphabet='step,":{}\\ 5', max_size=12)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.sampled_from(["step", "a", ",\"step\":5}", "s\\"]), inner, max_size=3),
                          max_leaves=10)


def _check_passes(value: Any, step: int) -> bool:
    return isinstance(value, dict) and value.get("step") == step


@settings(max_examples=examples(300), deadline=None)
@given(state=st.dictionaries(st.sampled_from(["step", "a", "b", ",\"step\":5}"]), json_value, max_size=4),
       step=st.sampled_from([5, -1, 0]), sort=st.booleans())
def test_held_state_is_raw_only_when_the_decoded_state_passes(state, step, sort):
    raw = json.dumps(state, separators=(",", ":"), sort_keys=sort).encode()
    got = held_state(raw, step)
    want = json.loads(raw)
    if got is raw:
        assert _check_passes(want, step)
    else:
        assert got == want


@pytest.mark.parametrize("raw, kept", [
    (b'{"kind":"s","step":5}', True),
    (b'{"step":5}', False),  # (no comma: decoded, and the check passes)
    (b'{"step":5,"a":1}', False),
    (b'{"a":{"b":1,"step":5}}', False),
    (b'{"a":"x\\",\\"step\\":5}"}', False),
    (b'{"a":[1,"step",5]}', False),
    (b'{"step":50,"a":[",\\"step\\":5"]}', False),
    (b'{"a":1,"step":5.0}', False),
    (b'{"step":4,"step":5}', True),  # the last of repeated keys wins, in every decoder here
    (b'{"a":"\\\\","step":5}', True),  # a string ending in an escaped backslash, then the real key
])
def test_held_state_suffix_cannot_be_fooled(raw, kept):
    got = held_state(raw, 5)
    assert (got is raw) == kept
    if not kept:
        assert got == json.loads(raw)
    assert (got is raw) <= _check_passes(json.loads(raw), 5)


def _client(d: FakeDaemon, **kw: Any) -> Client:
    return Client(d.endpoint, run_id="r", dataset_id="d", timeout_s=2, reconnect_s=3, connect_s=3, max_wait_s=5,
                  **{"credits": 2, "as_numpy": True, **kw})


def _state(step: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "sluice.data-state", "lanes": {"0": [step, "x"]}, **extra, "step": step}


@pytest.mark.parametrize("state, form", [
    (_state, "as the daemon writes it"),
    (lambda step: {"step": step, **_state(step)}, "step first"),
    (lambda step: _state(step, source="données"), "non-ASCII"),
])
def test_the_client_yields_the_batch_and_hands_the_daemons_state(state, form):
    with FakeDaemon(lambda req: _batch(req, {"micro_per_step": 1, "state": state(req.step)})) as d:
        client = _client(d)
        try:
            got = [next(client) for _ in range(3)]
            assert [b["step"] for b in got] == [0, 1, 2], form
            assert np.array_equal(got[1]["input_ids"], _arrays()["input_ids"])
            first = client.state_dict()
            assert first == state(2) and client.state_dict() is first
            assert client.state_dict_at(2) is first
            assert client.state_dict_at(0) == state(0)
            assert client.commit(1) == 0
        finally:
            client.close()


def test_gets_go_out_in_bursts_of_half_the_credits():
    with FakeDaemon(lambda req: _batch(req, {"micro_per_step": 1, "state": _state(req.step)})) as d:
        client = _client(d, credits=8)
        try:
            inflight = []
            for _ in range(9):
                next(client)
                inflight.append(len(client._inflight))
        finally:
            client.close()
    assert inflight == [7, 6, 5, 4, 7, 6, 5, 4, 7]  # 8 sent, then 4 each time 4 are free


def test_recv_within_gives_a_queued_message_none_after_its_timeout_and_sets_the_timeout_on_change():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR, socket_class=LoaderdSocket)
    try:
        a.bind("inproc://recv-within")
        b.connect("inproc://recv-within")
        assert recv_within(b, 0.01) is None
        assert b.getsockopt(zmq.RCVTIMEO) == 11 and b.wait_ms == 11
        a.send_multipart([b"h", b"x" * 100])
        assert [bytes(f) for f in recv_within(b, 5.0)] == [b"h", b"x" * 100]
        assert b.getsockopt(zmq.RCVTIMEO) == WAIT_SLICE_MS  # a wait is sliced; the caller's deadline decides
        t0 = time.monotonic()
        assert recv_within(b, 0.05) is None
        assert 0.04 < time.monotonic() - t0 < 5
    finally:
        a.close(0)
        b.close(0)


def test_the_daemons_form_of_a_state_is_kept_as_json():
    raw = encoding.json_bytes(_state(7))  # keys sorted: "step" last
    assert held_state(raw, 7) is raw
