"""The node cache across real processes: one fill per key, kill -9, pins, a full disk.

Children are real `python` processes sharing one cache folder (their own LMDB
environments); sources that must stay "in flight" are FIFOs the test writes to,
so the timing is driven by file operations, not by sleeps in the cache.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from sluice.cache import NodeCache
from sluice.errors import CacheError
from sluice.manifest.sources import ObjectRecord

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys
from sluice.cache import NodeCache
from sluice.manifest.sources import ObjectRecord
root, mode, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
jobs = [a.split("|") for a in sys.argv[4:]]  # location|digest|size
cache = NodeCache(root, budget, durable=False)
print("ready", flush=True)
ok = True
for location, digest, size in jobs:
    obj = ObjectRecord(location=os.path.basename(location), digest=digest, size=int(size), records=1, start=0)
    got = cache.fetch(obj, location)
    import blake3
    ok = ok and "b3:" + blake3.blake3(open(got.path, "rb").read()).hexdigest() == digest
    if mode == "hold":
        print("pinned", flush=True)
        sys.stdin.readline()
    got.close()
s = cache.stats()
cache.close()
print(json.dumps({"ok": ok, "fills": s.fills, "misses": s.misses, "hits": s.hits}), flush=True)
"""


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def payload(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def spawn(root: Path, mode: str, budget: int, *jobs: tuple[str, str, int]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [f"{loc}|{dig}|{size}" for loc, dig, size in jobs]
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), mode, str(budget), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_line(proc: subprocess.Popen, expected: str) -> None:
    line = proc.stdout.readline().strip()
    assert line == expected, f"child said {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for stream in (p.stdin, p.stdout, p.stderr):
            stream.close()


def index_is_sound(root: Path) -> None:
    """Every index entry names a present file whose bytes hash to its key."""
    cache = NodeCache(root, 1 << 30, collect=False)
    with cache._core.index.read() as txn:
        entries = list(cache._core.index.items(txn))
    for key, rec in entries:
        path = cache._core.layout.object_path(key.decode())
        data = Path(path).read_bytes()
        assert len(data) == rec.size and b3(data) == rec.content == "b3:" + key.decode()
    cache.close()


def test_processes_fetching_one_object_produce_exactly_one_fill(tmp_path, procs):
    data = payload(1, 2 * MiB)
    fifo = tmp_path / "source"
    os.mkfifo(fifo)
    root = tmp_path / "cache"
    procs += [spawn(root, "fetch", 1 << 30, (str(fifo), b3(data), len(data))) for _ in range(4)]
    for p in procs:
        wait_line(p, "ready")
    with open(fifo, "wb") as w:  # returns when the one filler has opened the source
        time.sleep(0.5)  # the others are now waiting on the fill lock
        w.write(data)
    results = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
    assert all(r["ok"] for r in results)
    assert sum(r["fills"] for r in results) == 1
    assert sum(r["misses"] for r in results) >= 2  # they really overlapped
    with NodeCache(root, 1 << 30) as cache:
        assert cache.stats(all_processes=True).fills == 1
        assert cache.stats().objects == 1


def test_kill_9_mid_fill_then_restart_leaves_no_entry_and_collects_the_debris(tmp_path, procs):
    data = payload(2, 4 * MiB)
    fifo = tmp_path / "source"
    os.mkfifo(fifo)
    root = tmp_path / "cache"
    child = spawn(root, "fetch", 1 << 30, (str(fifo), b3(data), len(data)))
    procs.append(child)
    wait_line(child, "ready")
    w = open(fifo, "wb")
    w.write(data[: MiB])  # half-way through the object...
    deadline = time.monotonic() + 20
    while not any(p.stat().st_size > 0 for p in (root / "tmp").iterdir()):
        assert time.monotonic() < deadline, "the child never started writing"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)  # ...the filler dies
    child.wait(10)
    try:
        w.close()
    except BrokenPipeError:
        pass
    assert len(list((root / "tmp").iterdir())) == 1
    index_is_sound(root)
    cache = NodeCache(root, 1 << 30)  # restart
    assert list((root / "tmp").iterdir()) == []
    with cache._core.index.read() as txn:
        assert cache._core.index.reservations(txn) == {}
    assert cache.stats().objects == 0
    real = tmp_path / "real.bin"
    real.write_bytes(data)
    obj = ObjectRecord(location="real.bin", digest=b3(data), size=len(data), records=1, start=0)
    with cache.fetch(obj, str(real)) as got:
        assert Path(got.path).read_bytes() == data
    cache.close()


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05])
def test_kill_9_at_assorted_moments_never_leaves_a_bad_index_entry(tmp_path, procs, delay):
    root = tmp_path / "cache"
    jobs = []
    for i in range(24):
        data = payload(100 + i, 512 * 1024)
        path = tmp_path / f"o{i}.bin"
        path.write_bytes(data)
        jobs.append((str(path), b3(data), len(data)))
    child = spawn(root, "fetch", 1 << 30, *jobs)
    procs.append(child)
    wait_line(child, "ready")
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    index_is_sound(root)
    with NodeCache(root, 1 << 30) as cache:
        assert list((root / "tmp").iterdir()) == []
        assert cache.verify_all().damaged == ()


def test_a_pin_held_by_another_process_blocks_eviction_until_that_process_dies(tmp_path, procs):
    size = 100_000
    objs = []
    for i in range(4):
        data = payload(200 + i, size)
        path = tmp_path / f"p{i}.bin"
        path.write_bytes(data)
        objs.append((ObjectRecord(location=path.name, digest=b3(data), size=size, records=1, start=0), str(path)))
    root = tmp_path / "cache"
    holder = spawn(root, "hold", 2 * size, (objs[0][1], objs[0][0].digest, size))
    procs.append(holder)
    wait_line(holder, "ready")
    wait_line(holder, "pinned")  # object 0 is the least recently used, but pinned elsewhere
    cache = NodeCache(root, 2 * size)
    cache.fetch(*objs[1]).close()
    cache.fetch(*objs[2]).close()  # must evict: 0 is pinned, so 1 goes
    assert cache.lookup(objs[1][0].digest) is None
    assert cache.lookup(objs[0][0].digest) is not None
    holder.send_signal(signal.SIGKILL)  # its pin dies with it
    holder.wait(10)
    cache.fetch(*objs[3]).close()  # now 0, the least recently used, is evicted
    assert cache.lookup(objs[0][0].digest) is None
    assert cache.stats().evictions == 2
    cache.close()


def _fetch_in_forked_child(cache: NodeCache, obj: ObjectRecord, path: str) -> None:
    with cache.fetch(obj, path) as got:
        ok = Path(got.path).read_bytes() == Path(path).read_bytes()
    cache.close()
    os._exit(0 if ok else 1)


def test_an_instance_used_after_fork_opens_its_own_index(tmp_path):
    a, b = payload(300, 5000), payload(301, 5000)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    rec = lambda name, data: ObjectRecord(location=name, digest=b3(data), size=len(data), records=1, start=0)  # noqa: E731
    cache = NodeCache(tmp_path / "cache", MiB)
    cache.fetch(rec("a", a), str(tmp_path / "a")).close()
    child = multiprocessing.get_context("fork").Process(
        target=_fetch_in_forked_child, args=(cache, rec("b", b), str(tmp_path / "b")))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert cache.lookup(rec("b", b).digest) is not None  # the parent sees the child's fill
    cache.fetch(rec("a", a), str(tmp_path / "a")).close()
    assert cache.stats().hits == 1
    cache.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MiB tmpfs: writes beyond it fail with ENOSPC from the kernel."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root; the injected-ENOSPC test covers the logic")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); the injected-ENOSPC test covers the logic")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_enospc_fails_the_fill_and_leaves_the_cache_usable(tmp_path, tiny_disk):
    big, small = payload(400, 3 * MiB), payload(401, 100_000)
    (tmp_path / "big").write_bytes(big)
    (tmp_path / "small").write_bytes(small)
    root = tiny_disk / "cache"
    cache = NodeCache(root, 64 * MiB)  # the budget is larger than the disk
    obj = ObjectRecord(location="big", digest=b3(big), size=len(big), records=1, start=0)
    with pytest.raises(CacheError) as info:
        cache.fetch(obj, str(tmp_path / "big"))
    assert "ENOSPC" in str(info.value) and obj.digest in str(info.value)
    assert list((root / "tmp").iterdir()) == []
    assert cache.stats().objects == 0
    small_obj = ObjectRecord(location="small", digest=b3(small), size=len(small), records=1, start=0)
    with cache.fetch(small_obj, str(tmp_path / "small")) as got:
        assert Path(got.path).read_bytes() == small
    assert cache.verify_all().damaged == ()
    cache.close()
