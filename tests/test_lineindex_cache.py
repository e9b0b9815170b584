"""The raw fill's line index as a node-cache object (sluice/tokenize/lineindexfile.py, physical/lineindexes.py).

Specifications:
* The file format round-trips a `LineIndex`; a file with a flipped byte, cut
  short, with another magic, or made for other bytes (digest or size) is
  refused with a CacheError naming the file.
* A DocSource whose raw fill built the index of a plain jsonl object stores it
  in the node cache; a second DocSource on the same cache folder (a restarted
  or second daemon), whose raw fetch is a hit, locates the object's last
  record with the stored index (no line counted: `line_indexes.loaded`,
  `indexed_objects`).
* A damaged stored index is refused (counted, named in the log), dropped and
  built again from the raw file, and the documents served are the same: the
  stream of 8 steps in `global` order equals the in-order oracle.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np
import pytest

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.errors import CacheError
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.lineindex import LineIndexer
from sluice.tokenize.lineindexfile import index_key, read_index, write_index
from sluice.tokenize.tokcache import lookup_tokens
from test_out_of_order import HeldEncoder, _one_object, in_order_oracle, stream_digests


# ---------------------------------------------------------------- the file format
def _index(data: bytes, digest: str = "b3:" + "ab" * 32):
    ix = LineIndexer(window=64)
    ix.feed(memoryview(data), 0)
    return ix.finish(digest, len(data))


def test_the_file_round_trips_and_anything_else_is_refused_by_name(tmp_path):
    data = b"".join(json.dumps({"text": "x" * (i % 50)}).encode() + (b"\n\n" if i % 7 else b"\n")
                    for i in range(300))
    index = _index(data)
    assert len(index.m_offsets) > 10
    path = tmp_path / "ix"
    write_index(path, index)
    back = read_index(path, index.digest, index.size)
    assert back == index  # every field, the marks too

    good = path.read_bytes()
    cases = {
        "flipped": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],
        "short": good[:-8],
        "magic": b"XXXXXXX\0" + good[8:],
    }
    for name, bad in cases.items():
        (tmp_path / name).write_bytes(bad)
        with pytest.raises(CacheError, match=rf"cached line index {tmp_path / name}"):
            read_index(tmp_path / name, index.digest, index.size)
    with pytest.raises(CacheError, match=r"made for .* not sluice-lineindex/1 of b3:cd"):
        read_index(path, "b3:" + "cd" * 32, index.size)  # another object
    with pytest.raises(CacheError, match="made for"):
        read_index(path, index.digest, index.size + 1)


# ------------------------------------------------------------------- DocSource
class Ref:
    def __init__(self, obj: int, record: int) -> None:
        self.source, self.obj, self.record = 0, obj, record


def _close_unfilled(docs: DocSource, enc: HeldEncoder) -> None:
    """Close `docs` while its fills are held: they stop, no token object is published."""
    t = threading.Thread(target=docs.close)
    t.start()
    time.sleep(0.2)
    enc.release()
    t.join(60)
    assert not t.is_alive()


def _first_run(manifest, cache_dir, records):
    """A daemon's run that fetched the raw objects (their fills index them) and served `records`
    out of order, then stopped before any token object was complete."""
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0)
    with NodeCache(cache_dir, 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            got = [docs(r) for r in records]
        finally:
            _close_unfilled(docs, enc)
        # (after close: the thread that fetched stores the index after the demand task could serve)
        counts = (docs.indexed_objects, docs.line_indexes.stored, docs.line_indexes.loaded)
        for o in range(len(manifest.sources[0].objects)):
            assert lookup_tokens(cache, manifest, 0, o, enc) is None  # the next run has raw bytes only
    return got, counts


def test_a_second_docsource_locates_the_last_record_with_the_stored_index(tmp_path, tokenizer_file):
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    last = Ref(0, manifest.sources[0].objects[0].records - 1)
    want = encoder_for_manifest(manifest).encode_batch([f"doc {last.record} " + "z" * (last.record % 17)])[0]
    got, first = _first_run(manifest, tmp_path / "cache", [last])
    assert np.array_equal(got[0], want)
    assert first == (1, 1, 0)  # located with the fill's index, which was stored

    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:  # a restarted daemon: the raw fetch is a hit
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            again = docs(last)
        finally:
            _close_unfilled(docs, enc)
        second = (docs.indexed_objects, docs.line_indexes.stored, docs.line_indexes.loaded, docs.line_indexes.refused)
    assert np.array_equal(again, want)
    assert second == (1, 0, 1, 0)  # no line counted: the index came from the node cache


def test_a_damaged_stored_index_is_refused_rebuilt_and_the_stream_equals_the_oracle(tmp_path, tokenizer_file,
                                                                                     caplog):
    from sluice.loaderd.logical import Plan
    from sluice.runspec import load_runspec

    corpus = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file)
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))  # order "global": documents from anywhere
    objects = manifest.sources[0].objects
    plain = encoder_for_manifest(manifest)
    want = in_order_oracle(plan, plain, tmp_path / "ref-cache")

    _, first = _first_run(manifest, tmp_path / "cache", [Ref(o, 1) for o in range(len(objects))])
    assert first[1] == len(objects)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:  # every stored index damaged on disk
        for o in objects:
            pin = cache.get_derived(index_key(o.digest))
            assert pin is not None
            path = pin.path
            pin.close()
            os.chmod(path, 0o644)
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0xFF
            open(path, "wb").write(bytes(data))

    enc = HeldEncoder(plain, fill_free=0)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache, caplog.at_level(logging.WARNING, "sluice.loaderd"):
        docs = DocSource(manifest, cache, enc, workers=len(objects), chunk_bytes=2048)
        try:
            got = stream_digests(plan, docs)
        finally:
            _close_unfilled(docs, enc)
        counts = (docs.line_indexes.refused, docs.line_indexes.loaded, docs.line_indexes.stored, docs.indexed_objects)
        rebuilt = []
        for o in objects:  # stored again, whole
            pin = cache.get_derived(index_key(o.digest))
            assert pin is not None
            rebuilt.append(read_index(pin.path, o.digest, o.size))
            pin.close()
    assert got == want
    assert counts == (len(objects), 0, len(objects), len(objects))  # refused, rebuilt, stored, located with it
    assert all(r.records == o.records for r, o in zip(rebuilt, objects))
    refusals = [r.getMessage() for r in caplog.records if "refused, dropped from the node cache" in r.getMessage()]
    assert len(refusals) == len(objects) and all("cached line index" in m and "damaged" in m for m in refusals)
