"""Benchmark: sluice's Encoder against raw `tokenizers`, and pretokenize with 1 vs 2 workers.

Corpus: the Python standard library's own sources (no download), cut into
documents of 60 lines (as `sluice.demo` does).

1. Encoding, same texts, same process, same Rust thread pool, interleaved
   repetitions (best of N):
   * baseline: raw ``tokenizers.Tokenizer.encode_batch(texts, add_special_tokens=False)``
     (the issue's baseline: returns Encoding objects, no ids extracted);
   * strict baseline: raw ``encode_batch_fast`` plus ``[e.ids for e in ...]``;
   * sluice: ``Encoder.encode_batch(texts)`` -> list of uint32 numpy arrays.
   Target: sluice / baseline >= 0.85 (ratio of throughputs).
2. ``pretokenize`` of a frozen manifest (jsonl.zst code + parquet docstrings)
   with 1 and 2 worker processes: tokens per second, the ratio, and a check
   that both runs give the same derived dataset ID.

Prints a table, one JSON line, and writes bench/out/tokenize.json.
Run: ``.venv/bin/python bench/tokenize.py`` (about a minute) or ``--full``.
"""

from __future__ import annotations

import sys

# Run as a script, this file's folder is sys.path[0], where this very file
# would shadow the standard library's `tokenize` (imported by linecache,
# inspect, tracebacks). Drop that folder before anything else is imported.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `sluice` importable without installing


def _documents(files: int) -> list[str]:
    from sluice.demo import stdlib_files

    docs = []
    for path in stdlib_files(files):
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        docs.extend("".join(lines[i : i + 60]) for i in range(0, len(lines), 60))
    return docs


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_encode(tok_path: Path, texts: list[str], reps: int) -> dict:
    from tokenizers import Tokenizer

    from sluice.tokenize import current_threads, load_tokenizer

    enc = load_tokenizer(tok_path)
    raw = Tokenizer.from_file(str(tok_path))
    chars = sum(len(t) for t in texts)
    tokens = sum(len(a) for a in enc.encode_batch(texts))  # also warms the pool
    raw.encode_batch(texts[:64], add_special_tokens=False)
    times = {"raw_encode_batch": float("inf"), "raw_encode_batch_fast_ids": float("inf"), "sluice_encode_batch": float("inf")}
    fns = {
        "raw_encode_batch": lambda: raw.encode_batch(texts, add_special_tokens=False),
        "raw_encode_batch_fast_ids": lambda: [e.ids for e in raw.encode_batch_fast(texts, add_special_tokens=False)],
        "sluice_encode_batch": lambda: enc.encode_batch(texts),
    }
    for _ in range(reps):  # interleaved, so machine noise hits all three alike
        for name, fn in fns.items():
            times[name] = min(times[name], _best(fn, 1))
    return {
        "threads": current_threads(),
        "documents": len(texts),
        "chars": chars,
        "tokens": tokens,
        "seconds": times,
        "tokens_per_s": {k: tokens / v for k, v in times.items()},
        "ratio_vs_raw_encode_batch": times["raw_encode_batch"] / times["sluice_encode_batch"],
        "ratio_vs_raw_encode_batch_fast_ids": times["raw_encode_batch_fast_ids"] / times["sluice_encode_batch"],
    }


def bench_pretokenize(work: Path, files: int) -> dict:
    from sluice.demo import DATASET_SPEC, build_corpus
    from sluice.manifest.freeze import freeze
    from sluice.tokenize.pretokenize import pretokenize

    build_corpus(work, files=files, per_shard=200)
    (work / "dataset.toml").write_text(DATASET_SPEC)
    manifest = freeze(work / "dataset.toml", work / "manifest.json", progress=False)
    runs = {}
    for workers in (1, 2):
        result = pretokenize(manifest, work / f"derived-{workers}", workers=workers, progress=False)
        runs[workers] = result
    one, two = runs[1], runs[2]
    return {
        "objects": one.objects,
        "documents": one.documents,
        "tokens": one.tokens,
        "raw_bytes": one.raw_bytes,
        "seconds": {"workers_1": one.seconds, "workers_2": two.seconds},
        "tokens_per_s": {"workers_1": one.tokens / one.seconds, "workers_2": two.tokens / two.seconds},
        "speedup_2_vs_1": one.seconds / two.seconds,
        "same_dataset_id": one.dataset_id == two.dataset_id,
        "dataset_id": one.dataset_id,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="whole stdlib top level, more repetitions")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "tokenize.json"))
    args = parser.parse_args(argv)
    enc_files, reps, pre_files, vocab = (400, 7, 400, 8192) if args.full else (120, 5, 120, 4096)

    from sluice.demo import stdlib_files
    from sluice.tokenize.train import train_bpe

    with tempfile.TemporaryDirectory(prefix="sluice-bench-tok-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        trained = train_bpe([str(p) for p in stdlib_files(80)], work / "tokenizer.json", vocab_size=vocab)
        train_s = time.perf_counter() - t0
        texts = _documents(enc_files)
        encode = bench_encode(work / "tokenizer.json", texts, reps)
        pre = bench_pretokenize(work, pre_files)

    result = {
        "bench": "tokenize",
        "size": "full" if args.full else "default",
        "tokenizer": {"vocab_size": trained.vocab_size, "train_seconds": train_s, "train_files": trained.files},
        "encode": encode,
        "pretokenize": pre,
        "target_ratio": 0.85,
        "meets_target": encode["ratio_vs_raw_encode_batch"] >= 0.85,
    }
    rows = [
        ("encode: raw tokenizers encode_batch", f"{encode['tokens_per_s']['raw_encode_batch']:,.0f} tok/s", "1.00x (baseline)"),
        ("encode: raw encode_batch_fast + .ids", f"{encode['tokens_per_s']['raw_encode_batch_fast_ids']:,.0f} tok/s",
         f"{encode['tokens_per_s']['raw_encode_batch_fast_ids'] / encode['tokens_per_s']['raw_encode_batch']:.2f}x"),
        ("encode: sluice Encoder.encode_batch (uint32 arrays)", f"{encode['tokens_per_s']['sluice_encode_batch']:,.0f} tok/s",
         f"{encode['ratio_vs_raw_encode_batch']:.2f}x (target >= 0.85; {encode['ratio_vs_raw_encode_batch_fast_ids']:.2f}x of fast+ids)"),
        ("pretokenize: 1 worker process", f"{pre['tokens_per_s']['workers_1']:,.0f} tok/s", "1.00x"),
        ("pretokenize: 2 worker processes", f"{pre['tokens_per_s']['workers_2']:,.0f} tok/s",
         f"{pre['speedup_2_vs_1']:.2f}x (same dataset ID: {pre['same_dataset_id']})"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"corpus: {encode['documents']} docs, {encode['tokens']:,} tokens; Rust threads {encode['threads']}; "
          f"pretokenize {pre['objects']} objects, {pre['tokens']:,} tokens on {pre['cpus']} CPUs")
    for name, rate, ratio in rows:
        print(f"{name:<{width}}  {rate:>18}  {ratio}")
    line = json.dumps(result, sort_keys=True)
    print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
