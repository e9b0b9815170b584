"""The line index a cache fill builds for a plain jsonl object (sluice/tokenize/lineindex.py).

Specifications:
* Fed any object in chunks of any sizes, a `LineIndexer` gives an index with
  which `RecordLocator` reads, for any records, the texts the in-order reader
  gives (blank and "\\r" lines, CRLF, no final newline), without counting a
  line; its record count is the object's.
* Built by a real `NodeCache` fill (`fetch(observe=...)`), it describes the
  published bytes; a fill that is not a fill (a hit) gives no index.
* It is tied to the digest: an index of other bytes (another digest, another
  size) or with damaged marks is never used: the locator counts the lines
  itself and still gives the right texts. A restarted try resets it; chunks
  out of order or short of the size give none.
* Through DocSource (tests/test_out_of_order.py): with every in-order fill
  held, a plain jsonl corpus is served out of order with the fills' indexes
  and the stream equals the in-order oracle.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import replace
from pathlib import Path

import blake3
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.cache import NodeCache
from sluice.manifest.sources import ObjectRecord
from sluice.tokenize.chunks import iter_text_chunks
from sluice.tokenize.lineindex import LineIndex, LineIndexer
from sluice.tokenize.records import RecordLocator

_LINE = st.one_of(
    st.just(b""), st.just(b"\r"),  # blank lines: not records
    st.builds(lambda t, crlf: json.dumps({"text": t}).encode() + (b"\r" if crlf else b""),
              st.text(st.characters(blacklist_categories=("Cs",)), max_size=300), st.booleans()),
)


def _b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def _index(data: bytes, cuts: list[int], window: int) -> LineIndex | None:
    """Feed `data` to a LineIndexer in pieces cut at `cuts` (sorted, deduplicated here)."""
    indexer = LineIndexer(window)
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            indexer.feed(memoryview(data)[a:b], a)
    return indexer.finish(_b3(data), len(data))


def _texts(path: Path) -> list[str]:
    return [t for c in iter_text_chunks(str(path), "jsonl", "none", "text", "obj-x") for t in c]


@settings(max_examples=examples(60), deadline=None)
@given(lines=st.lists(_LINE, max_size=60), final_newline=st.booleans(), window=st.integers(1, 700),
       cuts=st.lists(st.integers(0, 10**6), max_size=8), picks=st.lists(st.integers(0, 10**6), max_size=12))
def test_an_index_fed_in_any_chunks_locates_the_in_order_texts(tmp_path_factory, lines, final_newline, window,
                                                               cuts, picks):
    d = tmp_path_factory.mktemp("li")
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    (d / "o").write_bytes(data)
    texts = _texts(d / "o")
    index = _index(data, cuts, window)
    assert index is not None and index.records == len(texts)
    loc = RecordLocator(str(d / "o"), "jsonl", "none", "text", "obj-x", index=index, digest=_b3(data))
    try:
        assert loc.used_index
        if texts:
            chosen = [p % len(texts) for p in picks]
            assert loc.texts(chosen) == [texts[i] for i in chosen]
            assert loc.texts(list(range(len(texts)))[::-1]) == texts[::-1]
        with pytest.raises(Exception, match=rf"obj-x: record {len(texts)} is beyond the object's {len(texts)} records"):
            loc.texts([len(texts)])
    finally:
        loc.close()


def _jsonl(n: int, seed: int = 0) -> bytes:
    return b"".join(json.dumps({"text": f"doc {seed}-{i} " + "w" * (i % 97)}).encode() + b"\n" for i in range(n))


def test_a_cache_fill_builds_the_index_of_the_bytes_it_published_and_a_hit_builds_none(tmp_path):
    data = _jsonl(20_000)  # about 2 MB: many fill chunks and many marks
    src = tmp_path / "o.jsonl"
    src.write_bytes(data)
    obj = ObjectRecord(location="o.jsonl", digest=_b3(data), size=len(data), records=20_000, start=0)
    with NodeCache(tmp_path / "cache", 64 << 20, chunk_bytes=64 << 10) as cache:
        indexer = LineIndexer()
        with cache.fetch(obj, str(src), observe=indexer.feed) as pin:
            index = indexer.finish(obj.digest, obj.size)
            assert index is not None and index.records == 20_000 and index.usable(obj.digest, obj.size)
            loc = RecordLocator(pin.path, "jsonl", "none", "text", "o", index=index, digest=obj.digest)
            assert loc.used_index
            assert loc.texts([19_999, 0, 12_345]) == [f"doc 0-{i} " + "w" * (i % 97) for i in (19_999, 0, 12_345)]
            loc.close()
        hit = LineIndexer()
        cache.fetch(obj, str(src), observe=hit.feed).close()  # published: nothing is read, nothing observed
        assert hit.finish(obj.digest, obj.size) is None


def test_an_index_of_other_bytes_or_with_damaged_marks_is_never_used(tmp_path):
    a, b = _jsonl(3000, seed=1), _jsonl(3000, seed=2)  # same line count, other texts
    (tmp_path / "b").write_bytes(b)
    want = _texts(tmp_path / "b")
    good = _index(b, [70_000, 140_000], 4096)
    other = _index(a, [], 4096)
    assert good is not None and other is not None
    unordered = array("q", good.m_offsets)
    unordered[2], unordered[3] = unordered[3], unordered[2]
    damaged = {
        "another object's index": other,
        "another digest": replace(good, digest=_b3(a)),
        "another size": replace(good, size=len(b) - 1, scanned=len(b) - 1),
        "offsets out of order": replace(good, m_offsets=unordered),
        "a first mark not at 0": replace(good, m_offsets=array("q", [5, *good.m_offsets[1:]])),
        "mark arrays of different lengths": replace(good, m_lines=good.m_lines[:-1]),
        "more records marked than the object holds": replace(good, records=good.m_records[-1] - 1),
    }
    for why, index in damaged.items():
        loc = RecordLocator(str(tmp_path / "b"), "jsonl", "none", "text", "b", index=index, digest=_b3(b))
        try:
            assert not loc.used_index, why
            assert loc.texts([2999, 7, 1500]) == [want[2999], want[7], want[1500]], why
        finally:
            loc.close()
    loc = RecordLocator(str(tmp_path / "b"), "jsonl", "none", "text", "b", index=good, digest=_b3(b))
    assert loc.used_index and loc.texts([2999]) == [want[2999]]
    loc.close()
    # A compressed object's locator indexes its decoded bytes: an index is never taken for it.
    (tmp_path / "b.zst").write_bytes(zstandard.ZstdCompressor().compress(b))
    loc = RecordLocator(str(tmp_path / "b.zst"), "jsonl", "zstd", "text", "b", spool_dir=str(tmp_path),
                        index=good, digest=_b3(b))
    assert not loc.used_index and loc.texts([2999]) == [want[2999]]
    loc.close()


def test_a_restarted_try_resets_the_indexer_and_a_gap_or_short_feed_gives_none():
    first, second = _jsonl(500, seed=3), _jsonl(800, seed=4)
    indexer = LineIndexer(1024)
    indexer.feed(memoryview(first)[:10_000], 0)
    indexer.feed(memoryview(first)[10_000:20_000], 10_000)  # the try fails; the fill starts again:
    for at in range(0, len(second), 4096):
        indexer.feed(memoryview(second)[at : at + 4096], at)
    again = indexer.finish(_b3(second), len(second))
    assert again is not None and again.records == 800 and again == _index(second, [], 1024)

    gap = LineIndexer()
    gap.feed(memoryview(second)[:1000], 0)
    gap.feed(memoryview(second)[2000:], 2000)  # bytes 1000-2000 never seen
    assert gap.finish(_b3(second), len(second)) is None
    short = LineIndexer()
    short.feed(memoryview(second)[:1000], 0)
    assert short.finish(_b3(second), len(second)) is None


@pytest.mark.parametrize("hash_thread", [False, True])
def test_a_fill_shows_its_observer_every_byte_of_every_try_in_order(tmp_path, hash_thread):
    from sluice.errors import DigestMismatch

    data = _jsonl(3000)
    src = tmp_path / "o.jsonl"
    src.write_bytes(data)
    obj = ObjectRecord(location="o.jsonl", digest=_b3(data), size=len(data), records=3000, start=0)
    seen: list[tuple[int, bytes]] = []
    with NodeCache(tmp_path / "ok", 64 << 20, chunk_bytes=16 << 10, hash_thread=hash_thread) as cache:
        cache.fetch(obj, str(src), observe=lambda chunk, at: seen.append((at, bytes(chunk)))).close()
    assert [at for at, _ in seen] == [sum(len(c) for _, c in seen[:i]) for i in range(len(seen))]
    assert b"".join(c for _, c in seen) == data
    src.write_bytes(data[:-1] + b"x")  # changed since the freeze: every try mismatches
    tries: list[int] = []
    with NodeCache(tmp_path / "bad", 64 << 20, chunk_bytes=16 << 10, retries=2, backoff_s=0.001,
                   hash_thread=hash_thread) as cache:
        with pytest.raises(DigestMismatch):
            cache.fetch(obj, str(src), observe=lambda chunk, at: tries.append(at))
    assert tries.count(0) == 3  # each try starts again at offset 0 (an indexer resets there)


def test_the_staged_indexer_gives_the_index_the_plain_one_gives_across_tries_and_stages():
    from sluice.tokenize.lineindex import StagedIndexer

    first, second = _jsonl(20_000, seed=5), _jsonl(30_000, seed=6)  # each over one staging buffer
    staged = StagedIndexer(4096)
    for at in range(0, 1_500_000, 100_000):  # a try that fails part way, then a whole one
        staged.feed(memoryview(first)[at : at + 100_000], at)
    for at in range(0, len(second), 77_777):
        staged.feed(memoryview(second)[at : at + 77_777], at)
    got = staged.finish(_b3(second), len(second))
    assert got is not None and got == _index(second, [], 4096) and got.records == 30_000
    idle = StagedIndexer()
    idle.close()  # a hit: nothing fed, no thread started
    assert idle.finish(_b3(second), len(second)) is None
