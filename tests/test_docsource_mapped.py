"""`DocSource.mapped`: the fast path's one-lookup path to mapped token shards.

For token shards already memory-mapped, `mapped` gives each object's (offsets,
tokens, records), whose slices are exactly the arrays the per-document callback
returns; it counts nothing (the draws `count` the documents they slice). An
object not mapped yet whose tokens are a fetch or a map away (a token object,
cached tokens) is started and waited for, as the callback would; `mapped_now`
never waits and starts nothing. A record outside its shard
(``record >= records``) goes to the callback, which raises the error that
names the shard.
"""

from __future__ import annotations

import pytest

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.errors import SluiceError
from sluice.loaderd.logical import DocRef, Plan
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("views"), "sltok", tokenizer_file, docs=60, objects=2)


def test_mapped_shards_slice_to_the_callbacks_documents_and_count_nothing(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            src = manifest.sources[0]
            objs = [0, 0, 1, 0, 1]
            recs = [0, src.objects[0].records - 1, 2, 1, 0]
            assert docs.mapped_now(0, objs) is None  # nothing mapped yet, and nothing started
            assert not docs.filling and docs.misses == 0
            calls, hits = docs.calls, docs.hits
            shards = docs.mapped(0, objs)  # token objects: fetched, verified, mapped, waited for
            assert shards is not None and sorted(shards) == [0, 1]
            assert (docs.calls, docs.hits, docs.misses) == (calls, hits, 0)  # (started as a prefetch would)
            refs = [plan.ref(0, 0, src.objects[o].start + r) for o, r in zip(objs, recs)]
            want = [docs(r) for r in refs]
            calls, hits = docs.calls, docs.hits
            assert docs.mapped_now(0, objs) is not None
            for o, r, w in zip(objs, recs, want):
                offsets, tokens, records = shards[o]
                assert records == src.objects[o].records
                got = tokens[int(offsets[r]):int(offsets[r + 1])]
                assert got.tobytes() == w.tobytes() and got.dtype == w.dtype
            assert (docs.calls, docs.hits) == (calls, hits)
            docs.count(0, 3)
            assert (docs.calls, docs.hits) == (calls + 3, hits + 3)
            # a record outside its shard is the draw's to refuse: `records` bounds it, the callback names it
            past = src.objects[1].records
            with pytest.raises(SluiceError, match="outside"):
                docs(DocRef(0, 0, src.objects[1].start + past, 1, past, "beyond"))
        finally:
            docs.close()


def test_text_being_tokenized_is_not_waited_for_cached_tokens_are(tmp_path, tokenizer_file):
    """A text object whose tokens the node cache does not hold is made by its fill, and its documents come as
    they are made (out of order too): `mapped` does not wait for that fill (None at once, the per-document
    path reads it), and `making` says a fill is at work. Once its tokens are cached, a new source's `mapped`
    starts the object, waits for the map and serves it; nothing is made from text then."""
    import threading

    from sluice.tokenize import encoder_for_manifest
    from test_out_of_order import HeldEncoder, _one_object

    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=1)  # the fill writes one chunk, then waits
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            first = docs(DocRef(0, 0, 0, 0, 0, "first"))  # starts the fill (held after its first chunk)
            got: list = []
            t = threading.Thread(target=lambda: got.append(docs.mapped(0, [0])), daemon=True)
            t.start()
            t.join(20)
            assert not t.is_alive(), "mapped waited for a fill that makes tokens from text"
            assert got == [None] and docs.making and docs.filling
        finally:
            enc.fill_gate.set()
            docs.wait_filled(60)
            docs.close()
        docs = DocSource(manifest, cache, encoder_for_manifest(manifest), workers=1, chunk_bytes=2048)
        try:
            shards = docs.mapped(0, [0])  # cached tokens: a map away, waited for
            assert shards is not None and not docs.making and docs.misses == 0
            offsets, tokens, _ = shards[0]
            assert tokens[int(offsets[0]):int(offsets[1])].tolist() == first.tolist()
        finally:
            docs.close()
