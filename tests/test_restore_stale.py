"""A RESTORE stops work for the position it left (docs/tokenize.md, "Out of order": "Stale work").

Specifications:
* After `DocSource.restored(thread)`, that thread's next prefetch makes every
  object still being filled that no window holds and no reader waits for
  stale: its in-order fill stops at its next chunk (counted), nothing is
  published for it, and a later need of the object gets the same tokens.
* Without a RESTORE, the same move to other objects stops nothing: fills of
  objects the lanes passed go on and complete the node cache's token objects.
* A real daemon: after a client RESTOREs from step 0 of a big first object to
  a state deep in the last object, the first object's fill stops (STATS
  counts it in `sluice_stale_fills_stopped_total`) and the batch served is
  the one a daemon that read there in order served.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from loaderd_support import Daemon, build_corpus
from sluice.cache import NodeCache
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.formats import read_texts
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.tokcache import lookup_tokens
from test_out_of_order import HeldEncoder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("stale"), "jsonl.zst", tokenizer_file)


class Ref:
    def __init__(self, obj: int, record: int) -> None:
        self.source, self.obj, self.record = 0, obj, record


def _held_fill(enc: HeldEncoder, timeout: float = 30.0) -> None:
    """Wait until a fill thread made its first chunk and is held in its second encode call."""
    deadline = time.monotonic() + timeout
    while not any(n.startswith("loaderd-worker") and c > enc.fill_free for n, c in enc.calls.items()):
        assert time.monotonic() < deadline, f"no fill reached its second chunk: {enc.calls}"
        time.sleep(0.01)


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "moved-on"])
def test_a_restore_stops_the_fill_of_an_object_left_behind(corpus, tmp_path, restore):
    manifest = load_manifest(corpus / "manifest.json")
    plain = encoder_for_manifest(manifest)
    obj0 = manifest.sources[0].objects[0]
    enc = HeldEncoder(plain, fill_free=1)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        texts0 = read_texts(cache.fetch(obj0, manifest.resolve(obj0.location)).path, "jsonl", obj0.compression,
                            "text", obj0.location)
        docs = DocSource(manifest, cache, enc, workers=2, chunk_bytes=2048)
        try:
            docs.prefetch([Ref(0, r) for r in range(40, 50)])  # the position before: object 0
            _held_fill(enc)  # object 0's fill is inside its second chunk
            if restore:
                docs.restored(threading.get_ident())
            docs.prefetch([Ref(1, r) for r in range(0, 10)])  # the position after: object 1 only
            enc.fill_gate.set()
            assert docs.wait_filled(60)
            stopped, dropped = docs.stale_fills_stopped, docs.stale_records_dropped
            cached = [lookup_tokens(cache, manifest, 0, o, plain) for o in (0, 1)]
            again = docs(Ref(0, 45))  # a later need of object 0: made again, the same ids
        finally:
            enc.release()
            docs.close()
        for pin in cached:
            if pin is not None:
                pin.close()
    assert np.array_equal(again, plain.encode_batch([texts0[45]])[0])
    assert cached[1] is not None  # the new position's object completes either way
    if restore:
        assert stopped == 1 and cached[0] is None  # stopped at its next chunk, nothing published
        assert len(enc.fill_texts) < obj0.records + manifest.sources[0].objects[1].records
    else:
        assert stopped == 0 and cached[0] is not None  # moving on stops nothing: the cache gets object 0


def _in_order_corpus(root: Path, tokenizer_file: Path) -> Path:
    """Three plain jsonl objects read in order by one lane: a large object 0, then objects 1 and 2 a tenth of it
    (the corpus of bench/restore_onfly.py, which measures the same RESTORE), object 0 of 32 MB, large so that its
    fill is still running when the RESTORE comes right after step 0, however busy the machine (8 MB failed
    a full run now and then: the fill had finished)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "restore_onfly.py"
    spec = importlib.util.spec_from_file_location("restore_onfly", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.build(root, tokenizer_file, 32.0)


@pytest.mark.slow
def test_a_daemon_stops_the_fill_a_restore_left_behind(tmp_path, tokenizer_file):
    root = _in_order_corpus(tmp_path / "corpus", tokenizer_file)
    manifest = load_manifest(root / "manifest.json")
    enc = encoder_for_manifest(manifest)
    tokens = sum(len(a) + 1 for o in (0, 1) for a in enc.encode_batch(
        read_texts(str(root / f"o{o}.jsonl"), "jsonl", "none", "text", f"o{o}")))
    far = tokens // (4 * 2048) + 5  # a step inside object 2
    with Daemon(root, cache=tmp_path / "cache-far") as d:  # the state there, and the batch after it
        c = d.client()
        for mb in c:
            if mb["step"] == far:
                break
        state, want = c.state_dict_at(far - 1), mb
        c.close()
    # The RESTORE must come while object 0's in-order fill runs (seconds for 32 MB). On a machine busy enough
    # that the fill finished first, there is nothing to stop: that attempt proves nothing and runs again on a
    # cold cache. A fill that runs on after the RESTORE and completes fails every attempt.
    attempts = []
    for attempt in range(3):
        with Daemon(root, cache=tmp_path / f"cache{attempt}") as d:  # cold: object 0's fill starts with step 0
            c = d.client()
            assert next(iter(c))["step"] == 0
            before = c.stats()["producer"]
            c.load_state_dict(state)
            got = next(iter(c))
            deadline = time.monotonic() + 30
            while (stopped := (stats := c.stats())["producer"]["sluice_stale_fills_stopped_total"]) < 1:
                if stats["producer"]["sluice_decode_inflight_objects"] == 0 or time.monotonic() > deadline:
                    break  # the fill completed (or hung): not stopped
                time.sleep(0.1)
            c.close()
        if stopped >= 1:
            break
        attempts.append(f"attempt {attempt}: STATS producer before the RESTORE {before}, after {stats['producer']}; "
                        f"the daemon's log:\n{d.log.read_text()[-3000:]}")
        if before["sluice_tokenized_tokens_total"] == 0 and before["sluice_decode_inflight_objects"] >= 1:
            break  # the fill ran at the RESTORE and was not stopped: no retry hides that
    else:
        raise AssertionError("object 0's fill had finished before each RESTORE:\n" + "\n".join(attempts))
    assert stopped == 1, "object 0's fill was not stopped after the RESTORE:\n" + "\n".join(attempts)
    assert got["step"] == far
    for k in ("input_ids", "labels", "position_ids"):
        assert np.array_equal(got[k], want[k]), k
