"""`DocSource.views`: the columnar draws' one-lookup path to mapped token shards.

For token shards already memory-mapped, `views` returns exactly the arrays the
per-document callback returns, counts nothing (the draws look up a few more
candidates than they use and `count` the used ones), and stands aside (None)
whenever the per-document path has something to do: an object not mapped yet
(it must be started and waited for) or a record outside its shard (the callback
raises the error that names the shard).
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


def test_views_of_mapped_shards_equal_the_callback_and_count_nothing(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            src = manifest.sources[0]
            objs = [0, 0, 1, 0, 1]
            recs = [0, src.objects[0].records - 1, 2, 1, 0]
            assert docs.views(0, objs, recs) is None  # nothing mapped yet: the callback starts the objects
            refs = [plan.ref(0, 0, src.objects[o].start + r) for o, r in zip(objs, recs)]
            want = [docs(r) for r in refs]
            calls, hits = docs.calls, docs.hits
            got = docs.views(0, objs, recs)
            assert got is not None and [g.tobytes() for g in got] == [w.tobytes() for w in want]
            assert all(g.dtype == w.dtype for g, w in zip(got, want))
            assert (docs.calls, docs.hits) == (calls, hits)
            docs.count(0, 3)
            assert (docs.calls, docs.hits) == (calls + 3, hits + 3)
            # a record outside its shard: None here, the callback's named error there
            past = src.objects[1].records
            assert docs.views(0, [1], [past]) is None
            with pytest.raises(SluiceError, match="outside"):
                docs(DocRef(0, 0, src.objects[1].start + past, 1, past, "beyond"))
            assert np.array_equal(docs.views(0, [1], [0])[0], want[-1])
        finally:
            docs.close()
