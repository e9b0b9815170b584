"""Benchmark: `sluice manifest freeze` throughput against raw BLAKE3 over the same files.

Generates `--gib` GiB of jsonl shards in a temp folder (plus .jsonl.zst and
parquet copies of the same documents), warms the page cache, then measures in
the same run:

* raw BLAKE3 of every file (read in 8 MiB chunks, same thread count as freeze);
* freeze of uncompressed jsonl with `check="full"` (the default: every line
  parsed) and `check="count"` (newline count only; hashing and counting share
  one pass over the bytes);
* freeze of the .jsonl.zst and parquet copies (default check).

Throughput is stored bytes per second; ratios are freeze / raw BLAKE3 over the
same files. Target from the issue: uncompressed jsonl freeze >= 0.8x raw.

    .venv/bin/python bench/freeze.py            # 0.25 GiB, about a minute
    .venv/bin/python bench/freeze.py --gib 1    # the issue's full size
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import sys
import tempfile
import time
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


def derive(root: Path, paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """.jsonl.zst and parquet copies of the same documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "zst").mkdir()
    (root / "parquet").mkdir()
    zcomp = zstandard.ZstdCompressor(level=3, threads=-1)
    zst, par = [], []
    for p in paths:
        data = p.read_bytes()
        z = root / "zst" / (p.name + ".zst")
        z.write_bytes(zcomp.compress(data))
        zst.append(z)
        texts = [json.loads(line)["text"] for line in data.splitlines()]
        q = root / "parquet" / (p.stem + ".parquet")
        pq.write_table(pa.table({"text": texts}), q, compression="zstd")
        par.append(q)
    return zst, par


def raw_blake3(paths: list[Path], threads: int) -> float:
    """Seconds to BLAKE3 every file (8 MiB reads, one file per thread)."""

    def one(p: Path) -> str:
        h = blake3.blake3()
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
        return h.hexdigest()

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - t0


def run_freeze(root: Path, name: str, folder: str, fmt: str, check: str, threads: int) -> tuple[float, str]:
    from sluice.manifest.freeze import freeze

    spec = root / f"{name}.toml"
    spec.write_text(f'name = "{name}"\n[packing]\nseq_len = 2048\n'
                    f'[[sources]]\nname = "s"\npaths = ["{folder}"]\nformat = "{fmt}"\n')
    t0 = time.perf_counter()
    m = freeze(spec, root / f"{name}.manifest.json", threads=threads, progress=False, check=check)
    return time.perf_counter() - t0, m.dataset_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25, help="GiB of uncompressed jsonl to generate (default 0.25)")
    ap.add_argument("--threads", type=int, default=None, help="threads for freeze and raw BLAKE3 (default freeze's)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per measurement; the best of each is kept")
    ap.add_argument("--tmp", default=None, help="folder for the generated corpus (default: system temp)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "freeze.json"))
    args = ap.parse_args(argv)
    threads = args.threads or min(8, max(2, os.cpu_count() or 1))
    root = Path(tempfile.mkdtemp(prefix="sluice-bench-freeze-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        paths, docs = generate(root, args.gib)
        zst, par = derive(root, paths)
        gen_s = time.perf_counter() - t0
        sizes = {k: sum(p.stat().st_size for p in v) for k, v in (("jsonl", paths), ("zst", zst), ("parquet", par))}
        raw_blake3(paths + zst + par, threads)  # warm the page cache
        rows = []

        def measure(label: str, files: list[Path], folder: str, fmt: str, check: str) -> None:
            ids = set()
            raws, frs = [], []
            for _ in range(args.repeat):  # interleaved, so both see the same machine load
                raws.append(raw_blake3(files, threads))
                s, dsid = run_freeze(root, f"b-{folder}-{check}", folder, fmt, check, threads)
                frs.append(s)
                ids.add(dsid)
            raw, fr = min(raws), min(frs)
            size = sum(p.stat().st_size for p in files)
            rows.append({
                "case": label, "bytes": size, "objects": len(files),
                "raw_blake3_gbps": round(size / raw / 1e9, 3), "freeze_gbps": round(size / fr / 1e9, 3),
                "ratio": round(raw / fr, 3), "deterministic": len(ids) == 1,
            })

        measure("jsonl check=count", paths, "jsonl", "jsonl", "count")
        measure("jsonl check=full (default)", paths, "jsonl", "jsonl", "full")
        measure("jsonl.zst check=full", zst, "zst", "jsonl", "full")
        measure("parquet", par, "parquet", "parquet", "full")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"freeze benchmark: {args.gib} GiB jsonl ({docs} documents), threads={threads}, "
          f"cpus={os.cpu_count()}, corpus generated in {gen_s:.1f}s")
    print(f"{'case':<28} {'MiB':>8} {'objs':>5} {'raw b3 GB/s':>12} {'freeze GB/s':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['case']:<28} {r['bytes'] / 2**20:>8.1f} {r['objects']:>5} {r['raw_blake3_gbps']:>12.3f} "
              f"{r['freeze_gbps']:>12.3f} {r['ratio']:>7.3f}")
    target = next(r for r in rows if r["case"].startswith("jsonl check=count"))
    default = next(r for r in rows if "default" in r["case"])
    result = {
        "bench": "freeze", "gib": args.gib, "threads": threads, "cpus": os.cpu_count(), "documents": docs,
        "sizes": sizes, "rows": rows,
        "target": "uncompressed jsonl freeze >= 0.8x raw BLAKE3",
        "ratio_count": target["ratio"], "ratio_full_default": default["ratio"],
        "target_met_count": target["ratio"] >= 0.8, "target_met_full_default": default["ratio"] >= 0.8,
    }
    line = json.dumps(result, sort_keys=True)
    print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
