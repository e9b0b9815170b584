"""Documents tokenized out of order, ahead of their object's in-order fill (docs/tokenize.md, "Out of order").

Specifications:
* `RecordLocator` gives, for any records in any order, the texts the in-order
  reader (`iter_text_chunks`) gives: jsonl plain/gzip/zstd with blank and
  "\\r" lines, CRLF and no final newline; parquet across row groups. A record
  beyond the end and a bad line are refused, naming the object (and the line).
* With every object's in-order fill held after its first chunk, a DocSource
  still serves every step, and the stream equals the one computed from the
  texts encoded in order (an oracle outside DocSource): the documents came
  from the out-of-order path, and which path made them changes no byte;
  plain jsonl objects are located with their raw fill's line index, zstd
  ones by counting lines.
* Each prefetch replaces the last: records announced for a position left
  behind (what a RESTORE does) and not started yet are never tokenized.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.errors import SourceReadError
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from support import examples, freeze_here
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.chunks import iter_text_chunks
from sluice.tokenize.records import RecordLocator


# ------------------------------------------------------------------ the locator
def _compress(data: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(data)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


_LINE = st.one_of(
    st.just(b""), st.just(b"\r"),  # blank lines: not records
    st.builds(lambda t, crlf: json.dumps({"text": t}).encode() + (b"\r" if crlf else b""),
              st.text(st.characters(blacklist_categories=("Cs",)), max_size=400), st.booleans()),
)


@settings(max_examples=examples(60), deadline=None)
@given(lines=st.lists(_LINE, max_size=50), final_newline=st.booleans(),
       compression=st.sampled_from(["none", "gzip", "zstd"]), window=st.integers(8, 600),
       scan=st.integers(8, 3000), picks=st.lists(st.integers(0, 10**6), max_size=12),
       tables=st.sampled_from([1, 100, 4 << 20]))
def test_located_texts_are_the_in_order_texts(tmp_path_factory, lines, final_newline, compression, window, scan,
                                               picks, tables):
    from unittest import mock

    from sluice.tokenize import records

    d = tmp_path_factory.mktemp("loc")
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    (d / "o").write_bytes(_compress(data, compression))
    texts = [t for c in iter_text_chunks(str(d / "o"), "jsonl", compression, "text", "obj-x") for t in c]
    # small windows and scans: many marks, lines longer than a window, a scan ending mid-object
    loc = RecordLocator(str(d / "o"), "jsonl", compression, "text", "obj-x", spool_dir=str(d), window=window, scan=scan)
    # `tables`: the bytes of windows' line tables kept (1: only the last one; 100: a few)
    with mock.patch.object(records, "_TABLE_BYTES", tables):
        _check_located(loc, texts, picks)
    assert [p.name for p in d.iterdir()] == ["o"]  # the spool of a compressed object is never left behind


def _check_located(loc: RecordLocator, texts: list[str], picks: list[int]) -> None:
    try:
        if texts:
            chosen = [p % len(texts) for p in picks]
            assert loc.texts(chosen) == [texts[i] for i in chosen]
            assert loc.texts(list(range(len(texts)))[::-1]) == texts[::-1]
        with pytest.raises(SourceReadError, match=rf"obj-x: record {len(texts)} is beyond the object's {len(texts)} records"):
            loc.texts([len(texts)])
    finally:
        loc.close()


def test_a_bad_line_read_out_of_order_is_named_with_object_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": 3}\n{"text": "c"}\n')
    loc = RecordLocator(str(tmp_path / "bad.jsonl"), "jsonl", "none", "text", "obj-x")
    try:
        assert loc.texts([2, 0]) == ["c", "a"]  # the bad record is never parsed unless asked for
        with pytest.raises(SourceReadError, match=r"obj-x: line 3: text field 'text' not a string"):
            loc.texts([1])
    finally:
        loc.close()


def test_parquet_records_are_read_from_their_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"doc {i} " + "y" * (i % 13) for i in range(100)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "o.parquet", row_group_size=7)
    assert pq.ParquetFile(tmp_path / "o.parquet").metadata.num_row_groups == 15
    loc = RecordLocator(str(tmp_path / "o.parquet"), "parquet", "none", "text", "obj-p")
    try:
        assert loc.texts([99, 0, 6, 7, 50, 50]) == [texts[i] for i in (99, 0, 6, 7, 50, 50)]
        with pytest.raises(SourceReadError, match="obj-p: record 100 is beyond"):
            loc.texts([100])
    finally:
        loc.close()


def test_webdataset_is_not_located():
    with pytest.raises(SourceReadError, match="format 'webdataset' cannot be read out of order"):
        RecordLocator("x.tar", "webdataset", "none", "txt", "obj-w")


# ------------------------------------------------------------ DocSource, held fill
class HeldEncoder:
    """The real Encoder; calls from the in-order fill's threads are held at a gate after each
    thread's first call (`fill_free` calls), calls from the demand threads after `demand_free` calls.
    The texts each side encoded are recorded."""

    def __init__(self, enc, *, fill_free: int = 1, demand_free: int | None = None) -> None:
        self._enc = enc
        self.fill_free, self.demand_free = fill_free, demand_free
        self.fill_gate, self.demand_gate = threading.Event(), threading.Event()
        self.calls: dict[str, int] = {}
        self.fill_texts: list[str] = []
        self.demand_texts: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._enc, name)

    def encode_batch(self, texts):
        name = threading.current_thread().name
        with self._lock:
            n = self.calls[name] = self.calls.get(name, 0) + 1
        if name.startswith("loaderd-worker"):
            if n > self.fill_free:
                assert self.fill_gate.wait(60), "test gate (fill) never opened"
            self.fill_texts.extend(texts)
        elif name.startswith("loaderd-demand"):
            if self.demand_free is not None and n > self.demand_free:
                assert self.demand_gate.wait(60), "test gate (demand) never opened"
            self.demand_texts.extend(texts)
        return self._enc.encode_batch(texts)

    def release(self) -> None:
        self.fill_gate.set()
        self.demand_gate.set()


@pytest.fixture(scope="module", params=["jsonl.zst", "jsonl"])
def corpus(request, tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("ooo"), request.param, tokenizer_file)


def stream_digests(plan, docs, steps: int = 8) -> dict[int, str]:
    """Step -> digest of its micro-batches, for the first `steps` steps with tokens from `docs`."""
    from sluice.loaderd.logical import micro_batches_digest

    got, state = {}, plan.initial_state()
    for _ in range(steps):
        batch, state = plan.step(state, docs)
        got[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))
    return got


def in_order_oracle(plan, plain, cache_dir: Path, steps: int = 8) -> dict[int, str]:
    """The oracle: `stream_digests` with every (jsonl) object read front to back and encoded in order,
    outside DocSource."""
    from sluice.manifest.formats import read_texts

    manifest = plan.manifest
    with NodeCache(cache_dir, 1 << 30) as ref_cache:
        tokens = [plain.encode_batch(read_texts(ref_cache.fetch(o, manifest.resolve(o.location)).path, "jsonl",
                                                o.compression, "text", o.location))
                  for o in manifest.sources[0].objects]
    return stream_digests(plan, lambda ref: tokens[ref.obj][ref.record], steps)


def test_with_every_fill_held_after_one_chunk_the_stream_equals_the_in_order_oracle(corpus, tmp_path):
    from sluice.loaderd.logical import Plan
    from sluice.runspec import load_runspec

    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))  # order "global": documents from anywhere
    objects = manifest.sources[0].objects
    plain = encoder_for_manifest(manifest)
    want = in_order_oracle(plan, plain, tmp_path / "ref-cache")

    enc = HeldEncoder(plain, fill_free=1)  # each fill writes its first chunk, then is held
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=len(objects), chunk_bytes=2048)
        try:
            got = stream_digests(plan, docs)
            held = (docs.tokenized_objects, docs.demanded_docs, sum(enc.calls.get(n, 0) for n in enc.calls
                                                                     if n.startswith("loaderd-worker")))
            indexed = docs.indexed_objects
        finally:
            enc.release()
            docs.close()
    assert got == want
    assert held[0] == 0  # no object was tokenized to its end
    assert held[1] > 0 and held[2] <= 2 * len(objects)  # documents came from the demand path
    # a plain jsonl object is located with its raw fill's line index (lineindex.py), a compressed one by counting
    assert indexed == (len(objects) if objects[0].compression == "none" else 0)
    fill_records = len(enc.fill_texts)
    assert len(enc.demand_texts) == held[1] and fill_records < sum(o.records for o in objects)


def _one_object(folder: Path, tokenizer_file: Path, n: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    with open(folder / "o.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " + "z" * (i % 17)}) + "\n")
    (folder / "dataset.toml").write_text(
        'name = "ooo"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 64\nalgorithm = "concat"\n'
        'eos = "<|endoftext|>"\npad = "<|pad|>"\n[[sources]]\nname = "s"\npaths = ["o.jsonl"]\nformat = "jsonl"\n'
        'text_field = "text"\nweight = "1"\n')
    freeze_here(folder / "dataset.toml", folder / "manifest.json")
    return folder / "manifest.json"


def test_a_new_prefetch_drops_records_announced_for_a_position_left_behind(tmp_path, tokenizer_file):
    from sluice.loaderd.physical.demand import AHEAD_BATCH

    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    ref = type("Ref", (), {})
    def refs(records):
        out = []
        for r in records:
            x = ref()
            x.source, x.obj, x.record = 0, 0, r
            out.append(x)
        return out

    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0, demand_free=0)  # nothing is tokenized yet
    old, new = list(range(1500, 2500)), list(range(800, 900))
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            docs.prefetch(refs(old))  # the position before the RESTORE: its first batch starts and is held
            deadline = time.monotonic() + 30
            while not any(n.startswith("loaderd-demand") for n in enc.calls) and time.monotonic() < deadline:
                time.sleep(0.01)
            docs.prefetch(refs(new))  # the position after it
            enc.demand_gate.set()
            got = [docs(r) for r in refs(new)]  # served (never waiting for the held fill)
            made = {int(t.split()[1]) for t in enc.demand_texts}
        finally:
            enc.release()
            docs.close()
    assert made == set(old[:AHEAD_BATCH]) | set(new)  # the old position's batch in progress, then only the new one
    want = encoder_for_manifest(manifest).encode_batch([f"doc {i} " + "z" * (i % 17) for i in new])
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
