"""A cold start's overlap (docs/loaderd.md, "Start-up"): what the daemon does early, and what it no longer does.

* The tokenizer parses on a thread of its own from the first token-cache miss
  (`DeferredEncoder.load_soon`), while that fill fetches and decodes its raw
  object; the encoder served is still the one `encoder()` checks against the
  identity, and a warm cache still never parses it (test_startup.py).
* Serving imports neither asyncio (pyzmq's monitor helper) nor numpy.ma
  (`np.unique`): 25-100 ms of the GIL each, in the first step's path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.loaderd.endpoint import monitor_event
from sluice.loaderd.physical.assemble import DeferredEncoder
from sluice.manifest.model import load_manifest
from sluice.npsets import sorted_unique


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("early"), "jsonl.zst", tokenizer_file)


def test_load_soon_parses_once_ahead_of_the_first_encode(corpus):
    deferred = DeferredEncoder(load_manifest(corpus / "manifest.json"))
    deferred.load_soon()
    deferred.load_soon()  # one thread
    enc = deferred.encoder()  # waits for that load under the lock
    assert deferred.loaded and deferred.encoder() is enc


def test_monitor_events_are_read_without_pyzmq_s_helper():
    import struct

    import zmq

    for event in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED, 0x8000):
        assert monitor_event([struct.pack("=Hi", event, 7), b"tcp://127.0.0.1:1"]) == event
    assert monitor_event([b"short", b"x"]) == 0 and monitor_event([b"x" * 6]) == 0


def test_sorted_unique_is_np_unique():
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 1000):
        for dtype in (np.int64, np.int32, np.uint32):
            a = rng.integers(0, 40, n).astype(dtype)
            got, want = sorted_unique(a), np.unique(a)
            assert got.dtype == want.dtype and np.array_equal(got, want)


_SPY = ("import atexit, json, sys; from sluice.loaderd.cli import main\n"
        "atexit.register(lambda: open({out!r}, 'w').write(json.dumps("
        "[m for m in ('asyncio', 'numpy.ma') if m in sys.modules])))\n"
        "sys.exit(main(sys.argv[1:]))")


@pytest.mark.slow
def test_a_cold_daemon_serves_the_plan_without_asyncio_or_numpy_ma(corpus, tmp_path):
    want = {step: digest for (step, _), (digest, _) in reference(corpus, 4, 1).items()}
    seen = tmp_path / "imported.json"
    d = Daemon(corpus, cache=tmp_path / "cache")  # an empty node cache: every step tokenized on the fly
    d.args[2] = _SPY.format(out=str(seen))
    with d:
        c = d.client()
        batches = []
        for mb in c:
            batches.append(mb)
            if mb["step"] == 3 and mb["micro"] + 1 == c.info["micro_per_step"]:
                break
        got = stream_digests(batches, c.info["micro_per_step"])
        connections = c.stats()["connections"]
        c.close()
    assert d.proc.returncode == 0
    assert got == want and connections >= 1  # the plan's stream; the monitor's events were counted
    assert json.loads(seen.read_text()) == []
