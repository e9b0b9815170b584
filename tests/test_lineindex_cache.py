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
* A raw object cached without its index (by an older `sluice cache warm`, or
  a version before indexes were stored): `sluice cache warm` stores it, from
  the fill's observer or in one pass over the cached file, and a new
  DocSource locates the last record with it; a DocSource that had to count
  the lines of such an object builds the index once, off the serving path,
  and stores it for the next (`line_indexes.built`, then `loaded`).
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
    with pytest.raises(CacheError, match=r"made for .* not sluice-lineindex/2 of b3:cd"):
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


def _fetch_raw_only(manifest, cache_dir) -> None:
    """The raw object cached the way an older `sluice cache warm` left it: no line index."""
    obj = manifest.sources[0].objects[0]
    with NodeCache(cache_dir, 1 << 30) as cache:
        cache.fetch(obj, manifest.resolve(obj.location)).close()
        assert cache.get_derived(index_key(obj.digest)) is None


def _locate_last(manifest, cache_dir, *, wait_stored: bool = False):
    """A new DocSource (its fill held: no token object is made) serves the object's last record;
    its counters (indexed_objects, loaded, built, stored) after, once it stored an index if `wait_stored`."""
    last = Ref(0, manifest.sources[0].objects[0].records - 1)
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0)
    with NodeCache(cache_dir, 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            got = docs(last)
            deadline = time.monotonic() + 30
            while wait_stored and not docs.line_indexes.stored:
                assert time.monotonic() < deadline, "no line index stored"
                time.sleep(0.02)
        finally:
            _close_unfilled(docs, enc)
        ix = docs.line_indexes
        counts = (docs.indexed_objects, ix.loaded, ix.built, ix.stored)
    want = encoder_for_manifest(manifest).encode_batch([f"doc {last.record} " + "z" * (last.record % 17)])[0]
    assert np.array_equal(got, want)
    return counts


def test_cache_warm_stores_the_line_index_and_a_new_docsource_loads_it(tmp_path, tokenizer_file, sluice_main):
    path = _one_object(tmp_path / "c", tokenizer_file, 3000)
    manifest = load_manifest(path)
    obj = manifest.sources[0].objects[0]
    res = sluice_main("cache", "warm", path, tmp_path / "filled", "--budget", "64M", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["filled"], out["line_indexes_stored"]) == (1, 1)  # from the fill's observer

    _fetch_raw_only(manifest, tmp_path / "present")
    res = sluice_main("cache", "warm", path, tmp_path / "present")
    assert res.returncode == 0, res.stderr
    assert "0 filled (0 bytes), 1 already present, 0 failed; 1 line indexes stored" in res.stdout  # one pass
    res = sluice_main("cache", "warm", path, tmp_path / "present", "--json")
    assert json.loads(res.stdout)["line_indexes_stored"] == 0  # stored once

    stored = []
    for d in ("filled", "present"):
        with NodeCache(tmp_path / d, 1 << 30) as cache:
            pin = cache.get_derived(index_key(obj.digest))
            assert pin is not None
            stored.append(read_index(pin.path, obj.digest, obj.size))
            pin.close()
    assert stored[0] == stored[1] and stored[0].records == obj.records  # the same marks either way
    assert _locate_last(manifest, tmp_path / "present") == (1, 1, 0, 0)  # located with it, no line counted


def test_a_docsource_that_counted_the_lines_stores_the_index_for_the_next(tmp_path, tokenizer_file):
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    _fetch_raw_only(manifest, tmp_path / "cache")
    # loaded none, built and stored it once (the locator counted, unless the build was done first)
    first = _locate_last(manifest, tmp_path / "cache", wait_stored=True)
    assert first[1:] == (0, 1, 1), first
    second = _locate_last(manifest, tmp_path / "cache")
    assert second == (1, 1, 0, 0), second  # the next one counts no line
