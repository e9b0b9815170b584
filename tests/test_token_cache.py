"""Tokens as a node-cache object, tokenized in bounded chunks (docs/tokenize.md, "Tokens in the node cache").

Specifications:
* a streamed shard (ShardWriter) has the layout and documents `write_shard` gives,
  and documents added so far are readable while it is written;
* the chunked text reader yields exactly `read_texts`, in bounded chunks;
* a document is served before its object is fully tokenized;
* a second DocSource (or daemon) on the same cache tokenizes nothing and serves
  what `sluice plan` computes; `sluice cache warm --tokens` fills them ahead;
* memory stays bounded for an object of any compression ratio (slow tier).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.cache import NodeCache
from sluice.errors import SourceReadError
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest import token_shard
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.chunks import iter_text_chunks


class CountingEncoder:
    """The real Encoder, with its encode_batch calls counted (and optionally held at a gate)."""

    def __init__(self, enc, gate_after: int | None = None) -> None:
        self._enc = enc
        self.calls = 0
        self.gate_after = gate_after
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._enc, name)

    def encode_batch(self, texts):
        self.calls += 1
        if self.gate_after is not None and self.calls > self.gate_after:
            assert self.gate.wait(30), "test gate never opened"
        return self._enc.encode_batch(texts)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("tokcache"), "jsonl.zst", tokenizer_file)


# ---------------------------------------------------------------- the shard writer
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), max_size=30), cuts=st.lists(st.integers(0, 30), max_size=5),
       big_vocab=st.booleans())
def test_streamed_shard_equals_written_shard_and_reads_while_growing(tmp_path_factory, lengths, cuts, big_vocab):
    vocab = 70000 if big_vocab else 1000
    rng = np.random.default_rng(len(lengths))
    docs = [rng.integers(0, vocab, n).astype(np.uint32) for n in lengths]
    d = tmp_path_factory.mktemp("w")
    token_shard.write_shard(d / "a.sltok", docs, tokenizer="b3:" + "1" * 64, raw=None, transform="t", vocab_size=vocab)
    w = token_shard.ShardWriter(d / "b.sltok", len(docs), tokenizer="b3:" + "1" * 64, vocab_size=vocab, transform="t")
    reader = w.reader()
    bounds = sorted({0, len(docs), *(c for c in cuts if c <= len(docs))})
    for lo, hi in zip(bounds, bounds[1:]):
        w.add(docs[lo:hi])
        for i in range(hi):  # everything added so far reads back, before the header exists
            assert np.array_equal(reader.doc(i), docs[i])
    w.finish()
    reader.close()
    a, b = token_shard.open_shard(d / "a.sltok"), token_shard.open_shard(d / "b.sltok")
    assert a.header == b.header
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.tokens, b.tokens)


def test_streamed_shard_refuses_a_wrong_document_count(tmp_path):
    w = token_shard.ShardWriter(tmp_path / "x.sltok", 2, tokenizer="b3:" + "1" * 64, vocab_size=100)
    w.add([np.array([1, 2], np.uint32)])
    with pytest.raises(SourceReadError, match="1 documents written, 2 announced"):
        w.finish()
    with pytest.raises(SourceReadError, match="outside"):
        w.add([np.array([100], np.uint32)])
    w.close()


# ------------------------------------------------------------- chunked texts
def _write_jsonl(path: Path, texts: list[str], compression: str) -> None:
    data = "".join(json.dumps({"text": t}) + "\n" + ("\n" if i % 7 == 0 else "") for i, t in enumerate(texts)).encode()
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_chunks_concatenate_to_read_texts_and_stay_bounded(tmp_path, compression):
    from sluice.manifest.formats import read_texts

    texts = [f"doc {i} " + "x" * (i * 37 % 3000) for i in range(600)]
    path = tmp_path / "o.jsonl"
    _write_jsonl(path, texts, compression)
    chunks = list(iter_text_chunks(str(path), "jsonl", compression, "text", "obj", max_bytes=64 << 10, max_records=50))
    assert [t for c in chunks for t in c] == read_texts(str(path), "jsonl", compression, "text", "obj") == texts
    assert all(1 <= len(c) <= 50 for c in chunks)
    # a chunk closes at the text that reaches max_bytes characters
    assert all(sum(map(len, c[:-1])) < (64 << 10) for c in chunks)
    assert len(chunks) > len(texts) * 1500 // (64 << 10) // 2
    # a smaller first chunk, doubling up to max_bytes: the object's first documents are ready sooner
    ramp = list(iter_text_chunks(str(path), "jsonl", compression, "text", "obj", max_bytes=64 << 10, first_bytes=4096))
    assert [t for c in ramp for t in c] == texts
    assert sum(map(len, ramp[0][:-1])) < 4096 and sum(map(len, ramp[1][:-1])) < 8192


@settings(max_examples=50, deadline=None)
@given(texts=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300), min_size=1, max_size=40),
       compression=st.sampled_from(["none", "gzip", "zstd"]), max_bytes=st.integers(1, 2000),
       max_records=st.integers(1, 12), first=st.one_of(st.none(), st.integers(1, 500)))
def test_chunks_are_read_texts_cut_anywhere(tmp_path_factory, texts, compression, max_bytes, max_records, first):
    from sluice.manifest.formats import read_texts

    path = tmp_path_factory.mktemp("h") / "o.jsonl"
    _write_jsonl(path, texts, compression)
    got = list(iter_text_chunks(str(path), "jsonl", compression, "text", "obj", max_bytes=max_bytes,
                                max_records=max_records, first_bytes=first))
    assert [t for c in got for t in c] == read_texts(str(path), "jsonl", compression, "text", "obj") == texts
    assert all(1 <= len(c) <= max_records and sum(map(len, c[:-1])) < max_bytes for c in got)


def test_chunks_of_webdataset_and_parquet_equal_read_texts(corpus, tmp_path, tokenizer_file):
    from sluice.manifest.formats import read_texts

    for kind, fmt, field in (("wds", "webdataset", "txt"), ("parquet", "parquet", "text")):
        root = build_corpus(tmp_path / kind, kind, tokenizer_file, docs=90)
        for path in sorted((root / "shards").iterdir()):
            got = list(iter_text_chunks(str(path), fmt, "none", field, str(path), max_bytes=4096, max_records=7))
            assert [t for c in got for t in c] == read_texts(str(path), fmt, "none", field, str(path))
            assert len(got) > 1 and all(len(c) <= 7 for c in got)


def test_a_bad_line_is_named_with_object_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(SourceReadError, match=r"obj-x: line 2: text field 'text' not a string"):
        list(iter_text_chunks(str(path), "jsonl", "none", "text", "obj-x"))


# ----------------------------------------------------------- DocSource + cache
def _plan_digests(root: Path, cache_dir: Path, encoder, steps: int = 8, cache_budget: int = 1 << 30,
                  settle: bool = False, **kw):
    from sluice.loaderd.logical import Plan, micro_batches_digest
    from sluice.runspec import load_runspec

    manifest = load_manifest(root / "manifest.json")
    plan = Plan(manifest, load_runspec(root / "run.toml"))
    cache = NodeCache(cache_dir, cache_budget)
    docs = DocSource(manifest, cache, encoder, **kw)
    out = {}
    try:
        state = plan.initial_state()
        for _ in range(steps):
            batch, state = plan.step(state, docs)
            out[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))
        if settle:  # the steps may be served before the fills end (out of order): let them end
            assert docs.wait_filled(120)
        return out, docs
    finally:
        docs.close()
        cache.close()


def test_second_docsource_on_the_same_cache_tokenizes_nothing_and_equals_plan(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    ref = {step: digest for (step, _), (digest, _) in reference(corpus, 8, 1).items()}
    first_enc = CountingEncoder(encoder_for_manifest(manifest))
    first, docs1 = _plan_digests(corpus, tmp_path / "cache", first_enc, settle=True)
    assert first == ref
    assert docs1.tokenized_objects == len(manifest.sources[0].objects) and first_enc.calls > 0
    second_enc = CountingEncoder(encoder_for_manifest(manifest))  # a restart / another daemon on the node
    second, docs2 = _plan_digests(corpus, tmp_path / "cache", second_enc)
    assert second == ref
    assert (second_enc.calls, docs2.tokenized_objects) == (0, 0)
    assert docs2.cached_objects == len(manifest.sources[0].objects)
    # the tokens are derived cache objects, digest-verified like any fill
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        report = cache.verify_all()
        assert report.ok == report.checked == 2 * len(manifest.sources[0].objects)  # raw + tokens


def test_tokens_the_cache_cannot_keep_are_served_from_the_spool_and_equal_the_plan(corpus, tmp_path):
    from sluice.tokenize.tokcache import lookup_tokens

    manifest = load_manifest(corpus / "manifest.json")
    ref = {step: digest for (step, _), (digest, _) in reference(corpus, 8, 1).items()}
    budget = max(obj.size for obj in manifest.sources[0].objects) + 1024  # a raw object fits, its tokens do not
    enc = encoder_for_manifest(manifest)
    # budget_bytes=1: every finished entry but the newest is dropped at once (spool closed, made again on demand)
    got, docs = _plan_digests(corpus, tmp_path / "cache", enc, cache_budget=budget, budget_bytes=1, workers=1)
    assert got == ref
    assert docs.tokenized_objects > len(manifest.sources[0].objects)  # dropped spools were made again
    with NodeCache(tmp_path / "cache", budget) as cache:
        assert all(lookup_tokens(cache, manifest, 0, o, enc) is None for o in range(len(manifest.sources[0].objects)))
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_a_document_is_served_before_its_object_is_tokenized(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    obj = manifest.sources[0].objects[0]
    enc = CountingEncoder(encoder_for_manifest(manifest), gate_after=1)  # chunk 2 waits for the gate
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, chunk_bytes=2048)
        try:
            ref = type("Ref", (), {"source": 0, "obj": 0, "record": 0})()
            first = docs(ref)  # returns although the object's later chunks are held
            assert docs.tokenized_objects == 0 and enc.calls <= 3  # (the first chunk, the next, or a demand)
            enc.gate.set()
            ref.record = obj.records - 1
            docs(ref)
        finally:
            enc.gate.set()
            docs.close()
        whole = encoder_for_manifest(manifest).encode_batch(
            [t for c in iter_text_chunks(cache.fetch(obj, manifest.resolve(obj.location)).path, "jsonl", "zstd",
                                         "text", "o") for t in c][:1])
    assert np.array_equal(first, whole[0])


def test_closing_mid_object_stops_at_the_next_chunk_and_publishes_nothing(corpus, tmp_path):
    from sluice.tokenize.tokcache import lookup_tokens

    manifest = load_manifest(corpus / "manifest.json")
    enc = CountingEncoder(encoder_for_manifest(manifest), gate_after=1)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, chunk_bytes=2048)
        docs(type("Ref", (), {"source": 0, "obj": 0, "record": 0})())
        closer = threading.Thread(target=docs.close)
        closer.start()
        enc.gate.set()  # the held chunk finishes; the next one sees the close
        closer.join(30)
        assert not closer.is_alive()
        assert enc.calls < 6  # stopped within a chunk or two of the close, of the object's ~25 chunks
        assert lookup_tokens(cache, manifest, 0, 0, enc) is None
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # the partial shard is gone


@pytest.fixture(scope="module")
def warmed(corpus, tmp_path_factory):
    """A node cache filled by `sluice cache warm --tokens` (a real subprocess, 2 tokenizing processes)."""
    cache = tmp_path_factory.mktemp("warm") / "cache"
    res = subprocess.run([sys.executable, "-m", "sluice.cli", "cache", "warm", str(corpus / "manifest.json"), str(cache),
                          "--budget", "256M", "--tokens", "--token-workers", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return cache, json.loads(res.stdout)


def test_cache_warm_tokens_fills_once_and_reports(corpus, warmed, sluice_main):
    cache, out = warmed
    n = len(load_manifest(corpus / "manifest.json").sources[0].objects)
    assert out["tokens"]["objects"] == out["tokens"]["tokenized"] == n and out["tokens"]["tokens"] > 0
    again = sluice_main("cache", "warm", corpus / "manifest.json", cache, "--tokens", "--token-workers", "1", "--progress")
    assert again.returncode == 0, again.stderr
    assert f"tokens of {n} text objects: 0 tokenized (0 tokens), {n} already present, 0 failed" in again.stdout
    assert "tokens cache" in again.stderr  # the progress bar (--progress; by default only on a terminal)


def _evict_raw_objects(corpus: Path, cache: Path) -> None:
    """Leave only the tokens in the cache: touch them, then evict down to their bytes (raw objects are older)."""
    from sluice.tokenize.tokcache import token_key

    manifest = load_manifest(corpus / "manifest.json")
    enc = encoder_for_manifest(manifest)
    with NodeCache(cache, 256 << 20, collect=False) as c:
        for o in range(len(manifest.sources[0].objects)):
            c.get_derived(token_key(manifest, 0, o, enc)).close()
        c.flush()
        raw = 0
        for obj in manifest.sources[0].objects:
            pin = c.lookup(obj.digest)
            if pin is not None:
                raw += obj.size
                pin.close()
        c.enforce_budget(c.stats().bytes - raw)
        assert all(c.lookup(obj.digest) is None for obj in manifest.sources[0].objects)
        c.enforce_budget(256 << 20)  # record the daemon's budget again


def test_daemon_on_cached_tokens_serves_the_plan_without_raw_objects(corpus, warmed):
    """Raw objects gone from the cache and from their location: only cached tokens can serve the plan."""
    cache, _ = warmed
    ref = reference(corpus, 6, 1)
    _evict_raw_objects(corpus, cache)
    (corpus / "shards").rename(corpus / "shards-hidden")
    try:
        with Daemon(corpus, cache=cache, extra=()) as d:
            client = d.client(0, 1)
            batches = []
            for mb in client:
                batches.append({k: np.asarray(v).copy() for k, v in mb.items() if k not in ("step", "micro", "samples")}
                               | {"step": mb["step"]})
                if mb["step"] == 5 and mb["micro"] + 1 == client.info["micro_per_step"]:
                    break
            got = stream_digests(batches, client.info["micro_per_step"])
            client.close()
    finally:
        (corpus / "shards-hidden").rename(corpus / "shards")
    assert got == {step: digest for (step, _), (digest, _) in ref.items()}


@pytest.mark.slow
def test_worker_processes_serve_a_document_before_the_object_is_done(tmp_path, tokenizer_file):
    """--worker-kind process: the worker writes the shard, the daemon reads each chunk as it lands."""
    from support import stdlib_texts

    texts = [t[i : i + 2000] for t in stdlib_texts(200) for i in range(0, len(t), 2000)]
    manifest = _one_object_manifest(tmp_path, tokenizer_file, texts * 3)
    enc = encoder_for_manifest(manifest)
    n = manifest.sources[0].objects[0].records
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, worker_kind="process", chunk_bytes=64 << 10)
        try:
            ref = type("Ref", (), {"source": 0, "obj": 0, "record": 0})()
            first = docs(ref)
            assert docs.tokenized_objects == 0  # the object is still being tokenized in the worker
            ref.record = n - 1
            last = docs(ref)  # may come first from the out-of-order path; the worker goes on to the end
            deadline = time.monotonic() + 120
            while docs.tokenized_objects == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            located = (docs.demanded_docs, docs.indexed_objects)
        finally:
            docs.close()
        assert docs.tokenized_objects == 1
        if located[0]:  # the last record came out of order: located with the raw fill's line index (the
            assert located[1] == 1  # raw fill ran in this process, not in the worker)
    want = enc.encode_batch([texts[0], (texts * 3)[-1]])
    assert np.array_equal(first, want[0]) and np.array_equal(last, want[1])


def _one_object_manifest(folder: Path, tokenizer_file: Path, texts: list[str], compression: str = "none"):
    """A manifest of one jsonl object holding `texts` (built directly, as freeze would record it)."""
    import blake3

    from sluice.manifest.model import Manifest
    from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
    from sluice.manifest.sources import ObjectRecord, Source
    from sluice.tokenize import load_tokenizer

    name = "big.jsonl.gz" if compression == "gzip" else "big.jsonl"
    _write_jsonl(folder / name, texts, compression)
    data = (folder / name).read_bytes()
    enc = load_tokenizer(tokenizer_file)
    obj = ObjectRecord(location=name, digest="b3:" + blake3.blake3(data).hexdigest(), size=len(data),
                       records=len(texts), start=0, compression=compression)
    src = Source(name="big", format="jsonl", text_field="text", weight="1", exhaustion="stop", paths=(name,),
                 objects=(obj,))
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    manifest = Manifest(name="one", tokenizer=TokenizerRef(location="tokenizer.json", digest=enc.digest,
                                                           version="1.0", vocab_size=enc.vocab_size),
                        packing=PackingPolicy(seq_len=64, eos_id=0), mixture=MixturePolicy(), sources=(src,))
    (folder / "manifest.json").write_bytes(manifest.canonical_bytes())
    return load_manifest(folder / "manifest.json")


# ---------------------------------------------------------------- memory bound
_RSS_CHILD = r"""
import json, sys, resource
from sluice.cache import NodeCache
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
m = load_manifest(sys.argv[1])
enc = encoder_for_manifest(m, threads=1)
enc.encode_batch(["warm up the tokenizer"])
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = peak()
with NodeCache(sys.argv[2], 1 << 34) as cache:
    docs = DocSource(m, cache, enc, workers=1)
    ref = type("Ref", (), {"source": 0, "obj": 0, "record": m.sources[0].objects[0].records - 1})()
    last = docs(ref)
    docs.close()
print(json.dumps({"base": base, "peak": peak(), "last": int(last.size)}))
"""


@pytest.mark.slow
def test_daemon_memory_is_bounded_for_a_highly_compressible_object(tmp_path, tokenizer_file):
    """24 MiB of text in a ~0.2 MiB .jsonl.gz: tokenizing the whole object at once took ~40x its text."""
    from sluice.manifest.model import Manifest
    from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
    from sluice.manifest.sources import ObjectRecord, Source
    from sluice.tokenize import load_tokenizer

    line = json.dumps({"text": "def f(x):\n    return x + 1\n" * 40}) + "\n"
    n = (24 << 20) // len(line)
    data = gzip.compress((line * n).encode(), compresslevel=9)
    (tmp_path / "big.jsonl.gz").write_bytes(data)
    import blake3

    enc = load_tokenizer(tokenizer_file)
    obj = ObjectRecord(location="big.jsonl.gz", digest="b3:" + blake3.blake3(data).hexdigest(), size=len(data),
                       records=n, start=0, compression="gzip")
    src = Source(name="big", format="jsonl", text_field="text", weight="1", exhaustion="stop",
                 paths=("big.jsonl.gz",), objects=(obj,))
    (tmp_path / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    manifest = Manifest(name="rss", tokenizer=TokenizerRef(location="tokenizer.json", digest=enc.digest, version="1.0",
                                                           vocab_size=enc.vocab_size),
                        packing=PackingPolicy(seq_len=64, eos_id=0), mixture=MixturePolicy(), sources=(src,))
    (tmp_path / "manifest.json").write_bytes(manifest.canonical_bytes())
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "manifest.json"), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["last"] > 0
    grew = got["peak"] - got["base"]
    print(f"RSS base {got['base'] >> 20} MiB, peak {got['peak'] >> 20} MiB, object {len(data)} bytes")
    # one 1 MiB chunk and its encodings (~40 MiB) plus arena slack; the whole object took ~1 GB
    assert grew < 256 << 20, f"peak RSS grew by {grew >> 20} MiB while tokenizing a 24 MiB object"
