"""Attacks on the tiktoken codec's buffer path and on `RecordLocator`'s window line tables.

Specifications:
* A lone surrogate (JSON allows "\\ud800") never reaches a codec: freeze
  refuses the record naming the object and the line, and the out-of-order
  reader (`RecordLocator`, the freeze's own line rule) refuses it the same
  way if the object changed meanwhile. Guards the backends' disagreement on
  such text (tokenizers raises TypeError, tiktoken replaces it with U+FFFD):
  served tokens would depend on the backend, or a fill would end in "bug in
  sluice".
* Huge documents (4 MiB without a space, 4 MiB of random letters) get the
  same ids from tiktoken's buffer path as from tokenizers (slow).
* Records longer than the locator's window (several window boundaries inside
  one line share a mark), read in any order, with the line-table LRU forced
  to drop tables after every window: the texts are the in-order reader's,
  plain or zstd-compressed, with or without the fill's index, and the kept
  tables never exceed their byte bound by more than the one in use.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import blake3
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.errors import SourceReadError
from sluice.tokenize import records as records_mod
from sluice.tokenize.chunks import iter_text_chunks
from sluice.tokenize.lineindex import LineIndexer
from sluice.tokenize.records import RecordLocator


def test_a_lone_surrogate_is_refused_by_name_before_any_codec(tmp_path, tokenizer_file, sluice_main):
    (tmp_path / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    (tmp_path / "o.jsonl").write_text('{"text": "hello"}\n{"text": "a \\ud800 b"}\n{"text": "bye"}\n')
    (tmp_path / "dataset.toml").write_text(
        'name = "s"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 16\nalgorithm = "concat"\n'
        'eos = "<|endoftext|>"\npad = "<|pad|>"\n[[sources]]\nname = "s"\npaths = ["o.jsonl"]\nformat = "jsonl"\n'
        'text_field = "text"\nweight = "1"\n')
    res = sluice_main("manifest", "freeze", tmp_path / "dataset.toml", "-o", tmp_path / "m.json", "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "o.jsonl: line 2:" in res.stderr and "unpaired surrogate" in res.stderr
    loc = RecordLocator(str(tmp_path / "o.jsonl"), "jsonl", "none", "text", "obj-s")
    try:
        assert loc.texts([2, 0]) == ["bye", "hello"]
        with pytest.raises(SourceReadError, match=r"obj-s: line 2: .*unpaired surrogate"):
            loc.texts([1])
    finally:
        loc.close()


@pytest.mark.slow
def test_huge_documents_get_the_same_ids_from_tiktokens_buffer_path(tokenizer_file):
    from sluice.tokenize import load_tokenizer

    hf, tt = load_tokenizer(tokenizer_file), load_tokenizer(tokenizer_file, backend="tiktoken")
    rnd = random.Random(0)
    texts = ["x" * (4 << 20), "".join(rnd.choice("abcdefghij") for _ in range(4 << 20)), "short"]
    for a, b in zip(hf.encode_batch(texts), tt.encode_batch(texts)):
        assert b.dtype == np.uint32 and np.array_equal(a, b)


_LONG = st.one_of(
    st.just(b""),
    st.builds(lambda n, c: json.dumps({"text": c * n}).encode(), st.integers(0, 3000), st.sampled_from("ab\u00e9")),
)


@settings(max_examples=40, deadline=None)
@given(lines=st.lists(_LONG, min_size=1, max_size=30), window=st.integers(1, 512), compressed=st.booleans(),
       indexed=st.booleans(), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
def test_records_longer_than_the_window_read_in_any_order_under_a_tiny_table_bound(
        tmp_path_factory, lines, window, compressed, indexed, picks):
    d = tmp_path_factory.mktemp("long")
    data = b"\n".join(lines) + b"\n"
    (d / "o").write_bytes(zstandard.ZstdCompressor().compress(data) if compressed else data)
    comp = "zstd" if compressed else "none"
    texts = [t for c in iter_text_chunks(str(d / "o"), "jsonl", comp, "text", "obj-l") for t in c]
    if not texts:
        return
    index = None
    if indexed and not compressed:
        ix = LineIndexer(window)
        ix.feed(memoryview(data), 0)
        index = ix.finish("b3:" + blake3.blake3(data).hexdigest(), len(data))
    bound = records_mod._TABLE_BYTES
    records_mod._TABLE_BYTES = 48  # two records' table: almost every read drops the others
    try:
        loc = RecordLocator(str(d / "o"), "jsonl", comp, "text", "obj-l", spool_dir=str(d), window=window, scan=700,
                            index=index, digest="b3:" + blake3.blake3(data).hexdigest() if index else None)
        try:
            chosen = [p % len(texts) for p in picks]
            assert loc.texts(chosen) == [texts[i] for i in chosen]
            for i in reversed(range(len(texts))):
                assert loc.texts([i]) == [texts[i]]
                impl = loc._impl
                assert len(impl._tables) == 1 or impl._table_bytes <= records_mod._TABLE_BYTES
        finally:
            loc.close()
    finally:
        records_mod._TABLE_BYTES = bound
