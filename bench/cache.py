"""Benchmark the node cache (issue: node cache, "Speed").

1. Fill throughput from a local source against `shutil.copyfile` of the same
   bytes in the same run, interleaved, median of `--repeats`. Two pairs:
   `fill` (durable=False) vs `copyfile`, and `fill durable` (fsync before
   publish, the default) vs `copyfile + fsync`, so each ratio compares equal
   durability. Target: ratio >= 0.7.
   Also reported: a fill with `hash_thread=True` (hashing overlapped on a
   second thread), and the ratio of CPU seconds (copyfile / fill), which is what
   the wall ratio tends to when no second core is free for the hashing thread.
   `--phases` adds where a fill's time goes, each phase timed interleaved with
   `copyfile` on the same source: the copy loop without the cache, through
   user space as the fill does it (read into a 256 KiB buffer; + write; +
   BLAKE3; and the same with a 1 MiB buffer, the default before) and in the
   kernel (copy_file_range + read back into the buffer; + BLAKE3), and the
   whole fill (the loop plus lock, temp file, rename and the LMDB entry), by
   default and with `kernel_copy=True`.
2. Hit latency: `fetch(obj).close()` on published objects with the index warm
   (median and p99 over `--hits` fetches spread over 1,000 objects). Target:
   median < 50 us.

Prints a table, one JSON line, and writes bench/out/cache.json.
Run: ``.venv/bin/python bench/cache.py [--size-mib 256] [--full]`` (`--full`
fills a 1 GiB object).
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))

import blake3  # noqa: E402

from sluice.cache import NodeCache  # noqa: E402
from sluice.manifest.sources import ObjectRecord  # noqa: E402

MiB = 1 << 20


def make_source(path: Path, size: int, seed: int = 0) -> ObjectRecord:
    """Deterministic incompressible bytes (BLAKE3 XOF of the seed), written in 64 MiB pieces."""
    h = blake3.blake3(seed.to_bytes(8, "little"))
    digest = blake3.blake3()
    with open(path, "wb") as f:
        done = 0
        while done < size:
            n = min(64 * MiB, size - done)
            piece = h.digest(length=n, seek=done)
            f.write(piece)
            digest.update(piece)
            done += n
    return ObjectRecord(location=path.name, digest="b3:" + digest.hexdigest(), size=size, records=1, start=0)


def time_fill(work: Path, obj: ObjectRecord, src: Path, durable: bool, hash_thread: bool = False,
              kernel_copy: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of one fill."""
    root = work / "cache"
    cache = NodeCache(root, 4 * obj.size + MiB, durable=durable, hash_thread=hash_thread, kernel_copy=kernel_copy)
    start, cpu = time.perf_counter(), time.process_time()
    cache.fetch(obj, str(src)).close()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert cache.stats().fills == 1
    cache.close()
    shutil.rmtree(root)
    return elapsed, cpu


def time_copy(work: Path, src: Path, durable: bool) -> tuple[float, float]:
    dest = work / "copy.bin"
    start, cpu = time.perf_counter(), time.process_time()
    shutil.copyfile(src, dest)
    if durable:
        fd = os.open(dest, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    dest.unlink()
    return elapsed, cpu


def bench_fill(work: Path, size: int, repeats: int) -> dict[str, float]:
    src = work / "source.bin"
    obj = make_source(src, size)
    with open(src, "rb") as f:  # the source is in the page cache for every contender
        while f.read(64 * MiB):
            pass
    out: dict[str, float] = {}
    for durable in (False, True):
        fills, copies = [], []
        for _ in range(repeats):  # interleaved, so load changes hit both alike
            copies.append(time_copy(work, src, durable))
            fills.append(time_fill(work, obj, src, durable))
        tag = "_durable" if durable else ""
        fill_wall = statistics.median(w for w, _ in fills)
        copy_wall = statistics.median(w for w, _ in copies)
        out[f"fill{tag}_mb_s"] = size / fill_wall / 1e6
        out[f"copy{tag}_mb_s"] = size / copy_wall / 1e6
        out[f"fill{tag}_ratio"] = copy_wall / fill_wall
        out[f"fill{tag}_ratio_best"] = min(w for w, _ in copies) / min(w for w, _ in fills)  # least disturbed runs
        if not durable:  # CPU cost ratio: what the wall ratio tends to when no core is free
            out["fill_cpu_ratio"] = statistics.median(c for _, c in copies) / statistics.median(c for _, c in fills)
    threaded, copies = [], []
    for _ in range(repeats):
        copies.append(time_copy(work, src, False))
        threaded.append(time_fill(work, obj, src, False, hash_thread=True))
    out["fill_hash_thread_mb_s"] = size / statistics.median(w for w, _ in threaded) / 1e6
    out["fill_hash_thread_ratio"] = statistics.median(w for w, _ in copies) / statistics.median(w for w, _ in threaded)
    src.unlink()
    return out


def _loop(src: Path, dest: Path | None, hashing: bool, kernel: bool = False, chunk: int = 256 << 10) -> float:
    """Seconds of the fill's copy loop alone, one buffer. `kernel`: copy_file_range each chunk into
    `dest`, then read it back into the buffer (the fill's path); else read the chunk into the buffer and
    write it to `dest` (the path through user space). `dest` None: only read. Unlinking is not timed."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    h = blake3.blake3()
    t0 = time.perf_counter()
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if dest is not None else -1
    with open(src, "rb", buffering=0) as f:
        off = 0
        while True:
            if kernel and fd >= 0:
                n = os.copy_file_range(f.fileno(), fd, chunk, off, off)
                if n:
                    os.preadv(fd, [view[:n]], off)
            else:
                n = f.readinto(buf)
                if n and fd >= 0:
                    os.write(fd, view[:n])
            if not n:
                break
            if hashing:
                h.update(view[:n])
            off += n
    if fd >= 0:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    if dest is not None:
        dest.unlink()
    return elapsed


def bench_phases(work: Path, size: int, repeats: int) -> dict[str, float]:
    """Median seconds per phase of a non-durable fill, and of copyfile, interleaved round by round."""
    src = work / "source.bin"
    obj = make_source(src, size)
    dest = work / "loop.bin"
    phases = {
        "read": lambda: _loop(src, None, False),
        "read_hash": lambda: _loop(src, None, True),
        "read_write": lambda: _loop(src, dest, False),
        "read_write_hash": lambda: _loop(src, dest, True),
        "kcopy_readback": lambda: _loop(src, dest, False, kernel=True),
        "kcopy_readback_hash": lambda: _loop(src, dest, True, kernel=True),
        "read_write_hash_1mib": lambda: _loop(src, dest, True, chunk=MiB),
        "fill": lambda: time_fill(work, obj, src, False)[0],
        "fill_kernel_copy": lambda: time_fill(work, obj, src, False, kernel_copy=True)[0],
        "copyfile": lambda: time_copy(work, src, False)[0],
    }
    times: dict[str, list[float]] = {k: [] for k in phases}
    for _ in range(repeats):
        for name, run in phases.items():
            times[name].append(run())
    src.unlink()
    return {f"phase_{k}_s": statistics.median(v) for k, v in times.items()}


def bench_hits(work: Path, hits: int, objects: int = 1000) -> dict[str, float]:
    srcdir = work / "small"
    srcdir.mkdir()
    records = []
    for i in range(objects):
        data = blake3.blake3(i.to_bytes(8, "little")).digest(length=4096)
        (srcdir / f"o{i}").write_bytes(data)
        records.append((ObjectRecord(location=f"o{i}", digest="b3:" + blake3.blake3(data).hexdigest(),
                                     size=4096, records=1, start=0), str(srcdir / f"o{i}")))
    cache = NodeCache(work / "hits", 64 * MiB, durable=False)
    for obj, path in records:
        cache.fetch(obj, path).close()
    for obj, path in records:  # warm the index and the dentries
        cache.fetch(obj, path).close()
    samples = []
    clock = time.perf_counter_ns
    for i in range(hits):
        obj, path = records[(i * 7919) % objects]  # a fixed stride through all objects
        t0 = clock()
        cache.fetch(obj, path).close()
        samples.append(clock() - t0)
    stats = cache.stats()
    cache.close()
    assert stats.fills == objects and stats.hits == objects + hits, stats
    samples.sort()
    return {"hit_median_us": samples[len(samples) // 2] / 1000, "hit_p99_us": samples[len(samples) * 99 // 100] / 1000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="object size for the fill benchmark")
    parser.add_argument("--full", action="store_true", help="use a 1 GiB object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hits", type=int, default=50_000)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--phases", action="store_true", help="also time the phases of a fill (see above)")
    args = parser.parse_args(argv)
    size = (1024 if args.full else args.size_mib) * MiB
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sluice-bench-cache-") as tmp:
        work = Path(tmp)
        result = {"bench": "cache", "size_bytes": size, "repeats": args.repeats, "hits": args.hits,
                  **bench_fill(work, size, args.repeats), **bench_hits(work, args.hits)}
        if args.phases:
            result.update(bench_phases(work, size, args.repeats))
    result["load_avg_1m"] = os.getloadavg()[0]
    result["cpus"] = os.cpu_count()
    result["fill_target_met"] = result["fill_ratio"] >= 0.7
    result["hit_target_met"] = result["hit_median_us"] < 50
    rows = [
        ("fill (local source)", f"{result['fill_mb_s']:.0f} MB/s", f"copyfile {result['copy_mb_s']:.0f} MB/s",
         f"{result['fill_ratio']:.2f}x", ">= 0.7x"),
        ("fill, durable", f"{result['fill_durable_mb_s']:.0f} MB/s",
         f"copyfile+fsync {result['copy_durable_mb_s']:.0f} MB/s", f"{result['fill_durable_ratio']:.2f}x", ">= 0.7x"),
        ("fill, hash_thread=True", f"{result['fill_hash_thread_mb_s']:.0f} MB/s", "copyfile (same run)",
         f"{result['fill_hash_thread_ratio']:.2f}x", "(info)"),
        ("fill CPU cost", "", "copyfile CPU / fill CPU", f"{result['fill_cpu_ratio']:.2f}x", "(info)"),
        ("hit latency (median)", f"{result['hit_median_us']:.1f} us", f"p99 {result['hit_p99_us']:.1f} us", "",
         "< 50 us"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    print(f"cache bench: {size // MiB} MiB object, median of {args.repeats} (best-of ratio "
          f"{result['fill_ratio_best']:.2f}x); {args.hits} hits; load {result['load_avg_1m']:.1f} on "
          f"{result['cpus']} CPUs")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if args.phases:
        copy_s = result["phase_copyfile_s"]
        print("phases of a non-durable fill (median seconds; GB/s; copyfile / phase):")
        for name in ("read", "read_hash", "read_write", "read_write_hash", "read_write_hash_1mib",
                     "kcopy_readback", "kcopy_readback_hash", "fill", "fill_kernel_copy", "copyfile"):
            sec = result[f"phase_{name}_s"]
            print(f"  {name:<20} {sec:8.3f} s  {size / sec / 1e9:6.2f} GB/s  {copy_s / sec:5.2f}x")
        hash_s = result["phase_read_hash_s"] - result["phase_read_s"]
        result["fill_ratio_bound_one_core"] = copy_s / (copy_s + hash_s)
        print(f"  BLAKE3 alone {hash_s:.3f} s; a one-core fill can reach at most copyfile / (copyfile + BLAKE3) = "
              f"{result['fill_ratio_bound_one_core']:.2f}x")
    line = json.dumps(result, sort_keys=True)
    print(line)
    out = _REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
