"""`DocSource.mapped`: the fast path's one-lookup path to mapped token shards.

For token shards already memory-mapped, `mapped` gives each object's (offsets,
tokens, records), whose slices are exactly the arrays the per-document callback
returns; it counts nothing (the draws `count` the documents they slice), and
stands aside (None) whenever the per-document path has something to do: an
object not mapped yet (it must be started and waited for). A record outside its
shard (``record >= records``) goes to the callback, which raises the error that
names the shard.
"""

from __future__ import annotations

import numpy as np
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
            assert docs.mapped(0, objs) is None  # nothing mapped yet: the callback starts the objects
            refs = [plan.ref(0, 0, src.objects[o].start + r) for o, r in zip(objs, recs)]
            want = [docs(r) for r in refs]
            calls, hits = docs.calls, docs.hits
            shards = docs.mapped(0, objs)
            assert shards is not None and sorted(shards) == [0, 1]
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
