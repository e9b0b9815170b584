"""Each document is tokenized once (docs/tokenize.md, "Out of order": the fill reuses the demand's tokens).

Specification: records an object's demand path made (in a demand thread or a
worker process) before the in-order fill reached them are written by the fill
as they are, not tokenized again: the fill's encoder sees only the other
records (demanded + encoded by the fill = the object's records), the reuse
is counted, and the token object published in the node cache is byte for
byte the one a plain fill (no demand path) writes.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from sluice.cache import NodeCache
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.tokcache import fill_tokens, lookup_tokens
from test_out_of_order import HeldEncoder, _one_object


class Ref:
    def __init__(self, record: int) -> None:
        self.source, self.obj, self.record = 0, 0, record


def _cached_tokens(cache, manifest, plain) -> bytes:
    """The bytes of the object's token object the DocSource published."""
    pin = lookup_tokens(cache, manifest, 0, 0, plain)
    assert pin is not None
    try:
        return Path(pin.path).read_bytes()
    finally:
        pin.close()


def _plain_fill(cache_dir, manifest, plain) -> bytes:
    """The bytes of the object's token object as a plain fill (no demand path) writes it."""
    with NodeCache(cache_dir, 1 << 30) as cache:
        got = fill_tokens(cache, manifest, 0, 0, plain)
        try:
            return Path(got.pin.path).read_bytes()
        finally:
            got.pin.close()


@pytest.mark.parametrize("demand_workers", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["threads", "processes"])
def test_the_fill_writes_demanded_documents_without_tokenizing_them_again(tmp_path, tokenizer_file, demand_workers):
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    plain = encoder_for_manifest(manifest)
    demanded = list(range(1000, 1400))
    enc = HeldEncoder(plain, fill_free=1)  # the fill writes its first chunk, then waits for the gate
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048, demand_workers=demand_workers)
        try:
            if demand_workers:
                assert docs.start_demand_pool()
            docs.prefetch([Ref(r) for r in demanded])  # made out of order while the fill is held
            deadline = time.monotonic() + 60
            while docs.demanded_docs < len(demanded):
                assert time.monotonic() < deadline, f"demand made {docs.demanded_docs} of {len(demanded)}"
                time.sleep(0.01)
            enc.fill_gate.set()
            assert docs.wait_filled(60)
            made = (docs.demanded_docs, docs.fill_reused_docs, len(enc.fill_texts))
            located = docs._dpool.indexed if demand_workers else docs.indexed_objects
        finally:
            enc.release()
            docs.close()
        written = _cached_tokens(cache, manifest, plain)
    want = _plain_fill(tmp_path / "plain-cache", manifest, plain)
    records = manifest.sources[0].objects[0].records
    assert made[0] == made[1] == len(demanded)  # every demanded document was reused...
    assert made[2] + made[0] == records  # ...and the fill tokenized only the others: each document once
    assert written == want  # the token object is a plain fill's, byte for byte
    assert located == 1  # the worker (or thread) located records with the raw fill's line index


@pytest.mark.parametrize("spill_bytes", [512 << 20, 6000], ids=["spilled", "spill-full"])
def test_documents_parked_past_the_side_bound_are_spilled_and_reused(tmp_path, tokenizer_file, monkeypatch,
                                                                     spill_bytes):
    """Past `demand.SIDE_BYTES` the oldest parked documents go to a spill file that the fill reads back:
    still each document tokenized once; past the spill's own bound they are dropped (tokenized again by
    the fill, counted). Either way the token object is a plain fill's, byte for byte."""
    from sluice.loaderd.physical import demand

    monkeypatch.setattr(demand, "SIDE_BYTES", 2048)  # a few dozen documents of this corpus
    monkeypatch.setattr(demand, "SPILL_BYTES", spill_bytes)
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    plain = encoder_for_manifest(manifest)
    demanded = list(range(1000, 1400))
    enc = HeldEncoder(plain, fill_free=1)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            docs.prefetch([Ref(r) for r in demanded])
            deadline = time.monotonic() + 60
            while docs.demanded_docs < len(demanded):
                assert time.monotonic() < deadline, f"demand made {docs.demanded_docs} of {len(demanded)}"
                time.sleep(0.01)
            again = [docs(Ref(r)) for r in demanded[:5]]  # asked for after being spilled: read back
            enc.fill_gate.set()
            assert docs.wait_filled(60)
            made = (docs.demanded_docs, docs.fill_reused_docs, len(enc.fill_texts), docs.spilled_docs,
                    docs.side_dropped_docs)
        finally:
            enc.release()
            docs.close()
        written = _cached_tokens(cache, manifest, plain)
        assert [p.name for p in (tmp_path / "cache" / "tmp").iterdir()] == []  # the spill is never left behind
    want = _plain_fill(tmp_path / "plain-cache", manifest, plain)
    records = manifest.sources[0].objects[0].records
    demanded_n, reused, fill_encoded, spilled, dropped = made
    assert demanded_n == len(demanded) and spilled + dropped > len(demanded) // 2  # most went past the side bound
    assert reused == demanded_n - dropped and fill_encoded + reused == records
    if spill_bytes > 1 << 20:
        assert dropped == 0  # each document tokenized once
    else:
        assert 0 < spilled and dropped > 0  # the spill's bound: the rest dropped, tokenized again
    assert written == want
    want_docs = plain.encode_batch([f"doc {i} " + "z" * (i % 17) for i in demanded[:5]])
    assert all(np.array_equal(a, b) for a, b in zip(again, want_docs))
