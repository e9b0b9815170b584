"""Benchmark: where freeze's time goes, phase by phase, on one core.

Generates `--gib` GiB of the jsonl documents of `bench/freeze.py` (and a
.jsonl.zst / .jsonl.gz copy of the first `--compressed` shards), warms the
page cache, then times each phase of a freeze alone over the same bytes, one
core, in 8 MiB chunks (the phases of one chunk run back to back, as in
`formats.scan_object`); `--repeat` rounds, the best of each. Printed per
phase: seconds per GiB and GB/s of the bytes it reads (uncompressed jsonl,
or decoded bytes for the decompressors).

    .venv/bin/python bench/freeze_phases.py --gib 1

Phases: the read (page cache -> buffer); BLAKE3 (one thread; and with
`max_threads=2`); the newline count of `--check count` (numpy compare +
count) and its blank-line test (before: 16-bit compares of the bytes; now:
the newline mask ANDed with itself shifted by one, the mask's compare
included); the line shaping of the
block path; msgspec's decode of every block as it runs today (generic: dicts
and strings); taking the texts out; a typed decode (a Struct holding only the
text field; the other fields are skipped, still syntax-checked, but their
UTF-8 is not: see docs/manifest.md); a decode into an empty Struct (every
value skipped: the least a msgspec syntax check can cost); a UTF-8 check of
the block (what the typed decodes would have to add); zstd and gzip
decompression; and the whole `scan_object` with each check.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import blake3
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from freeze import generate  # noqa: E402 - the same corpus as bench/freeze.py

CHUNK = 8 << 20


class _Text(msgspec.Struct):
    text: str


class _Nothing(msgspec.Struct):
    pass


def _blocks(buf: bytearray, n: int) -> list[tuple[int, int]]:
    """(lo, hi) of the 1 MiB blocks of complete lines in buf[:n] (as jsonl.JsonlScanner cuts them)."""
    from sluice.manifest.jsonl import BLOCK

    out, s, last = [], buf.find(b"\n", 0, n) + 1, buf.rfind(b"\n", 0, n)
    while 0 < s <= last:
        e = buf.rfind(b"\n", s, min(s + BLOCK, last + 1))
        out.append((s, e + 1))
        s = e + 1
    return out


def phases(paths: list[Path]) -> dict[str, Callable[[bytearray, int], object]]:
    from sluice.manifest import jsonl

    generic, typed, nothing = msgspec.json.Decoder(), msgspec.json.Decoder(_Text), msgspec.json.Decoder(_Nothing)
    scratch = np.empty(CHUNK, dtype=bool)
    pair_scratch = jsonl.scratch_for(CHUNK)

    def count(buf: bytearray, n: int) -> object:
        eq = scratch[:n]
        np.equal(np.frombuffer(buf, np.uint8, count=n), 10, out=eq)
        return int(np.count_nonzero(eq))

    def blank_and(buf: bytearray, n: int) -> object:  # this round's test: the newline mask ANDed with itself
        sc = jsonl.JsonlScanner("bench", "text", "count", False)
        sc.scratch = pair_scratch
        eq = pair_scratch[:n]
        np.equal(np.frombuffer(buf, np.uint8, count=n), 10, out=eq)
        return buf.find(b"\r", 0, n) >= 0 or sc._adjacent_newlines(eq)

    def blank_test(buf: bytearray, n: int) -> object:
        found = buf.find(b"\r", 0, n) >= 0
        for offset in (0, 1):
            words = np.frombuffer(buf, "<u2", offset=offset, count=(n - offset) // 2)
            half = scratch[: words.size]
            np.equal(words, 0x0A0A, out=half)
            found = found or bool(half.any())
        return found

    def shape(buf: bytearray, n: int) -> object:
        sc = jsonl.JsonlScanner("bench", "text", "full", False)
        sc._long_lines = True
        return [sc._shape(buf, lo, hi) for lo, hi in _blocks(buf, n)]

    def decode_with(dec: msgspec.json.Decoder) -> Callable[[bytearray, int], object]:
        def run(buf: bytearray, n: int) -> object:
            view = memoryview(buf)
            return sum(len(dec.decode_lines(view[lo:hi])) for lo, hi in _blocks(buf, n))
        return run

    def texts(buf: bytearray, n: int) -> object:
        view, k = memoryview(buf), 0
        for lo, hi in _blocks(buf, n):
            got = [v["text"] for v in generic.decode_lines(view[lo:hi])]
            k += len(got) if set(map(type, got)) == {str} else 0
        return k

    def utf8(buf: bytearray, n: int) -> object:
        view = memoryview(buf)
        return sum(len(str(view[lo:hi], "utf-8")) for lo, hi in _blocks(buf, n))

    return {
        "BLAKE3 (1 thread)": lambda buf, n: blake3.blake3(memoryview(buf)[:n]).digest(),
        "BLAKE3 (max_threads=2)": lambda buf, n: blake3.blake3(memoryview(buf)[:n], max_threads=2).digest(),
        "newline count (numpy)": count,
        "blank-line test, before (u16 compares)": blank_test,
        "blank-line test, now (mask compare + AND)": blank_and,
        "line shaping (block path)": shape,
        "msgspec decode, generic (today)": decode_with(generic),
        "msgspec generic + texts + type test": texts,
        "msgspec decode, Struct(text)": decode_with(typed),
        "msgspec decode, empty Struct (skip all)": decode_with(nothing),
        "UTF-8 check of the blocks": utf8,
    }


def _time_chunks(paths: list[Path], work: Callable[[bytearray, int], object] | None) -> float:
    """Seconds to read every file in CHUNK pieces and run `work` on each (None: the read alone)."""
    buf = bytearray(CHUNK)
    total = 0.0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                t0 = time.perf_counter()
                n = f.readinto(buf)
                if work is None:
                    total += time.perf_counter() - t0
                if not n:
                    break
                if work is not None:
                    t0 = time.perf_counter()
                    work(buf, n)
                    total += time.perf_counter() - t0
    return total


def _unzstd(paths: list[Path]) -> float:
    import zstandard

    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            for _ in zstandard.ZstdDecompressor().read_to_iter(f, read_size=1 << 20, write_size=1 << 20):
                pass
    return time.perf_counter() - t0


def _gunzip(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        obj = zlib.decompressobj(wbits=31)
        data = p.read_bytes()
        while data:
            obj.decompress(data, CHUNK)
            data = obj.unconsumed_tail
    return time.perf_counter() - t0


def _scan(paths: list[Path], compression: str, check: str) -> float:
    from sluice.manifest import formats

    t0 = time.perf_counter()
    for p in paths:
        formats.scan_object(str(p), "jsonl", compression, "text", check=check)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of jsonl (default 1)")
    ap.add_argument("--compressed", type=int, default=4, help="shards also compressed, for the decoders (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best of each phase (default 3)")
    ap.add_argument("--tmp", default=None, help="folder for the generated corpus (default: system temp)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "freeze_phases.json"))
    args = ap.parse_args(argv)
    import zstandard

    root = Path(tempfile.mkdtemp(prefix="sluice-bench-phases-", dir=args.tmp))
    try:
        paths, docs = generate(root, args.gib)
        some = paths[: args.compressed]
        zst, gz = [p.with_suffix(".jsonl.zst") for p in some], [p.with_suffix(".jsonl.gz") for p in some]
        for p, z, g in zip(some, zst, gz):
            data = p.read_bytes()
            z.write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
            g.write_bytes(gzip.compress(data, 6))
        size = sum(p.stat().st_size for p in paths)
        csize = sum(p.stat().st_size for p in some)
        _time_chunks(paths + zst + gz, None)  # warm the page cache
        work = phases(paths)
        best: dict[str, tuple[float, int]] = {}

        def keep(name: str, seconds: float, nbytes: int) -> None:
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, nbytes)

        for _ in range(args.repeat):
            keep("read (page cache, 8 MiB readinto)", _time_chunks(paths, None), size)
            for name, fn in work.items():
                keep(name, _time_chunks(paths, fn), size)
            keep("zstd decompression (decoded bytes)", _unzstd(zst), csize)
            keep("gzip decompression (decoded bytes)", _gunzip(gz), csize)
            keep("scan_object, --check count", _scan(paths, "none", "count"), size)
            keep("scan_object, --check full", _scan(paths, "none", "full"), size)
            keep("scan_object .jsonl.zst, full (decoded bytes)", _scan(zst, "zstd", "full"), csize)
            keep("scan_object .jsonl.gz, full (decoded bytes)", _scan(gz, "gzip", "full"), csize)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"freeze phases: {size / 2**30:.2f} GiB jsonl ({docs} documents, {len(paths)} objects), one core, "
          f"best of {args.repeat}")
    rows = []
    for name, (seconds, nbytes) in best.items():
        per_gib = seconds * (1 << 30) / nbytes
        rows.append({"phase": name, "s_per_gib": round(per_gib, 4), "gbps": round(nbytes / seconds / 1e9, 2)})
        print(f"{name:<48} {per_gib:8.3f} s/GiB {nbytes / seconds / 1e9:8.2f} GB/s")
    result = {"bench": "freeze_phases", "gib": args.gib, "documents": docs, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
