"""Verified on the way out: per-chunk digests recorded at publish, checked when first read and after a change.

Real files, real LMDB, real BLAKE3. A "stray writer" is a real in-place write
to the published object's file (what bit rot surfacing through the page
cache, a bad disk or another program would leave).
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.cache import NodeCache
from sluice.cache.chunks import VERIFY_CHUNK, ChunkHasher, chunk_count, decode_chunks, encode_chunks
from sluice.errors import CacheError, ChunkDamaged
from sluice.manifest.sources import ObjectRecord

MiB = 1 << 20


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def payload(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def flip(path: str, at: int) -> None:
    """Flip one byte in place (the file keeps its inode: a reader's map sees the change)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def obj_and_cache(tmp_path: Path):
    data = payload(7, 3 * MiB + 12345)
    src = tmp_path / "a.bin"
    src.write_bytes(data)
    obj = ObjectRecord(location="a.bin", digest=b3(data), size=len(data), records=1, start=0)
    cache = NodeCache(tmp_path / "cache", 64 * MiB, verify_on_read=False)
    yield obj, str(src), cache, data
    cache.close()


@settings(max_examples=examples(60), deadline=None)
@given(st.binary(max_size=3 * 4096 + 17), st.lists(st.integers(1, 5000), max_size=8), st.sampled_from([4096, 5000]))
def test_chunk_digests_do_not_depend_on_how_the_stream_is_cut(data: bytes, cuts: list[int], chunk: int) -> None:
    h = ChunkHasher(chunk)
    at = 0
    for c in cuts:
        h.update(data[at:at + c])
        at += c
    h.update(data[at:])
    got = h.finish()
    assert got == tuple(blake3.blake3(data[i:i + chunk]).digest() for i in range(0, len(data), chunk))
    assert len(got) == chunk_count(len(data), chunk)
    assert decode_chunks(encode_chunks(chunk, got), "k") == (chunk, got)


def test_malformed_chunk_record_is_a_cache_error_naming_the_object() -> None:
    with pytest.raises(CacheError, match="object b3:xyz"):
        decode_chunks(b"\x01\x00\x10\x00\x00" + b"x" * 31, "b3:xyz")


def test_a_fill_records_chunk_digests_and_a_fresh_pin_verifies_them(obj_and_cache) -> None:
    obj, src, cache, data = obj_and_cache
    with cache.fetch(obj, src) as pin:
        guard = pin.guard()
        assert guard.digests is not None and len(guard.digests) == 4
        assert guard.digests[0] == blake3.blake3(data[:VERIFY_CHUNK]).digest()
        guard.ensure()
        assert guard.check() is True
        assert guard.verifications == 1


def test_a_change_after_verification_is_found_named_and_quarantined(obj_and_cache) -> None:
    obj, src, cache, data = obj_and_cache
    pin = cache.fetch(obj, src)
    guard = pin.guard()
    guard.ensure()
    flip(pin.path, 2 * VERIFY_CHUNK + 5)
    with pytest.raises(ChunkDamaged) as err:
        guard.check()
    assert err.value.chunk == 2 and err.value.key == obj.digest
    assert f"chunk 2 (bytes {2 * VERIFY_CHUNK}..{3 * VERIFY_CHUNK})" in str(err.value)
    assert cache.quarantine_damaged(pin, str(err.value)) is True
    assert cache.quarantine_damaged(pin, str(err.value)) is False  # already gone: nothing dropped twice
    pin.close()
    st = cache.stats()
    assert st.verify_failures == 1 and st.quarantined == 1
    with cache.fetch(obj, src) as again:  # filled anew from the source: the right bytes
        assert again.read_bytes() == data
        again.guard().ensure()


def test_a_touch_without_a_change_of_bytes_is_verified_again_and_passes(obj_and_cache) -> None:
    obj, src, cache, _ = obj_and_cache
    with cache.fetch(obj, src) as pin:
        guard = pin.guard()
        guard.ensure()
        os.utime(pin.path, ns=(1, 1))
        assert guard.check() is False  # changed stamp: verified again (the caller redoes its copies)
        assert guard.check() is True
        assert guard.verifications == 2


def test_verify_on_read_refuses_a_damaged_object_by_its_chunks_and_refills(tmp_path: Path) -> None:
    data = payload(3, 2 * MiB)
    src = tmp_path / "b.bin"
    src.write_bytes(data)
    obj = ObjectRecord(location="b.bin", digest=b3(data), size=len(data), records=1, start=0)
    with NodeCache(tmp_path / "cache", 64 * MiB, verify_on_read=True) as cache:
        with cache.fetch(obj, str(src)) as pin:
            path = pin.path
        flip(path, 10)
        with cache.fetch(obj, str(src)) as pin:  # hit -> damaged -> quarantined -> filled again
            assert pin.read_bytes() == data
        with cache.fetch(obj, str(src)) as pin:  # a hit
            assert pin.guard().verified  # verified at lookup: no second pass for its reader
        assert cache.stats().verify_failures == 1


def test_an_object_published_without_chunk_digests_learns_them_from_its_whole_digest(tmp_path: Path) -> None:
    data = payload(5, MiB + 3)
    src = tmp_path / "c.bin"
    src.write_bytes(data)
    obj = ObjectRecord(location="c.bin", digest=b3(data), size=len(data), records=1, start=0)
    with NodeCache(tmp_path / "cache", 64 * MiB) as cache:
        cache.fetch(obj, str(src)).close()
        core = cache._core  # an older cache: the entry has no chunk digests
        key = obj.digest[3:].encode()
        with core.index.write() as txn:
            txn.delete(key, db=core.index.db[b"chunks"])
        with cache.fetch(obj, str(src)) as pin:
            guard = pin.guard()
            assert guard.digests is None
            guard.ensure()  # whole digest compared, chunks learned and recorded
            assert len(guard.digests) == 2
        with core.index.read() as txn:
            assert core.index.get_chunks(txn, key) is not None
        with cache.fetch(obj, str(src)) as pin:
            assert pin.guard().digests is not None


def test_derived_objects_carry_chunk_digests(tmp_path: Path) -> None:
    data = payload(9, 2 * MiB + 1)
    with NodeCache(tmp_path / "cache", 64 * MiB) as cache:
        with cache.put_derived({"raw": b3(b"r"), "what": "t"}, lambda p: p.write_bytes(data)) as pin:
            guard = pin.guard()
            assert len(guard.digests) == 3
            guard.ensure()
            flip(pin.path, 2 * MiB)
            with pytest.raises(ChunkDamaged, match="chunk 2"):
                guard.check()


def test_a_file_truncated_under_its_reader_is_damage_never_a_crash(obj_and_cache) -> None:
    """Verification reads with positioned reads, not a memory map: a truncated file (a stray writer) cannot
    kill the process with SIGBUS; it is named as damage."""
    from sluice.cache.chunks import hash_file_chunks

    obj, src, cache, data = obj_and_cache
    with cache.fetch(obj, src) as pin:
        guard = pin.guard()
        guard.ensure()
        os.truncate(pin.path, 2 * VERIFY_CHUNK + 7)
        with pytest.raises(ChunkDamaged, match=f"its file is {2 * VERIFY_CHUNK + 7} bytes"):
            guard.check()
        with pytest.raises(ChunkDamaged, match="read short"):  # the size checked, then the file cut shorter
            hash_file_chunks(guard.fileno(), len(data))
