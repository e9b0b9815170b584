"""Benchmark: sluice's Encoder against raw `tokenizers`, and pretokenize with 1 vs 2 workers.

Corpus: the Python standard library's own sources (no download), cut into
documents of 60 lines (as `sluice.demo` does).

1. Encoding, same texts, same process, interleaved repetitions (best of N):
   * baseline: raw ``tokenizers.Tokenizer.encode_batch(texts, add_special_tokens=False)``
     (returns Encoding objects; no ids extracted);
   * raw ``encode_batch`` + ``.ids`` and raw ``encode_batch_fast`` + ``.ids``;
   * sluice: ``Encoder.encode_batch(texts)`` -> list of uint32 numpy arrays.
   Measured twice: with one Rust thread as CPU time of the calling thread
   (``time.thread_time``; robust when other work shares the machine; this is
   the headline ratio), and with the Rust pool as wall time.
   Ratios are medians over rounds of paired (back-to-back) ratios, which
   cancel slow swings of a shared machine's load; tok/s are best rounds.
   Target: sluice / baseline >= 0.85 (ratio of throughputs).
   Also the ``tiktoken`` backend (sluice.tokenize.fast, built from the same
   tokenizer.json): ids asserted equal to ``tokenizers``' before timing.
2. ``pretokenize`` of a frozen manifest (jsonl.zst code + parquet docstrings)
   with 1 and 2 worker processes: tokens per second, the ratio, and a check
   that both runs give the same derived dataset ID.

3. Time to the first document of a generated jsonl object (10 MB vs 100 MB;
   ``--full``: 300 MB) through loaderd's DocSource with no tokens cached, each
   in a fresh process (killed once it has its document): with the raw object
   already in the node cache, and cold (the cache fill copies and hashes it
   first). Chunked tokenization makes the first figure flat in object size.

4. ``--backends`` (only this part): tokens/s of every tokenizer backend
   (``hf``, ``tiktoken``, ``fastokens``, ``tokie``) on the same texts, one
   thread (CPU time of the calling thread), rounds interleaved, for a GPT-2
   style and a llama-3 style BPE trained here, on 60-line chunks and on whole
   stdlib files; each backend's ids checked equal to ``hf``'s first, a refused
   backend listed with its reason. Writes bench/out/tokenize_backends.json.

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
import statistics  # noqa: E402
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


def _interleaved(fns: dict, reps: int, clock) -> dict[str, list[float]]:
    """Times of each function in each of `reps` rounds, the functions interleaved within a round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def _paired_ratio(times: dict[str, list[float]], base: str, other: str) -> float:
    """Median over rounds of base/other, timed back to back: slow swings of a shared machine's load cancel."""
    return statistics.median(b / o for b, o in zip(times[base], times[other]))


def bench_encode(tok_path: Path, texts: list[str], reps: int) -> dict:
    """Serial CPU time (robust on a shared machine) and parallel wall time, same texts, same process."""
    from tokenizers import Tokenizer

    from sluice.tokenize import available_cpus, configure_threads, current_threads, load_tokenizer

    enc = load_tokenizer(tok_path)
    fast = load_tokenizer(tok_path, backend="tiktoken")
    raw = Tokenizer.from_file(str(tok_path))
    same = all(a.tolist() == b.tolist() for a, b in zip(enc.encode_batch(texts), fast.encode_batch(texts)))
    assert same, "tiktoken backend ids differ from tokenizers' on the bench corpus"
    chars = sum(len(t) for t in texts)
    fns = {
        "raw_encode_batch": lambda: raw.encode_batch(texts, add_special_tokens=False),
        "raw_encode_batch_ids": lambda: [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)],
        "raw_encode_batch_fast_ids": lambda: [e.ids for e in raw.encode_batch_fast(texts, add_special_tokens=False)],
        "sluice_encode_batch": lambda: enc.encode_batch(texts),
        "sluice_tiktoken_encode_batch": lambda: fast.encode_batch(texts),
    }
    out: dict = {"documents": len(texts), "chars": chars}
    # 1. One Rust thread: the batch runs in this thread, so its CPU time
    #    (thread_time) measures the work itself, not the neighbours' load.
    configure_threads(1)
    tokens = sum(len(a) for a in enc.encode_batch(texts))
    out["tokens"] = tokens
    serial = _interleaved(fns, reps, time.thread_time)
    # 2. The Rust pool (created now, by the first parallel batch): wall time.
    configure_threads(max(2, available_cpus()))
    enc.encode_batch(texts[:64])
    parallel = _interleaved(fns, max(3, reps // 3), time.perf_counter)
    for label, times in (("serial_cpu", serial), ("parallel_wall", parallel)):
        best = {k: min(v) for k, v in times.items()}
        out[label] = {
            "threads": 1 if label == "serial_cpu" else current_threads(),
            "rounds": len(times["raw_encode_batch"]),
            "best_seconds": best,
            "tokens_per_s": {k: tokens / v for k, v in best.items()},
            # Throughput of each relative to raw encode_batch, as the median of
            # paired (same round) ratios: the headline numbers.
            "ratio_vs_raw_encode_batch": {k: _paired_ratio(times, "raw_encode_batch", k) for k in times},
        }
    return out


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


_FIRST_DOC = r"""
import json, os, sys, time
from pathlib import Path
import blake3
from sluice.cache import NodeCache
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import Manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source
from sluice.tokenize import load_tokenizer
path, tok, cache_dir, records = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
enc = load_tokenizer(tok)
h = blake3.blake3(max_threads=blake3.blake3.AUTO)
h.update_mmap(str(path))
obj = ObjectRecord(location=str(path), digest="b3:" + h.hexdigest(), size=path.stat().st_size, records=records, start=0)
src = Source(name="gen", format="jsonl", text_field="text", weight="1", exhaustion="stop", paths=(str(path),), objects=(obj,))
m = Manifest(name="first-doc", tokenizer=TokenizerRef(location=tok, digest=enc.digest, version=enc.version,
             vocab_size=enc.vocab_size), packing=PackingPolicy(seq_len=64, eos_id=0), mixture=MixturePolicy(), sources=(src,))
cache = NodeCache(cache_dir, 1 << 40, durable=False)
if sys.argv[5] == "raw-cached":
    cache.fetch(obj, str(path)).close()
docs = DocSource(m, cache, enc, workers=1)
ref = type("Ref", (), {"source": 0, "obj": 0, "record": 0})()
t0 = time.perf_counter()
n = docs(ref).size
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": int(n)}), flush=True)
os._exit(0)  # the worker would go on tokenizing the whole object
"""


def bench_first_doc(work: Path, tok_path: Path, texts: list[str], sizes_mb: tuple[int, ...]) -> dict:
    """Seconds from asking to having document 0 of a fresh object, per object size (see the docstring)."""
    import subprocess

    line = "".join(json.dumps({"text": t}) + "\n" for t in texts[:200]).encode()
    out: dict = {}
    for mb in sizes_mb:
        path = work / f"gen-{mb}mb.jsonl"
        reps = max(1, (mb << 20) // len(line))
        with open(path, "wb") as f:
            for _ in range(reps):
                f.write(line)
        records = reps * min(200, len(texts))
        for mode in ("raw-cached", "cold"):
            cache = work / f"cache-{mb}-{mode}"
            proc = subprocess.run([sys.executable, "-c", _FIRST_DOC, str(path), str(tok_path), str(cache),
                                   str(records), mode], capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "PYTHONPATH": str(_REPO)})
            if proc.returncode != 0:
                raise SystemExit(f"first-doc run failed: {proc.stderr[-2000:]}")
            out[f"{mb}MB_{mode}"] = json.loads(proc.stdout)["seconds"]
        path.unlink()
    return out


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_tokenizer(files: list[Path], out: Path, vocab: int) -> Path:
    """A llama-3 style tokenizer (Split regex + byte-level BPE), trained here on `files`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer=trainer)
    tok.save(str(out))
    return out


def bench_backends(tokenizers: dict[str, Path], corpora: dict[str, list[str]], reps: int) -> dict:
    """Tokens per second of each backend on the same texts, one thread, CPU time of the calling thread.

    Every backend's ids are checked equal to `tokenizers`' first (a backend that
    differs is reported, never timed); a backend that refuses the tokenizer is
    listed with its reason. Interleaved rounds, each on another slice of the
    corpus (no backend sees a text twice while timed); tok/s over all rounds and
    the median paired ratio to `hf`. Two call shapes: the whole corpus in one
    `encode_batch` (pretokenize, cache fills) and one document per call (the
    demand path's small batches).
    """
    from sluice.errors import TokenizerError
    from sluice.tokenize import configure_threads, load_tokenizer

    configure_threads(1)  # every backend encodes in this thread: thread_time is its CPU time
    out: dict = {}
    for family, path in tokenizers.items():
        for corpus, texts in corpora.items():
            encs, refused = {}, {}
            for backend in ("hf", "tiktoken", "fastokens", "tokie"):
                t0 = time.perf_counter()
                try:
                    encs[backend] = load_tokenizer(path, backend=backend)
                except TokenizerError as exc:
                    refused[backend] = str(exc).split(": ", 1)[-1][:160]
                    continue
                refused.pop(backend, None)
                load_s = time.perf_counter() - t0
                if backend != "hf":
                    got = encs[backend].encode_batch(texts)
                    want = encs["hf"].encode_batch(texts)
                    differ = sum(a.tolist() != b.tolist() for a, b in zip(want, got))
                    if differ:
                        refused[backend] = f"ids differ on {differ} of {len(texts)} documents"
                        del encs[backend]
                        continue
                out.setdefault(f"{family}/{corpus}", {}).setdefault("load_seconds", {})[backend] = round(load_s, 3)
            # Each round encodes another slice of the corpus (every backend the same slice) with encoders
            # that have seen no text: fastokens keeps a cache of the pieces it encoded (per instance: on the
            # same texts again it ran 2.5x faster), so these are its cold figures; a daemon's long-lived
            # encoder runs warmer. Rates: all slices' tokens over all slices' time.
            slices = [texts[r::reps] for r in range(reps)]
            counts = [sum(a.size for a in encs["hf"].encode_batch(part)) for part in slices]
            times: dict[str, list[float]] = {}
            for part in slices:
                # A fresh encoder per call shape and round: fastokens' piece cache lives in its instance, and
                # one that has seen the corpus (the check above) would be measured warm.
                fresh = {(b, c): load_tokenizer(path, backend=b) for b in encs for c in ("batch", "one")}
                fns = {f"{b}/batch": (lambda e=fresh[b, "batch"]: e.encode_batch(part)) for b in encs}
                fns.update({f"{b}/one": (lambda e=fresh[b, "one"]: [e.encode_batch([t]) for t in part]) for b in encs})
                for k, v in _interleaved(fns, 1, time.thread_time).items():
                    times.setdefault(k, []).extend(v)
            entry = out.setdefault(f"{family}/{corpus}", {})
            entry.update({
                "documents": len(texts), "bytes": sum(len(t.encode()) for t in texts), "tokens": sum(counts),
                "rounds": reps, "refused": refused,
                "tokens_per_s": {k: sum(counts) / sum(v) for k, v in times.items()},
                "ratio_vs_hf": {k: _paired_ratio(times, "hf/" + k.split("/")[1], k) for k in times},
            })
    return out


def _print_backends(result: dict) -> None:
    rows = [("tokenizer / corpus", "call", "backend", "tok/s (1 thread)", "x hf")]
    for where, entry in result.items():
        for key, rate in sorted(entry["tokens_per_s"].items(), key=lambda kv: (kv[0].split("/")[1], -kv[1])):
            backend, call = key.split("/")
            rows.append((where, call, backend, f"{rate:,.0f}", f"{entry['ratio_vs_hf'][key]:.2f}x"))
        for backend, why in entry["refused"].items():
            rows.append((where, "-", backend, "refused", why[:90]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="whole stdlib top level, more repetitions")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "tokenize.json"))
    parser.add_argument("--first-doc-only", action="store_true", help="only part 3 (time to the first document)")
    parser.add_argument("--backends", action="store_true",
                        help="only part 4: tokens/s of every tokenizer backend, same texts, interleaved "
                             "(writes bench/out/tokenize_backends.json)")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 15; --backends 5)")
    args = parser.parse_args(argv)
    enc_files, reps, pre_files, vocab = (400, 15, 400, 8192) if args.full else (60, 15, 120, 4096)
    reps = args.reps or reps

    from sluice.demo import stdlib_files
    from sluice.tokenize.train import train_bpe

    if args.backends:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-tok-") as tmp:
            files = stdlib_files(80)
            train_bpe([str(p) for p in files], Path(tmp) / "gpt2.json", vocab_size=vocab)
            _llama3_tokenizer(files, Path(tmp) / "llama3.json", vocab)
            whole = [p.read_text(encoding="utf-8") for p in stdlib_files(enc_files)]
            corpora = {"60-line chunks": _documents(enc_files), "whole files": whole}
            result = bench_backends({"gpt2-style BPE": Path(tmp) / "gpt2.json",
                                     "llama3-style BPE": Path(tmp) / "llama3.json"}, corpora, args.reps or 5)
        _print_backends(result)
        line = json.dumps({"bench": "tokenize-backends", "vocab_size": vocab, "results": result}, sort_keys=True)
        print(line)
        out = Path(args.out).with_name("tokenize_backends.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
        return 0
    if args.first_doc_only:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-tok-") as tmp:
            trained = train_bpe([str(p) for p in stdlib_files(80)], Path(tmp) / "tokenizer.json", vocab_size=vocab)
            first = bench_first_doc(Path(tmp), Path(tmp) / "tokenizer.json", _documents(enc_files),
                                    (10, 300) if args.full else (10, 100))
        print(json.dumps({"bench": "tokenize-first-doc", "first_document_seconds": first}, sort_keys=True))
        return 0
    with tempfile.TemporaryDirectory(prefix="sluice-bench-tok-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        trained = train_bpe([str(p) for p in stdlib_files(80)], work / "tokenizer.json", vocab_size=vocab)
        train_s = time.perf_counter() - t0
        texts = _documents(enc_files)
        encode = bench_encode(work / "tokenizer.json", texts, reps)
        pre = bench_pretokenize(work, pre_files)
        first = bench_first_doc(work, work / "tokenizer.json", texts, (10, 300) if args.full else (10, 100))

    ser, par = encode["serial_cpu"], encode["parallel_wall"]
    result = {
        "bench": "tokenize",
        "size": "full" if args.full else "default",
        "tokenizer": {"vocab_size": trained.vocab_size, "train_seconds": train_s, "train_files": trained.files},
        "encode": encode,
        "pretokenize": pre,
        "first_document_seconds": first,
        "tiktoken_vs_encode_batch_fast": ser["ratio_vs_raw_encode_batch"]["sluice_tiktoken_encode_batch"]
        / ser["ratio_vs_raw_encode_batch"]["raw_encode_batch_fast_ids"],
        "target_ratio": 0.85,
        "ratio": ser["ratio_vs_raw_encode_batch"]["sluice_encode_batch"],
        "ratio_parallel": par["ratio_vs_raw_encode_batch"]["sluice_encode_batch"],
        "meets_target": ser["ratio_vs_raw_encode_batch"]["sluice_encode_batch"] >= 0.85,
    }
    rows = []
    for label, part in (("1 thread, CPU time", ser), (f"{par['threads']} threads, wall time", par)):
        for key, name in (
            ("raw_encode_batch", "raw encode_batch (baseline)"),
            ("raw_encode_batch_ids", "raw encode_batch + .ids"),
            ("raw_encode_batch_fast_ids", "raw encode_batch_fast + .ids"),
            ("sluice_encode_batch", "sluice Encoder.encode_batch -> uint32 arrays"),
            ("sluice_tiktoken_encode_batch", "sluice tiktoken backend -> uint32 arrays (same ids)"),
        ):
            rate = part["tokens_per_s"][key]
            ratio = part["ratio_vs_raw_encode_batch"][key]
            rows.append((f"encode, {label}: {name}", f"{rate:,.0f} tok/s", f"{ratio:.2f}x"))
    rows += [
        ("pretokenize: 1 worker process", f"{pre['tokens_per_s']['workers_1']:,.0f} tok/s", "1.00x"),
        ("pretokenize: 2 worker processes", f"{pre['tokens_per_s']['workers_2']:,.0f} tok/s",
         f"{pre['speedup_2_vs_1']:.2f}x (same dataset ID: {pre['same_dataset_id']})"),
    ]
    rows += [(f"first document of a {k.split('_')[0]} object, {k.split('_', 1)[1]}", f"{v:.2f} s", "")
             for k, v in first.items()]
    width = max(len(r[0]) for r in rows)
    print(f"corpus: {encode['documents']} docs, {encode['tokens']:,} tokens; "
          f"pretokenize {pre['objects']} objects, {pre['tokens']:,} tokens on {pre['cpus']} CPUs")
    print("(tok/s: best round; ratio: median over rounds of the paired ratio to raw encode_batch)")
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
