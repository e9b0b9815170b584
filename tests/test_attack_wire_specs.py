"""Attacks on the client's side of the wire: the kept array specs of `decoding.decode` and a stranger daemon.

Specifications:
* An "arrays" value padded with whitespace (valid JSON, up to the client's
  16 MiB header limit) is decoded like any other, but never kept: the kept
  layouts are bounded in bytes, not only in count (1024 kept values of 16 MiB
  each would have been 16 GiB of memory held by a stranger's headers).
* A layout is kept only for an "arrays" value that is, type for type, the
  one validated: a header listing "arrays" twice (`[2.0,4]` first, `[2,4]`
  last, which JSON's last-wins lets pass) does not teach the fast path to
  accept `[2.0,4]` alone (Python's `2.0 == 2` made it so).
* Keys spelled with escapes (``"\\u0061rrays"``), non-ASCII keys, duplicated
  keys and oversized keys get the same answer warm or cold.
* A stranger daemon (a real ROUTER socket in this test speaking our framing)
  that answers with hostile replies makes the real `Client` raise one of our
  errors naming the field, in bounded time: never ValueError/TypeError/
  KeyError from a field it did not check, never a hang.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from sluice.client import Client
from sluice.errors import ProtocolError, SluiceError, WireError
from sluice.wire import decoding, encoding, errorcodes, protocol
from test_wire_kept_specs import LIMITS, _same, _valid


def _arrays_value(head: bytes) -> tuple[bytes, bytes]:
    start = len(b'{"arrays":')
    cut = head.index(b',"body":')
    return head[start:cut], head[cut:]


def test_whitespace_padded_arrays_are_decoded_but_never_kept():
    decoding._SPECS.clear()
    frames = _valid()
    x, rest = _arrays_value(frames[0])
    for n in range(40):  # 40 distinct values of 1 MiB each
        head = b'{"arrays":' + x[:1] + b" " * ((1 << 20) + n) + x[1:] + rest
        msg = decoding.decode([head, *frames[1:]], LIMITS)
        assert msg.kind == protocol.BATCH and set(msg.arrays) == {"input_ids", "labels", "cu_seqlens"}
    kept = sum(map(len, decoding._SPECS))
    assert kept <= 64 << 10, f"{kept} bytes of kept array specs"
    assert all(len(k) <= decoding._SPEC_KEY_BYTES for k in decoding._SPECS)
    assert decoding._SPECS_KEPT * decoding._SPEC_KEY_BYTES <= 64 << 20  # the bound in bytes


def test_a_layout_is_kept_only_for_the_value_validated_type_for_type():
    frames = _valid()
    x, rest = _arrays_value(frames[0])
    assert b'"shape":[2,4]' in x
    loose = x.replace(b'"shape":[2,4]', b'"shape":[2.0,4]', 1)
    dup = b'{"arrays":' + loose + rest[:-1] + b',"arrays":' + x + b"}"
    alone = b'{"arrays":' + loose + rest
    decoding._SPECS.clear()
    assert decoding.decode([dup, *frames[1:]], LIMITS).kind == protocol.BATCH  # JSON: the last "arrays" wins
    with pytest.raises(WireError) as warm:
        decoding.decode([alone, *frames[1:]], LIMITS)
    decoding._SPECS.clear()
    with pytest.raises(WireError) as cold:
        decoding.decode([alone, *frames[1:]], LIMITS)
    assert (warm.value.code, str(warm.value)) == (cold.value.code, str(cold.value)) and "shape" in str(cold.value)
    bools = x.replace(b'"shape":[2,4]', b'"shape":[true,4]', 1)  # True == 1 too
    assert _same([b'{"arrays":' + bools + rest, *frames[1:]])[0] == "refused"


@pytest.mark.parametrize("edit", [
    lambda h: h.replace(b'{"arrays":', b'{"\\u0061rrays":', 1),
    lambda h: h.replace(b',"body":', b',"\\u0062ody":', 1),
    lambda h: h[:-1] + b',"\\u0061rrays":[]}',
    lambda h: h[:-1] + ',"\u00e9t\u00e9":1}'.encode(),  # a non-ASCII unknown key
    lambda h: h[:-1] + b',"' + b"k" * (1 << 20) + b'":1}',  # an oversized unknown key
    lambda h: h[:-1] + b',"step":5}',  # a duplicated key: the last wins, warm or cold
    lambda h: h[:-1] + b',"body":{"micro_per_step":"x"}}',
])
def test_escaped_non_ascii_duplicated_and_oversized_keys_get_the_same_answer_warm_or_cold(edit):
    frames = _valid()
    _same([edit(frames[0]), *frames[1:]])


# ------------------------------------------------------------------ a stranger daemon
class FakeDaemon:
    """A real ROUTER that answers HELLO like a loaderd and every GET with `batch(header, rid)`'s frames."""

    def __init__(self, batch: Callable[[protocol.Header], list[Any]], hello: Callable[[dict], dict] = lambda b: b,
                 committed: Any = 0):
        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix='sl-fake-')}/d.sock"
        self._batch, self._hello, self._committed = batch, hello, committed
        self.answer_commit: Callable[[protocol.Header], list[Any]] | None = None  # frames for a COMMIT, if set
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-daemon", daemon=True)

    def __enter__(self) -> FakeDaemon:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        shutil.rmtree(Path(self.endpoint[len("ipc://"):]).parent, ignore_errors=True)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                ident, *frames = sock.recv_multipart()
                req = decoding.decode(frames, protocol.Limits()).header
                if req.kind == protocol.HELLO:
                    body = self._hello({"instance": "fake-1", "generation": 0, "floor_step": 0, "next_step": 0,
                                        "micro_per_step": 1, "lanes": 1, "replicas": 1, "seq_len": 4,
                                        "micro_batch": 1, "max_steps": None, "lead_steps": 4,
                                        "request_ttl_s": 30.0, "committed_step": -1, "runspec_digest": "x",
                                        "resume": "strict"})
                    reply = protocol.Header(kind=protocol.HELLO_OK, run_id="r", dataset_id="d", replica=0,
                                            request_id=req.request_id, instance="fake-1", body=body)
                    sock.send_multipart([ident, *encoding.encode(reply)])
                elif req.kind == protocol.GET:
                    sock.send_multipart([ident, *self._batch(req)])
                elif req.kind == protocol.COMMIT and self.answer_commit is not None:
                    sock.send_multipart([ident, *self.answer_commit(req)])
                elif req.kind == protocol.COMMIT:
                    reply = protocol.Header(kind=protocol.COMMIT_OK, run_id="r", dataset_id="d", replica=0,
                                            step=req.step, request_id=req.request_id, instance="fake-1",
                                            body={"committed_step": self._committed})
                    sock.send_multipart([ident, *encoding.encode(reply)])
        finally:
            sock.close(0)


def _arrays() -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(4, dtype="<i4").reshape(1, 4), "labels": np.zeros((1, 4), dtype="<i4"),
            "position_ids": np.arange(4, dtype="<i4").reshape(1, 4), "cu_seqlens": np.array([0, 4], dtype="<i4")}


def _batch(req: protocol.Header, body: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> list[Any]:
    h = protocol.Header(kind=protocol.BATCH, run_id="r", dataset_id="d", replica=0, step=req.step, micro=req.micro,
                        request_id=req.request_id, instance="fake-1", body=body)
    return [bytes(memoryview(f)) for f in encoding.encode(h, _arrays() if arrays is None else arrays)]


def _state(step: int) -> dict[str, Any]:
    return {"kind": "sluice.data-state", "step": step}


def _first_batch_error(daemon: FakeDaemon) -> SluiceError:
    client = Client(daemon.endpoint, run_id="r", dataset_id="d", credits=2, timeout_s=2, reconnect_s=3,
                    connect_s=3, max_wait_s=5, as_numpy=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(SluiceError) as got:
            for _ in range(3):
                next(client)
    finally:
        client.close()
    assert time.monotonic() - t0 < 20
    return got.value


def test_a_stranger_daemon_that_behaves_is_served():
    with FakeDaemon(lambda req: _batch(req, {"micro_per_step": 1, "state": _state(req.step)})) as d:
        client = Client(d.endpoint, run_id="r", dataset_id="d", credits=2, timeout_s=2, as_numpy=True)
        try:
            got = [next(client) for _ in range(3)]
        finally:
            client.close()
    assert [b["step"] for b in got] == [0, 1, 2]
    assert np.array_equal(got[0]["input_ids"], _arrays()["input_ids"])


@pytest.mark.parametrize("body, named", [
    ({"micro_per_step": "x"}, "micro_per_step"),
    ({"micro_per_step": None}, "micro_per_step"),
    ({"micro_per_step": 0}, "micro_per_step"),
    ({"micro_per_step": [1]}, "micro_per_step"),
    ({"micro_per_step": 1.5, "state": {"kind": "sluice.data-state", "step": 0}}, "micro_per_step"),
    ({"micro_per_step": True, "state": {"kind": "sluice.data-state", "step": 0}}, "micro_per_step"),
    ({"micro_per_step": 1, "state": "x"}, "data state"),
    ({"micro_per_step": 1, "state": {"step": "0"}}, "data state"),
    ({"micro_per_step": 1}, "data state"),
])
def test_a_stranger_daemon_s_hostile_batch_body_is_our_error_naming_the_field(body, named):
    with FakeDaemon(lambda req: _batch(req, body)) as d:
        err = _first_batch_error(d)
    assert isinstance(err, ProtocolError) and named in str(err), repr(err)


def test_specs_that_pass_once_and_then_change_are_refused():
    calls = itertools.count()

    def batch(req: protocol.Header) -> list[Any]:
        frames = _batch(req, {"micro_per_step": 1, "state": _state(req.step)})
        if next(calls) >= 1:  # the same header bytes, a frame of another size
            frames[1] = frames[1][:-4]
        return frames

    with FakeDaemon(batch) as d:
        err = _first_batch_error(d)
    assert isinstance(err, WireError) and err.code == errorcodes.E_TRUNCATED and "input_ids" in str(err)


@pytest.mark.parametrize("hello, named", [
    (lambda b: {k: v for k, v in b.items() if k != "instance"}, "instance"),
    (lambda b: {**b, "generation": "zero"}, "generation"),
    (lambda b: {**b, "micro_per_step": "one"}, "micro_per_step"),
    (lambda b: {**b, "floor_step": None}, "floor_step"),
])
def test_a_stranger_daemon_s_hostile_hello_is_our_error_naming_the_field(hello, named):
    with FakeDaemon(lambda req: _batch(req, {"micro_per_step": 1, "state": _state(req.step)}), hello) as d:
        err = _first_batch_error(d)
    assert isinstance(err, ProtocolError) and named in str(err), repr(err)


@pytest.mark.parametrize("committed", ["0", None, 1.0, True, -2, "a BATCH"])
def test_a_stranger_daemon_s_hostile_commit_reply_is_our_error_naming_the_field(committed):
    def batch(req: protocol.Header) -> list[Any]:
        return _batch(req, {"micro_per_step": 1, "state": _state(req.step)})

    with FakeDaemon(batch, committed=committed) as d:
        if committed == "a BATCH":  # under the COMMIT's request ID (the client reads such a reply in full)
            d.answer_commit = batch
        client = Client(d.endpoint, run_id="r", dataset_id="d", credits=1, timeout_s=2, reconnect_s=3, connect_s=3,
                        as_numpy=True)
        try:
            assert next(client)["step"] == 0
            with pytest.raises(ProtocolError, match="committed_step"):
                client.commit(0)
        finally:
            client.close()
