"""The node cache in one process: fills, hits, mismatches, retries, budget, ENOSPC, S3.

Real files, real LMDB, real BLAKE3; the only injected part is a temporary-file
writer that fails with ENOSPC (the real full-disk case is in test_cache_procs).
"""

from __future__ import annotations

import errno
import os
import pickle
import threading
import time
from pathlib import Path

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.cache import CacheStats, NodeCache
from sluice.cache.cli import parse_bytes
from sluice.cache.fill import backoff_delay
from sluice.cache.index import IndexRecord
from sluice.errors import CacheError, DigestMismatch, SourceReadError
from sluice.manifest.sources import ObjectRecord

MiB = 1 << 20


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def make_object(folder: Path, name: str, data: bytes) -> tuple[ObjectRecord, str]:
    """Write `data` to folder/name and return its frozen record and path."""
    path = folder / name
    path.write_bytes(data)
    return ObjectRecord(location=name, digest=b3(data), size=len(data), records=1, start=0), str(path)


def payload(seed: int, size: int) -> bytes:
    """Deterministic bytes (no wall-clock randomness in tests)."""
    out = bytearray()
    h = blake3.blake3(seed.to_bytes(8, "little"))
    out += h.digest(length=size)
    return bytes(out)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("hash_thread", [False, True])
def test_miss_fills_verified_bytes_then_hit_serves_them_pinned(src, root, hash_thread):
    data = payload(1, 3 * MiB + 17)
    obj, path = make_object(src, "a.bin", data)
    with NodeCache(root, 64 * MiB, hash_thread=hash_thread) as cache:
        with cache.fetch(obj, path) as first:
            assert first.pinned and first.digest == obj.digest and first.size == len(data)
            assert Path(first.path).read_bytes() == data
            assert Path(first.path).parent.parent == root / "objects"
        with cache.fetch(obj, path) as second:
            assert second.path == first.path
            mapped = second.mmap()
        assert not second.pinned
        assert mapped[:100] == data[:100] and len(mapped) == len(data)
        mapped.close()
        s = cache.stats()
        assert (s.hits, s.misses, s.fills, s.fill_bytes, s.objects, s.bytes) == (1, 1, 1, len(data), 1, len(data))
        assert s.fill_seconds > 0
    assert files_in(root / "tmp") == []


def test_hit_survives_a_new_instance_and_counters_accumulate_across_instances(src, root):
    obj, path = make_object(src, "a.bin", payload(2, 1000))
    with NodeCache(root, MiB) as cache:
        cache.fetch(obj, path).close()
    os.unlink(path)  # a hit never touches the source
    with NodeCache(root, MiB) as cache:
        with cache.fetch(obj, path) as hit:
            assert Path(hit.path).read_bytes() == payload(2, 1000)
        assert cache.stats() == CacheStats(hits=1, objects=1, bytes=1000, budget_bytes=MiB)
        total = cache.stats(all_processes=True)
        assert (total.hits, total.misses, total.fills) == (1, 1, 1)


def test_a_non_seekable_source_fills_in_small_chunks(src, root):
    """A FIFO delivers short reads; the fill streams it with the same checks."""
    data = payload(3, 2 * MiB)
    fifo = src / "pipe"
    os.mkfifo(fifo)
    obj = ObjectRecord(location="pipe", digest=b3(data), size=len(data), records=1, start=0)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    with NodeCache(root, 8 * MiB, chunk_bytes=64 * 1024) as cache, cache.fetch(obj, str(fifo)) as got:
        assert Path(got.path).read_bytes() == data
    writer.join()


def test_threads_fetching_one_object_collapse_into_one_fill(src, root):
    data = payload(4, MiB)
    fifo = src / "slow"
    os.mkfifo(fifo)  # the fill blocks until we write: every thread arrives during it
    obj = ObjectRecord(location="slow", digest=b3(data), size=len(data), records=1, start=0)
    cache = NodeCache(root, 8 * MiB)
    results: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with cache.fetch(obj, str(fifo)) as got:
                results.append(Path(got.path).read_bytes())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    with open(fifo, "wb") as w:  # returns once the single filler opened the source
        time.sleep(0.3)  # let the other threads queue on the fill lock
        w.write(data)
    for t in threads:
        t.join(30)
    assert not errors and results == [data] * 6
    s = cache.stats()
    assert s.fills == 1 and s.hits + s.misses == 6 and s.misses >= 2
    cache.close()


@pytest.mark.parametrize("hash_thread", [False, True])
def test_changed_source_is_quarantined_retried_and_reported(src, root, hash_thread):
    frozen = payload(5, 4096)
    obj, path = make_object(src, "part-0.jsonl", frozen)
    changed = bytearray(frozen)
    changed[100] ^= 0xFF
    Path(path).write_bytes(changed)
    cache = NodeCache(root, MiB, retries=2, backoff_s=0.001, hash_thread=hash_thread, chunk_bytes=4096)
    with pytest.raises(DigestMismatch) as info:
        cache.fetch(obj, path)
    msg = str(info.value)
    for part in (obj.digest, "'part-0.jsonl'", path, f"expected digest {obj.digest} size 4096",
                 f"got digest {b3(bytes(changed))} size 4096", "after 3 tries"):
        assert part in msg
    assert info.value.details.tries == 3
    assert info.value.details.actual_digest == b3(bytes(changed))
    again = pickle.loads(pickle.dumps(info.value))  # a process pool hands it over intact
    assert type(again) is type(info.value) and again.details == info.value.details and str(again) == msg
    bad = [p for p in (root / "quarantine").iterdir() if p.suffix == ".bad"]
    assert len(bad) == 3 and all(p.read_bytes() == changed for p in bad)
    s = cache.stats()
    assert (s.quarantined, s.retries, s.fills, s.objects) == (3, 2, 0, 0)
    assert cache.lookup(obj.digest) is None and files_in(root / "tmp") == []
    cache.close()


def test_truncated_source_reports_both_sizes(src, root):
    data = payload(6, 10_000)
    obj, path = make_object(src, "t.bin", data)
    Path(path).write_bytes(data[:6000])
    with NodeCache(root, MiB, retries=0) as cache, pytest.raises(DigestMismatch) as info:
        cache.fetch(obj, path)
    assert f"expected digest {obj.digest} size 10000, got digest {b3(data[:6000])} size 6000" in str(info.value)
    assert "the source is shorter than the recorded size 10000" in str(info.value)
    assert "after 1 tries" in str(info.value)


def test_a_source_that_grew_stops_at_size_plus_one_and_names_both_sizes(src, root):
    data = payload(7, 5000)
    obj, path = make_object(src, "l.bin", data)
    Path(path).write_bytes(data + payload(8, 3 * MiB))
    with NodeCache(root, 8 * MiB, retries=0) as cache, pytest.raises(DigestMismatch) as info:
        cache.fetch(obj, path)
    assert ("got more than 5000 bytes: the source is longer than the recorded size 5000 "
            "(reading stopped at 5001 bytes)") in str(info.value)
    assert info.value.details.actual_size == 5001
    (bad,) = (root / "quarantine").glob("*.bad")
    assert bad.stat().st_size == 5001


@pytest.mark.timeout(20)
@pytest.mark.parametrize("hash_thread", [False, True])
def test_an_endless_source_like_dev_zero_fails_instead_of_reading_forever(src, root, hash_thread):
    size = 3 * MiB + 5  # several chunks, not a chunk multiple
    obj = ObjectRecord(location="/dev/zero", digest=b3(bytes(size)), size=size, records=1, start=0)
    with NodeCache(root, 8 * MiB, retries=1, backoff_s=0.001, hash_thread=hash_thread) as cache:
        with pytest.raises(DigestMismatch) as info:
            cache.fetch(obj, "/dev/zero")
        assert f"got more than {size} bytes" in str(info.value) and f"stopped at {size + 1} bytes" in str(info.value)
        assert "'/dev/zero'" in str(info.value) and "after 2 tries" in str(info.value)
        assert cache.stats().quarantined == 2 and cache.lookup(obj.digest) is None


def test_missing_source_fails_after_all_tries_naming_it(src, root):
    obj = ObjectRecord(location="gone.bin", digest=b3(b"x"), size=1, records=1, start=0)
    with NodeCache(root, MiB, retries=1, backoff_s=0.001) as cache, pytest.raises(SourceReadError) as info:
        cache.fetch(obj, str(src / "gone.bin"))
    msg = str(info.value)
    assert obj.digest in msg and str(src / "gone.bin") in msg and "after 2 tries" in msg and "no such file" in msg
    assert cache.stats().retries == 1


def test_source_that_fails_twice_then_is_repaired_fills_on_the_third_try(src, root):
    good = payload(9, 64 * 1024)
    obj, path = make_object(src, "flaky.bin", good)
    Path(path).write_bytes(good[::-1])  # wrong bytes until the repair below
    qdir = root / "quarantine"

    def repair_after_two_failures() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if qdir.exists() and len(list(qdir.glob("*.bad"))) >= 2:
                tmp = Path(path + ".new")
                tmp.write_bytes(good)
                os.replace(tmp, path)  # the store is repaired while the filler backs off
                return
            time.sleep(0.002)

    repairer = threading.Thread(target=repair_after_two_failures)
    repairer.start()
    # the wait before try 3 is >= 0.6 s * 2 * 0.5: the repair (polling every 2 ms) lands well before it
    cache = NodeCache(root, MiB, retries=3, backoff_s=0.6)
    with cache.fetch(obj, path) as got:
        assert Path(got.path).read_bytes() == good
    repairer.join()
    s = cache.stats()
    assert (s.quarantined, s.retries, s.fills) == (2, 2, 1)
    cache.close()


def test_budget_evicts_least_recently_used_and_never_a_pinned_object(src, root):
    size = 100_000
    objs = {n: make_object(src, f"{n}.bin", payload(10 + i, size)) for i, n in enumerate("abcdef")}
    cache = NodeCache(root, 3 * size)

    def fetch(name: str):
        obj, path = objs[name]
        return cache.fetch(obj, path)

    def present() -> set[str]:
        out = set()
        for n, (obj, _) in objs.items():
            found = cache.lookup(obj.digest)
            if found is not None:
                out.add(n)
                found.close()
        return out

    for n in "abc":
        fetch(n).close()
    fetch("a").close()  # a is now more recent than b and c
    fetch("d").close()
    assert present() == {"a", "c", "d"}  # b was least recently used
    with fetch("c"):  # c is pinned (and now most recent; a is LRU)
        fetch("e").close()
        assert present() == {"c", "d", "e"}
        with fetch("d"), fetch("e"):  # everything pinned: nothing can make room
            with pytest.raises(CacheError) as info:
                fetch("f")
            assert "do not fit in the cache budget of 300000 bytes" in str(info.value)
            assert "300000 of them pinned" in str(info.value)
    s = cache.stats()
    assert s.evictions == 2 and s.bytes == 3 * size <= cache.budget_bytes
    fetch("f").close()  # pins released: f fits again
    assert cache.stats().bytes <= 3 * size
    cache.close()


def test_object_larger_than_the_budget_fails_without_touching_the_source(src, root):
    obj = ObjectRecord(location="huge.bin", digest=b3(b"h"), size=2 * MiB, records=1, start=0)
    with NodeCache(root, MiB) as cache, pytest.raises(CacheError, match="do not fit in the cache budget of 1048576"):
        cache.fetch(obj, str(src / "huge.bin"))


class _FullDisk:
    """A temporary-file writer on a disk that fills up after `room` bytes."""

    def __init__(self, path: str, room: int) -> None:
        self._f = open(path, "xb", buffering=0)
        self._room = room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._f.write(data)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()


def test_enospc_during_a_fill_fails_it_removes_the_temp_file_and_keeps_the_cache_usable(src, root):
    big, big_path = make_object(src, "big.bin", payload(20, 3 * MiB))
    small, small_path = make_object(src, "small.bin", payload(21, 1000))
    full = NodeCache(root, 64 * MiB, open_tmp=lambda p: _FullDisk(p, MiB))
    with pytest.raises(CacheError) as info:
        full.fetch(big, big_path)
    msg = str(info.value)
    assert "ENOSPC" in msg and "disk is full" in msg and big.digest in msg and big_path in msg
    assert "try 1 of 4, expected size 3145728" in msg
    assert files_in(root / "tmp") == []
    assert full.stats().retries == 0  # a full disk is not retried against the source
    with full.fetch(small, small_path) as got:  # small enough for the space left
        assert Path(got.path).read_bytes() == payload(21, 1000)
    full.close()
    with NodeCache(root, 64 * MiB) as cache:  # and the reservation of the failed fill is gone
        with cache._core.index.read() as txn:
            assert cache._core.index.reservations(txn) == {}
        cache.fetch(big, big_path).close()
        assert cache.stats().objects == 2


def test_s3_source_from_the_loopback_server(src, root, s3_bucket_factory, s3_server):
    data = payload(30, 3 * MiB + 5)
    changed = payload(31, len(data))
    s3_bucket_factory("cache-test", {"shards/a.bin": data, "shards/b.bin": changed})
    obj = ObjectRecord(location="s3://cache-test/shards/a.bin", digest=b3(data), size=len(data), records=1, start=0)
    with NodeCache(root, 16 * MiB, retries=1, backoff_s=0.001) as cache:
        with cache.fetch(obj, obj.location) as got:
            assert Path(got.path).read_bytes() == data
        # b.bin was rewritten after freezing: its frozen digest no longer matches
        other = ObjectRecord(location="s3://cache-test/shards/b.bin", digest=b3(payload(32, len(data))),
                             size=len(data), records=1, start=0)
        with pytest.raises(DigestMismatch, match="s3://cache-test/shards/b.bin"):
            cache.fetch(other, other.location)
        assert cache.stats().fills == 1


def test_verify_on_read_catches_a_flipped_byte_and_refills(src, root):
    data = payload(40, 200_000)
    obj, path = make_object(src, "v.bin", data)
    with NodeCache(root, MiB) as cache:
        cached = cache.fetch(obj, path)
        cached.close()
    with open(cached.path, "r+b") as f:  # bit rot in the cached copy, same size
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 1]))
    with NodeCache(root, MiB) as trusting, trusting.fetch(obj, path) as got:
        assert Path(got.path).read_bytes() != data  # what verify-on-read exists to prevent
    with NodeCache(root, MiB, verify_on_read=True) as paranoid:
        with paranoid.fetch(obj, path) as got:
            assert Path(got.path).read_bytes() == data
        s = paranoid.stats()
        assert (s.verify_failures, s.quarantined, s.fills, s.objects) == (1, 1, 1, 1)


def test_restart_drops_entries_whose_file_vanished_and_removes_orphans(src, root):
    a, a_path = make_object(src, "a.bin", payload(50, 1000))
    b, b_path = make_object(src, "b.bin", payload(51, 1000))
    with NodeCache(root, MiB) as cache:
        ca = cache.fetch(a, a_path)
        ca.close()
        cb = cache.fetch(b, b_path)
        cb.close()
    os.unlink(ca.path)  # someone deleted an object file
    orphan = root / "objects" / "ff" / ("ff" * 32)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"junk")
    debris = root / "tmp" / f"{'ee' * 32}.99999.0.part"
    debris.write_bytes(b"partial")
    with NodeCache(root, MiB, collect=False) as cache:
        report = cache.collect_debris()
        assert (report.dropped_entries, report.orphan_objects, report.tmp_files) == (1, 1, 1)
        assert cache.lookup(a.digest) is None and not orphan.exists() and not debris.exists()
        assert cache.stats().objects == 1
        with cache.fetch(a, a_path) as again:  # refilled on demand
            assert Path(again.path).read_bytes() == payload(50, 1000)


def test_derived_objects_are_keyed_by_their_inputs_and_made_once(root):
    raw, tok = b3(b"raw"), b3(b"tokenizer")
    calls: list[Path] = []

    def producer(path: Path) -> None:
        calls.append(path)
        path.write_bytes(b"tokens of raw")

    inputs = {"raw": raw, "tokenizer": tok, "transform": "tok/1"}
    with NodeCache(root, MiB) as cache:
        key = NodeCache.derived_key(raw, tok, "tok/1")
        assert cache.get_derived(inputs) is None
        with cache.put_derived(inputs, producer) as made:
            assert made.key == key and made.digest == b3(b"tokens of raw") and made.kind == "derived"
        with cache.put_derived(inputs, producer) as again:
            assert again.path == made.path
        assert len(calls) == 1
        assert NodeCache.derived_key(raw, tok, "tok/2") != key
        assert NodeCache.derived_key(tok, raw, "tok/1") != key

        def failing(path: Path) -> None:
            path.write_bytes(b"half")
            raise RuntimeError("tokenizer crashed")

        with pytest.raises(RuntimeError):
            cache.put_derived({**inputs, "transform": "tok/3"}, failing)
        assert files_in(root / "tmp") == []
        assert cache.get_derived({**inputs, "transform": "tok/3"}) is None


def test_derived_object_damage_is_caught_by_verify_on_read(root):
    inputs = {"raw": b3(b"r"), "tokenizer": b3(b"t"), "transform": "v1"}
    with NodeCache(root, MiB) as cache:
        made = cache.put_derived(inputs, lambda p: p.write_bytes(b"abcdef"))
        made.close()
    Path(made.path).write_bytes(b"abcdeX")
    with NodeCache(root, MiB, verify_on_read=True) as cache:
        assert cache.get_derived(inputs) is None
        assert cache.stats().verify_failures == 1
        with cache.put_derived(inputs, lambda p: p.write_bytes(b"abcdef")) as again:
            assert again.read_bytes() == b"abcdef"


def test_bad_arguments_are_refused_with_the_field_named(root):
    with pytest.raises(CacheError, match="budget_bytes must be a positive integer"):
        NodeCache(root, 0)
    with NodeCache(root, MiB) as cache:
        bad = ObjectRecord(location="x", digest="b3:" + "A" * 64, size=1, records=1, start=0)
        with pytest.raises(CacheError, match="object x: 'b3:AAAA"):
            cache.fetch(bad, "x")


@given(size=st.integers(0, 2**40), seconds=st.integers(0, 2**40), kind=st.sampled_from(["raw", "derived"]),
       content=st.binary(min_size=32, max_size=32), source=st.text(max_size=50))
def test_index_records_round_trip(size, seconds, kind, content, source):
    rec = IndexRecord(size, kind, "b3:" + content.hex(), source, seconds)
    assert IndexRecord.decode(rec.encode(), b"k") == rec


@given(attempt=st.integers(1, 30), base=st.floats(0.0001, 1.0))
def test_backoff_is_bounded_exponential_with_jitter(attempt, base):
    ceiling = min(2.0, base * 2 ** (attempt - 1))
    delay = backoff_delay("ab" * 32, attempt, base, 2.0)
    assert 0.5 * ceiling <= delay < ceiling + 1e-12
    assert delay == backoff_delay("ab" * 32, attempt, base, 2.0)  # seeded, not global randomness


@given(n=st.integers(1, 10**6), unit=st.sampled_from(["", "K", "M", "G", "KiB", "MB"]))
def test_parse_bytes(n, unit):
    factor = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KiB": 1 << 10, "MB": 1 << 20}[unit]
    assert parse_bytes(f"{n}{unit}") == n * factor


def test_threads_fetching_and_evicting_concurrently_always_get_correct_bytes(src, root):
    """Fills, hits, pins and evictions interleave freely; bytes and budget stay right."""
    size = 20_000
    objs = [make_object(src, f"s{i}.bin", payload(500 + i, size)) for i in range(16)]
    cache = NodeCache(root, 10 * size, durable=False)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(120):
                obj, path = objs[(offset + i * (offset + 3)) % len(objs)]
                with cache.fetch(obj, path) as got:
                    assert b3(Path(got.path).read_bytes()) == obj.digest
                    assert cache.stats().bytes <= 10 * size
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    s = cache.stats()
    assert s.hits + s.misses == 480 and s.evictions > 0 and s.bytes <= 10 * size
    assert cache.verify_all().damaged == ()
    cache.close()


def test_two_instances_on_one_folder_in_one_process_share_the_index(src, root):
    obj, path = make_object(src, "shared.bin", payload(600, 1000))
    first = NodeCache(root, MiB)
    second = NodeCache(root, MiB, verify_on_read=True)
    first.fetch(obj, path).close()
    with second.fetch(obj, path):
        pass
    first.close()  # the other instance keeps working
    assert second.stats().hits == 1 and second.lookup(obj.digest) is not None
    second.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 4), min_size=6, max_size=6),
       ops=st.lists(st.integers(0, 5), min_size=1, max_size=14))
def test_eviction_matches_an_lru_model(tmp_path_factory, sizes, ops):
    """After any sequence of fetches the cache holds exactly what a pure LRU model holds."""
    unit = 1000
    budget = 6 * unit
    folder = tmp_path_factory.mktemp("lru")
    objs = [make_object(folder, f"m{i}", payload(700 + i, s * unit)) for i, s in enumerate(sizes)]
    model: list[int] = []  # least recently used first
    with NodeCache(folder / "cache", budget, durable=False) as cache:
        for i in ops:
            if i in model:
                model.remove(i)
            else:
                while sum(sizes[j] for j in model) * unit + sizes[i] * unit > budget:
                    model.pop(0)
            model.append(i)
            cache.fetch(*objs[i]).close()
            held = set()
            for j, (obj, _) in enumerate(objs):
                found = cache.lookup(obj.digest)
                if found is not None:
                    held.add(j)
                    found.close()
            assert held == set(model)


def test_a_full_index_map_is_a_clear_cache_error(tmp_path):
    from sluice.cache.index import Index, IndexRecord
    from sluice.errors import CacheError

    index = Index(tmp_path, map_size=1 << 16)  # a few pages: fills after a few hundred entries
    with pytest.raises(CacheError, match=r"LMDB map \(65536 bytes\) is full; run `sluice cache gc`"):
        for i in range(100_000):
            with index.write() as txn:
                rec = IndexRecord(size=1, kind="raw", content="b3:" + f"{i:064x}", source="s" * 200, filled_ns=i)
                index.put(txn, f"{i:064x}".encode(), rec, i)
    with index.read() as txn:  # what was committed before is intact
        assert index.get(txn, f"{0:064x}".encode()).size == 1


def test_an_evictor_never_unlinks_the_file_of_a_key_refilled_right_after_its_commit(src, root):
    """Three objects, a budget for two, three threads: most fetches evict a key another refills.

    The evictor commits the entry's deletion, then unlinks the file; a filler of
    the same key in between would publish a fresh file that the evictor then
    removed (an entry without a file). Evictors hold the victim's fill lock, so
    that interleaving cannot happen.
    """
    size = 8192
    objs = [make_object(src, f"e{i}.bin", payload(900 + i, size)) for i in range(3)]
    cache = NodeCache(root, 2 * size, durable=False)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(300):
                obj, path = objs[(offset + i) % 3]
                for _ in range(1000):
                    try:
                        cache.fetch(obj, path).close()
                        break
                    except CacheError as exc:  # the budget is reserved by the others' fills: try again
                        assert "do not fit in the cache budget" in str(exc)
                        time.sleep(0.001)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert cache.verify_all().damaged == ()
    cache.close()


@pytest.mark.timeout(30, method="thread")
def test_a_thread_finishing_a_write_while_another_thread_waits_to_write_does_not_hang(root):
    """py-lmdb 2.3 hangs when a write transaction is aborted (a budget refusal does
    that) while another thread of the process waits in begin(write=True); the
    index queues its writers on a lock instead."""
    with NodeCache(root, MiB) as cache:
        idx = cache._core.index
        done = threading.Event()

        def second_writer() -> None:
            with idx.write() as txn:
                idx.set_meta(txn, b"second", 2)
            done.set()

        with pytest.raises(CacheError, match="refused"):
            with idx.write() as txn:
                other = threading.Thread(target=second_writer, daemon=True)
                other.start()
                time.sleep(0.2)  # the second writer is now waiting for the writer lock
                idx.set_meta(txn, b"first", 1)
                raise CacheError("refused: the transaction aborts")
        assert done.wait(10)
        with idx.read() as txn:
            assert (idx.meta(txn, b"first"), idx.meta(txn, b"second")) == (0, 2)
