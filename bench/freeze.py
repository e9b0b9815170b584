"""Benchmark: `sluice manifest freeze` throughput against the raw work under it, interleaved.

Generates `--gib` GiB of jsonl shards in a temp folder (plus .jsonl.zst,
.jsonl.gz and parquet copies of the same documents), warms the page cache,
then measures, each case alternating with its own baseline in the same run
(`--repeat` rounds; the best of each side, and the median of the per-round
ratios):

| case | freeze | baseline |
| --- | --- | --- |
| jsonl count | `check="count"` | raw BLAKE3 of the same files |
| jsonl full | `check="full"` (default: every line checked) | raw BLAKE3 |
| jsonl.zst / .gz full | `check="full"` on the decoded lines, BLAKE3 of the stored bytes | raw decompression alone (zstandard / zlib, decoded bytes to nowhere) |
| parquet | metadata count | raw BLAKE3 |
| jsonl full, line path (`--line-path`) | `json.loads` line by line, threads: freeze as it was | raw BLAKE3 |

Baselines run on `--workers` threads (one file per thread; BLAKE3, zstandard
and zlib release the GIL), freeze on as many processes (`processes=`; the
jsonl checks hold the GIL) or threads for parquet. Throughput is stored bytes
per second. Targets (issue 9): uncompressed jsonl full >= 0.8x raw BLAKE3;
compressed >= 0.7x raw decompression.

    .venv/bin/python bench/freeze.py            # 0.25 GiB, a few minutes on 2 cores
    .venv/bin/python bench/freeze.py --gib 1    # the issue's full size
    .venv/bin/python bench/freeze.py --gib 1 --base DIR   # also main (DIR = `git archive main`), same rounds
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import blake3

SHARD_BYTES = 32 << 20
CHUNK = 8 << 20


def make_texts(rng: random.Random, n: int) -> list[str]:
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10))) for _ in range(4000)]
    words += ["def", "return", "self", "é", "naïve", "\n", "    ", "{", "}", "\"quoted\"", "\\"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(100, 900))) for _ in range(n)]


def generate(root: Path, gib: float, seed: int = 0) -> tuple[list[Path], int]:
    """jsonl shards of about SHARD_BYTES each, `gib` GiB in all; returns (paths, documents)."""
    rng = random.Random(seed)
    pool = make_texts(rng, 512)
    target = int(gib * (1 << 30))
    paths, total, doc = [], 0, 0
    (root / "jsonl").mkdir(parents=True)
    while total < target:
        path = root / "jsonl" / f"part-{len(paths):05d}.jsonl"
        parts, size = [], 0
        while size < min(SHARD_BYTES, target - total):
            line = json.dumps({"id": doc, "text": pool[rng.randrange(len(pool))], "src": "bench"}) + "\n"
            parts.append(line)
            size += len(line)
            doc += 1
        data = "".join(parts).encode()
        path.write_bytes(data)
        paths.append(path)
        total += len(data)
    return paths, doc


def derive(root: Path, paths: list[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """.jsonl.zst, .jsonl.gz and parquet copies of the same documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "zst").mkdir()
    (root / "gz").mkdir()
    (root / "parquet").mkdir()
    zcomp = zstandard.ZstdCompressor(level=3, threads=-1)
    zst, gz, par = [], [], []
    for p in paths:
        data = p.read_bytes()
        z = root / "zst" / (p.name + ".zst")
        z.write_bytes(zcomp.compress(data))
        zst.append(z)
        g = root / "gz" / (p.name + ".gz")
        g.write_bytes(gzip.compress(data, 6))
        gz.append(g)
        texts = [json.loads(line)["text"] for line in data.splitlines()]
        q = root / "parquet" / (p.stem + ".parquet")
        pq.write_table(pa.table({"text": texts}), q, compression="zstd")
        par.append(q)
    return zst, gz, par


def _per_file(paths: list[Path], threads: int, one: Callable[[Path], object]) -> float:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - t0


def _blake3_file(p: Path) -> str:
    h = blake3.blake3()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(p, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _unzstd_file(p: Path) -> int:
    import zstandard

    n = 0
    with open(p, "rb") as f:
        for piece in zstandard.ZstdDecompressor().read_to_iter(f, read_size=1 << 20, write_size=1 << 20):
            n += len(piece)
    return n


def _gunzip_file(p: Path) -> int:
    n = 0
    obj = zlib.decompressobj(wbits=31)
    with open(p, "rb") as f:
        while data := f.read(CHUNK):
            while data:
                out = obj.decompress(data, CHUNK)
                n += len(out)
                data = obj.unconsumed_tail
    return n


def raw_blake3(paths: list[Path], threads: int) -> float:
    """Seconds to BLAKE3 every file (8 MiB reads, one file per thread)."""
    return _per_file(paths, threads, _blake3_file)


def raw_decompress(paths: list[Path], threads: int, compression: str) -> float:
    """Seconds to decompress every file to nowhere (one file per thread)."""
    return _per_file(paths, threads, _unzstd_file if compression == "zstd" else _gunzip_file)


_TIMED = """
import json, sys, time
from sluice.manifest.freeze import freeze
spec, out, threads, processes, check = sys.argv[1:]
t0 = time.perf_counter()
m = freeze(spec, out, threads=int(threads), processes=int(processes), progress=False, check=check)
print(json.dumps([time.perf_counter() - t0, m.dataset_id]))
"""


def run_freeze(root: Path, name: str, folder: str, fmt: str, check: str, threads: int,
               processes: int | None, tree: Path | None = None) -> tuple[float, str]:
    """Seconds of one freeze() call and its dataset ID; with `tree`, in a fresh interpreter
    importing sluice from that source tree (only the freeze() call is timed)."""
    spec = root / f"{name}.toml"
    spec.write_text(f'name = "{name}"\n[packing]\nseq_len = 2048\n'
                    f'[[sources]]\nname = "s"\npaths = ["{folder}"]\nformat = "{fmt}"\n')
    out = root / f"{name}.manifest.json"
    if tree is not None:
        env = dict(os.environ, PYTHONPATH=str(tree))
        res = subprocess.run([sys.executable, "-c", _TIMED, str(spec), str(out), str(threads), str(processes or 0),
                              check], env=env, cwd=root, capture_output=True, text=True, check=True)
        took, dsid = json.loads(res.stdout.strip().splitlines()[-1])
        return took, dsid
    from sluice.manifest.freeze import freeze

    t0 = time.perf_counter()
    m = freeze(spec, out, threads=threads, processes=processes, progress=False, check=check)
    return time.perf_counter() - t0, m.dataset_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25, help="GiB of uncompressed jsonl to generate (default 0.25)")
    ap.add_argument("--workers", "--threads", type=int, default=None,
                    help="baseline threads and freeze processes (default: the CPUs of this process)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds per case (default 3)")
    ap.add_argument("--line-path", action="store_true",
                    help="also time the line path (json.loads per line on threads: freeze before msgspec)")
    ap.add_argument("--base", default=None,
                    help="a source tree (e.g. `git archive main` unpacked) whose freeze is timed in the same "
                         "rounds; both sides then run in fresh interpreters (only the freeze() call is timed)")
    ap.add_argument("--tmp", default=None, help="folder for the generated corpus (default: system temp)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "freeze.json"))
    args = ap.parse_args(argv)
    from sluice.manifest.scan_pool import node_cpus

    workers = args.workers or node_cpus()
    base_tree = Path(args.base).resolve() if args.base else None
    here = Path(__file__).resolve().parent.parent
    root = Path(tempfile.mkdtemp(prefix="sluice-bench-freeze-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        paths, docs = generate(root, args.gib)
        zst, gz, par = derive(root, paths)
        gen_s = time.perf_counter() - t0
        sizes = {k: sum(p.stat().st_size for p in v)
                 for k, v in (("jsonl", paths), ("zst", zst), ("gz", gz), ("parquet", par))}
        raw_blake3(paths + zst + gz + par, workers)  # warm the page cache
        rows = []

        def measure(label: str, files: list[Path], folder: str, fmt: str, check: str, baseline: str,
                    line_path: bool = False) -> None:
            from sluice.manifest import jsonl

            ids = set()
            bases, frs, olds = [], [], []
            gil_bound = fmt == "jsonl" and (check == "full" or baseline != "blake3")
            processes = workers if gil_bound and workers > 1 and not line_path else 0
            decoder = jsonl._DECODER
            for _ in range(args.repeat):  # interleaved, so both see the same machine load
                if baseline == "blake3":
                    bases.append(raw_blake3(files, workers))
                else:
                    bases.append(raw_decompress(files, workers, baseline))
                if line_path:  # freeze as it was: json.loads line by line, objects on threads
                    jsonl._DECODER = None
                try:
                    s, dsid = run_freeze(root, f"b-{folder}-{check}", folder, fmt, check, workers, processes,
                                         None if line_path or base_tree is None else here)
                finally:
                    jsonl._DECODER = decoder
                frs.append(s)
                ids.add(dsid)
                if base_tree is not None and not line_path:
                    s, dsid = run_freeze(root, f"b-{folder}-{check}", folder, fmt, check, workers, processes,
                                         base_tree)  # same spec: `deterministic` then also says same bytes as base
                    olds.append(s)
                    ids.add(dsid)
            base, fr = min(bases), min(frs)
            size = sum(p.stat().st_size for p in files)
            rows.append({
                "case": label, "baseline": baseline, "bytes": size, "objects": len(files),
                "processes": processes, "baseline_gbps": round(size / base / 1e9, 3),
                "freeze_gbps": round(size / fr / 1e9, 3), "ratio": round(base / fr, 3),
                "ratio_median_of_rounds": round(statistics.median(b / f for b, f in zip(bases, frs)), 3),
                "deterministic": len(ids) == 1,
            })
            if olds:
                rows[-1].update({"base_freeze_gbps": round(size / min(olds) / 1e9, 3),
                                 "base_ratio": round(base / min(olds), 3),
                                 "base_ratio_median_of_rounds": round(
                                     statistics.median(b / f for b, f in zip(bases, olds)), 3)})

        measure("jsonl check=count", paths, "jsonl", "jsonl", "count", "blake3")
        measure("jsonl check=full", paths, "jsonl", "jsonl", "full", "blake3")
        if args.line_path:
            measure("jsonl full, line path", paths, "jsonl", "jsonl", "full", "blake3", line_path=True)
        measure("jsonl.zst check=full", zst, "zst", "jsonl", "full", "zstd")
        measure("jsonl.gz check=full", gz, "gz", "jsonl", "full", "gzip")
        measure("parquet", par, "parquet", "parquet", "full", "blake3")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"freeze benchmark: {args.gib} GiB jsonl ({docs} documents), workers={workers}, "
          f"cpus={os.cpu_count()}, corpus generated in {gen_s:.1f}s; best of {args.repeat} interleaved rounds")
    print(f"{'case':<22} {'MiB':>8} {'objs':>5} {'baseline':>9} {'base GB/s':>10} {'freeze GB/s':>12} "
          f"{'ratio':>7} {'median':>7}")
    for r in rows:
        print(f"{r['case']:<22} {r['bytes'] / 2**20:>8.1f} {r['objects']:>5} {r['baseline']:>9} "
              f"{r['baseline_gbps']:>10.3f} {r['freeze_gbps']:>12.3f} {r['ratio']:>7.3f} "
              f"{r['ratio_median_of_rounds']:>7.3f}"
              + (f"   base: {r['base_freeze_gbps']:.3f} GB/s, ratio {r['base_ratio']:.3f}, median "
                 f"{r['base_ratio_median_of_rounds']:.3f}" if "base_ratio" in r else ""))
    by = {r["case"]: r for r in rows}
    result = {
        "bench": "freeze", "gib": args.gib, "workers": workers, "cpus": os.cpu_count(), "documents": docs,
        "sizes": sizes, "rows": rows,
        "targets": {"jsonl full >= 0.8x raw BLAKE3": by["jsonl check=full"]["ratio"] >= 0.8,
                    "jsonl.zst full >= 0.7x raw zstd decompression": by["jsonl.zst check=full"]["ratio"] >= 0.7,
                    "jsonl.gz full >= 0.7x raw gzip decompression": by["jsonl.gz check=full"]["ratio"] >= 0.7},
    }
    line = json.dumps(result, sort_keys=True)
    print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
