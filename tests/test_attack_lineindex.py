"""Attacks on the stored line index (sluice/tokenize/lineindexfile.py, loaderd/physical/lineindexes.py).

Specifications:
* Any single flipped bit anywhere in a stored index file (magic, header
  length, header JSON, padding, marks) is either refused with a CacheError
  naming the file, or changes nothing that is read back. Guards the gap that
  the payload digest covered the marks but not the header's counts: a digit
  of "records" flipped (1234 -> 1224) gave an index that passed every check
  and made a good object's last records "beyond the object's end".
* Every truncation (each prefix of the file) and a header claiming huge
  counts or a huge header length is refused by name, without allocating for
  the claim (the memory bomb).
* A file of the previous format (sluice-lineindex/1) is refused, not misread.
* A stored index whose record count is not the manifest's (an index for
  other bytes tagged with this object's digest) is refused by a DocSource,
  dropped and built again: the last record is still served right.
* A full cache disk (a real tmpfs, filled) while `sluice cache warm` stores
  indexes: `sluice: error: cache index ...: ... No space left on device`
  (exit 2; it was "bug in sluice: DiskError", exit 3, before LMDB's disk
  error became a CacheError), or a warning naming the object if only the
  index file did not fit; with space again the same command stores it.
* A cache on a file system remounted read-only: `sluice: error: cache index
  ...: ... Read-only file system` (exit 2); read-write again, it stores.
* Two `sluice cache warm` processes storing the same index at once: both
  succeed, one index is stored and it reads back whole.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from sluice.cache import NodeCache
from sluice.errors import CacheError
from sluice.manifest.model import load_manifest
from sluice.tokenize.lineindex import LineIndexer
from sluice.tokenize.lineindexfile import FORMAT, MAGIC, index_key, read_index, write_index
from support import mount_tmpfs
from test_lineindex_cache import _fetch_raw_only, _locate_last
from test_out_of_order import _one_object

DIGEST = "b3:" + "ab" * 32


def _data(n: int = 1234) -> bytes:
    return b"".join(json.dumps({"text": "x" * (i % 50)}).encode() + (b"\n\n" if i % 7 else b"\n")
                    for i in range(n))


def _index(data: bytes, digest: str = DIGEST, window: int = 4096):
    ix = LineIndexer(window=window)
    ix.feed(memoryview(data), 0)
    return ix.finish(digest, len(data))


def test_every_single_bit_flip_is_refused_by_name_or_changes_nothing(tmp_path):
    data = _data(345)  # 3-digit counts, 4 marks: about 2,900 flips
    index = _index(data, window=4096)
    assert len(index.m_offsets) >= 3
    path = tmp_path / "ix"
    write_index(path, index)
    good = path.read_bytes()
    bad_path = tmp_path / "bad"
    bad_path.write_bytes(good)
    accepted = []
    # Each flip is written in place and put back (one byte, pwrite): rewriting the whole file per flip
    # truncated it ~2,900 times, ~1 ms each on ext4, most of this test's time.
    fd = os.open(bad_path, os.O_WRONLY)
    try:
        for byte in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                try:
                    back = read_index(bad_path, index.digest, index.size)
                except CacheError as exc:
                    assert f"cached line index {bad_path}" in str(exc)
                    continue
                finally:
                    os.pwrite(fd, good[byte:byte + 1], byte)
                assert back == index, f"byte {byte} bit {bit}: accepted a different index"
                accepted.append(byte)
    finally:
        os.close(fd)
    assert bad_path.read_bytes() == good
    head = 12 + struct.unpack_from("<I", good, 8)[0]
    assert all(head <= b < head + (-head % 8) for b in accepted)  # only the zero padding is not read


def test_every_truncation_and_a_huge_claim_is_refused_by_name(tmp_path):
    index = _index(_data())
    path = tmp_path / "ix"
    write_index(path, index)
    good = path.read_bytes()
    bad_path = tmp_path / "bad"
    bad_path.write_bytes(good)
    for n in reversed(range(len(good))):  # shortened in place: a rewrite per length cost ~1 ms of truncation
        os.truncate(bad_path, n)
        with pytest.raises(CacheError, match=f"cached line index {bad_path}"):
            read_index(bad_path, index.digest, index.size)
    hlen = struct.unpack_from("<I", good, 8)[0]
    header = json.loads(good[12:12 + hlen])
    for field, value in (("n", 2**60), ("n", -1), ("records", 2**62), ("lines", 2**62)):
        forged = dict(header, **{field: value})
        body = json.dumps(forged, sort_keys=True).encode()
        head = MAGIC + struct.pack("<I", len(body)) + body
        bad_path.write_bytes(head + b"\0" * (-len(head) % 8) + good[12 + hlen + (-(12 + hlen) % 8):])
        with pytest.raises(CacheError, match=f"cached line index {bad_path}"):
            read_index(bad_path, index.digest, index.size)
    bad_path.write_bytes(good[:8] + struct.pack("<I", 0xFFFFFFFF) + good[12:])
    with pytest.raises(CacheError, match="header length 4294967295 exceeds"):
        read_index(bad_path, index.digest, index.size)


def test_a_file_of_the_previous_format_is_refused(tmp_path):
    index = _index(_data())
    assert FORMAT != "sluice-lineindex/1"
    from sluice.flatfile import write_flat

    arrays = b"".join(np.asarray(a, dtype="<i8").tobytes() for a in (index.m_records, index.m_lines, index.m_offsets))
    import blake3

    header = {"format": "sluice-lineindex/1", "digest": index.digest, "size": index.size, "records": index.records,
              "lines": index.lines, "scanned": index.scanned, "n": len(index.m_offsets),
              "payload": "b3:" + blake3.blake3(arrays).hexdigest()}
    write_flat(tmp_path / "v1", b"SLLIDX1\0", header, (arrays,))
    with pytest.raises(CacheError, match="bad magic"):
        read_index(tmp_path / "v1", index.digest, index.size)


def _store(cache_dir, digest: str, index) -> None:
    with NodeCache(cache_dir, 1 << 30) as cache:
        cache.drop_derived(index_key(digest), "replaced by the test")
        cache.put_derived(index_key(digest), lambda tmp: write_index(tmp, index)).close()


def test_an_index_of_other_bytes_tagged_with_this_digest_is_refused_and_rebuilt(tmp_path, tokenizer_file):
    """A stored index whose marks hash right but whose counts are not the object's (made for other
    bytes of the same size, by a bug or a hand): the DocSource's record count check refuses it."""
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    obj = manifest.sources[0].objects[0]
    _fetch_raw_only(manifest, tmp_path / "cache")
    other = b"\n".join([b'{"text": "y"}'] * (obj.size // 14)) + b"\n"
    other = other + b" " * (obj.size - len(other))  # the same size, fewer records
    forged = _index(other, digest=obj.digest)
    assert forged.size == obj.size and forged.records != obj.records
    _store(tmp_path / "cache", obj.digest, forged)
    # refused (not loaded), built again in one pass and stored; the last record served right
    counts = _locate_last(manifest, tmp_path / "cache")
    assert counts[1] == 0 and counts[3] == 1, counts
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        pin = cache.get_derived(index_key(obj.digest))
        assert pin is not None
        assert read_index(pin.path, obj.digest, obj.size).records == obj.records
        pin.close()


@pytest.mark.slow
def test_a_full_cache_disk_while_storing_indexes_is_said_and_loses_nothing(tmp_path, tokenizer_file, sluice_cli):
    manifest_path = _one_object(tmp_path / "c", tokenizer_file, 3000)
    manifest = load_manifest(manifest_path)
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "64m"):
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    try:
        _fetch_raw_only(manifest, disk / "cache")
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
            try:
                while f.write(b"\0" * 65536):
                    pass
            except OSError:
                pass
        res = sluice_cli("cache", "warm", manifest_path, disk / "cache", "--json")
        assert "Traceback" not in res.stderr, res.stderr
        if res.returncode != 0:  # the index's LMDB commit (or the hit's) found the disk full: said so
            assert res.returncode == 2 and res.stderr.startswith("sluice: error: cache index "), res.stderr
            assert "No space left on device" in res.stderr and "free space" in res.stderr
        else:  # or only the index file did not fit: a warning naming the object
            out = json.loads(res.stdout)
            assert (out["line_indexes_stored"], out["failed"]) == (0, 0), out
            assert "is not kept in the node cache" in res.stderr
            assert manifest.sources[0].objects[0].digest in res.stderr
        filler.unlink()  # space again: nothing committed was lost, the index is stored now
        res = sluice_cli("cache", "warm", manifest_path, disk / "cache", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["line_indexes_stored"] == 1
        assert _locate_last(manifest, disk / "cache")[:2] == (1, 1)  # located with the stored index
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
def test_two_processes_storing_the_same_index_at_once(tmp_path, tokenizer_file):
    manifest_path = _one_object(tmp_path / "c", tokenizer_file, 20000)
    manifest = load_manifest(manifest_path)
    obj = manifest.sources[0].objects[0]
    _fetch_raw_only(manifest, tmp_path / "cache")
    cmd = [sys.executable, "-m", "sluice.cli", "cache", "warm", str(manifest_path), str(tmp_path / "cache"), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err
    stored = [json.loads(out)["line_indexes_stored"] for out, _ in outs]
    assert sorted(stored) in ([0, 1], [1, 1]), stored  # (both built it; the cache published it once)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        pin = cache.get_derived(index_key(obj.digest))
        assert pin is not None
        assert read_index(pin.path, obj.digest, obj.size).records == obj.records
        pin.close()
        assert cache.verify_all().damaged == ()


@pytest.mark.slow
def test_a_read_only_cache_while_storing_indexes_is_a_clear_error(tmp_path, tokenizer_file, sluice_cli):
    """A cache folder on a file system remounted read-only (root only: permissions do not stop root)."""
    manifest_path = _one_object(tmp_path / "c", tokenizer_file, 3000)
    manifest = load_manifest(manifest_path)
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "64m"):
        pytest.skip("needs root to mount a small tmpfs (a real read-only file system)")
    try:
        _fetch_raw_only(manifest, disk / "cache")
        assert subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True).returncode == 0
        res = sluice_cli("cache", "warm", manifest_path, disk / "cache", "--json")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("sluice: error: cache index ") and "Read-only file system" in res.stderr
        assert subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True).returncode == 0
        res = sluice_cli("cache", "warm", manifest_path, disk / "cache", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["line_indexes_stored"] == 1, res.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
