"""Benchmark: every place tokens are made, with the `hf` backend and with faster ones, end to end.

Corpus: whole standard-library sources as one jsonl object (`--mb` MiB, 20 by
default; no download: the files are read again, each with a copy marker, where
this machine's stdlib is smaller than asked), a 8192-token byte-level BPE
trained on 80 of them. Frozen once per backend (`--backends`, default
`hf,fastokens`; `hf` is the reference and always runs first; `auto` records the
backend freeze proved fastest, named in the table), each freeze proving its
backend on its sample. Then, each command a fresh process, backends
interleaved, the parts chosen with `--parts`:

* `pretokenize`: `sluice tokenize pretokenize --workers N`;
* `warm`: `sluice cache warm --tokens --token-workers N` (raw object already cached);
* `onfly`: a real loaderd, cold node cache, `--steps` steps of 8 x 2048
  tokens to one client, from daemon start to the last batch;
* `check`: `sluice tokenize check --backend B` on the hf manifest (every non-hf
  backend but auto).

The token arrays `pretokenize` wrote and those `cache warm --tokens` kept are
compared byte for byte, document by document, with hf's (`same_token_arrays`:
per backend and part; a difference names the first document).

Prints a table (best round; ratio to hf) and one JSON line; writes
bench/out/backends_e2e.json (`--out`). Run:
``.venv/bin/python bench/backends_e2e.py [--rounds 2] [--steps 150]`` (about a
minute on a 2-core machine). Issue 24's 200 MB line:
``bench/backends_e2e.py --mb 200 --rounds 1 --parts pretokenize,warm --backends hf,fastokens,auto``.
Not a test: figures move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # loaderd_support.Daemon: a real loaderd child process

BACKENDS = ("hf", "fastokens")
PARTS = ("pretokenize", "warm", "onfly", "check")


def _corpus(work: Path, size: int, backends: tuple[str, ...]) -> None:
    from sluice.demo import stdlib_files
    from sluice.tokenize.train import train_bpe

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    written, copy = 0, 0
    with open(work / "code.jsonl", "w") as out:
        while written < size:
            before = written
            for f in files:
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                # A second pass marks its copies, so no document repeats byte for byte.
                line = json.dumps({"text": text if copy == 0 else f"# copy {copy}\n{text}"}) + "\n"
                out.write(line)
                written += len(line)
                if written >= size:
                    break
            if written == before:
                raise SystemExit("bench/backends_e2e.py: no readable .py file in this Python's stdlib")
            copy += 1
    train_bpe([str(p) for p in stdlib_files(80)], work / "tokenizer.json", vocab_size=8192)
    for b in backends:
        (work / f"{b}.toml").write_text(
            f'name = "e2e"\ntokenizer = "tokenizer.json"\ntokenizer_backend = "{b}"\n'
            '[packing]\nseq_len = 2048\neos = "<|endoftext|>"\n'
            '[[sources]]\nname = "code"\npaths = ["code.jsonl"]\nformat = "jsonl"\nweight = "1"\n')


def _sluice(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench/backends_e2e.py: `sluice {' '.join(args)}` failed ({proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def _on_the_fly(work: Path, backend: str, steps: int) -> float:
    from loaderd_support import Daemon

    root = work / f"fly-{backend}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    for f in ("code.jsonl", "tokenizer.json"):
        os.link(work / f, root / f)
    shutil.copy(work / f"{backend}.json", root / "manifest.json")
    (root / "run.toml").write_text(f'run_id = "r"\nseed = 7\nlanes = 8\nglobal_batch = 8\nmicro_batch = 8\n'
                                   f'max_steps = {steps}\n')
    t0 = time.perf_counter()
    tokens = 0
    with Daemon(root) as d:
        c = d.client(0, 1)
        for n, batch in enumerate(c, 1):
            tokens += int(batch["input_ids"].size)
            if n >= steps:
                break
        seconds = time.perf_counter() - t0
        c.close()
    shutil.rmtree(root)
    return tokens / seconds


def _first_difference(ref, other) -> int | None:
    """The first document whose token array differs byte for byte (its index; the count where they differ in
    length), else None."""
    for i in range(min(ref.n_docs, other.n_docs)):
        a, b = ref.doc(i), other.doc(i)
        if a.dtype != b.dtype or a.tobytes() != b.tobytes():
            return i
    return None if ref.n_docs == other.n_docs else min(ref.n_docs, other.n_docs)


def _pretokenized(work: Path, backend: str):
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard

    d = load_manifest(work / f"out-{backend}" / "manifest.json")
    return open_shard(d.resolve(d.sources[0].objects[0].location))


def _warmed(work: Path, backend: str):
    """The token shard `cache warm --tokens` kept for the backend's manifest (its cache key names the backend)."""
    from sluice.cache import NodeCache
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard
    from sluice.tokenize.encoder import encoder_for_manifest
    from sluice.tokenize.tokcache import lookup_tokens

    m = load_manifest(work / f"{backend}.json")
    cache = NodeCache(str(work / f"cache-{backend}"), 1 << 30, collect=False)
    pin = lookup_tokens(cache, m, 0, 0, encoder_for_manifest(m))
    if pin is None:
        raise SystemExit(f"bench/backends_e2e.py: cache-{backend} holds no tokens after `cache warm --tokens`")
    try:
        return open_shard(pin.path)  # (the mapping outlives the pin: nothing evicts in this bench)
    finally:
        pin.close()


def _recorded_backend(work: Path, backend: str) -> str:
    """The backend the frozen manifest records (what `auto` picked; the requested one otherwise)."""
    from sluice.manifest.model import load_manifest

    return getattr(load_manifest(work / f"{backend}.json").tokenizer, "backend", "hf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--mb", type=int, default=20, help="corpus size in MiB")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated tokenizer_backend values; hf (the reference) is always run (default: "
                         f"{','.join(BACKENDS)}; also auto, tiktoken, tokie)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"what to time (default: {','.join(PARTS)})")
    ap.add_argument("--workers", type=int, default=1,
                    help="pretokenize --workers and cache warm --token-workers (default 1)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "backends_e2e.json"))
    args = ap.parse_args(argv)
    backends = ("hf", *dict.fromkeys(b for b in args.backends.split(",") if b and b != "hf"))
    parts = tuple(p for p in args.parts.split(",") if p)
    for p in parts:
        if p not in PARTS:
            ap.error(f"--parts: {p!r} is not one of {', '.join(PARTS)}")
    for b in backends:
        if b not in ("hf", "auto", "tiktoken", "fastokens", "tokie"):
            ap.error(f"--backends: {b!r} is not a tokenizer_backend (hf, auto, tiktoken, fastokens, tokie)")
    if args.rounds < 1 or args.mb < 1 or args.workers < 1:
        ap.error("--rounds, --mb and --workers must be at least 1")
    from sluice.manifest.model import load_manifest

    res: dict[str, dict[str, list[float]]] = {}
    same: dict[str, dict[str, bool]] = {}
    first_diff: dict[str, dict[str, int]] = {}

    def note(what: str, backend: str, value: float) -> None:
        res.setdefault(what, {}).setdefault(backend, []).append(value)

    workers = str(args.workers)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-backends-") as tmp:
        work = Path(tmp)
        _corpus(work, args.mb << 20, backends)
        for b in backends:
            note("freeze_s", b, _sluice("manifest", "freeze", str(work / f"{b}.toml"), "-o", str(work / f"{b}.json"),
                                        "--no-progress"))
        recorded = {b: _recorded_backend(work, b) for b in backends}
        m = load_manifest(work / "hf.json")
        n = m.sources[0].objects[0].records
        text_bytes = m.sources[0].objects[0].size
        print(f"corpus: {n} documents, {text_bytes / 1e6:.1f} MB; backends {', '.join(backends)}"
              + (f" (auto recorded {recorded['auto']})" if "auto" in recorded else ""), flush=True)
        tokens = None
        for rnd in range(args.rounds):
            for b in backends:
                if "pretokenize" in parts:
                    shutil.rmtree(work / f"out-{b}", ignore_errors=True)
                    note("pretokenize_s", b, _sluice("tokenize", "pretokenize", str(work / f"{b}.json"), "-o",
                                                     str(work / f"out-{b}"), "--workers", workers, "--no-progress"))
                if "warm" in parts:
                    shutil.rmtree(work / f"cache-{b}", ignore_errors=True)
                    _sluice("cache", "warm", str(work / f"{b}.json"), str(work / f"cache-{b}"), "--budget", "1G",
                            "--no-progress")
                    note("warm_tokens_s", b, _sluice("cache", "warm", str(work / f"{b}.json"),
                                                     str(work / f"cache-{b}"), "--budget", "1G", "--tokens",
                                                     "--token-workers", workers, "--no-progress"))
                if "onfly" in parts:
                    note("on_the_fly_tok_per_s", b, _on_the_fly(work, b, args.steps))
                shown = ", ".join(f"{what} {by[b][-1]:.2f}" for what, by in res.items()
                                  if what != "freeze_s" and len(by.get(b, ())) == rnd + 1)
                print(f"  round {rnd + 1}/{args.rounds} {b}: {shown}", flush=True)
            for part, open_tokens in (("pretokenize", _pretokenized), ("warm", _warmed)):
                if part not in parts:
                    continue
                ref = open_tokens(work, "hf")
                tokens = sum(ref.doc(i).size for i in range(ref.n_docs))
                for b in backends[1:]:
                    diff = _first_difference(ref, open_tokens(work, b))
                    ok = diff is None and same.get(part, {}).get(b, True)
                    same.setdefault(part, {})[b] = ok
                    if diff is not None:
                        first_diff.setdefault(part, {}).setdefault(b, diff)
        if "check" in parts:
            for b in backends[1:]:
                if b != "auto":
                    note("check_s", b, _sluice("tokenize", "check", str(work / "hf.json"), "--backend", b))
    rows = []
    for what, by in res.items():
        rate = what.endswith("_per_s")  # else seconds: lower is better
        cells = {b: max(v) if rate else min(v) for b, v in by.items()}
        ratios = {b: (v / cells["hf"] if rate else cells["hf"] / v) for b, v in cells.items()
                  if b != "hf" and "hf" in cells and v}
        rows.append((what, cells, ratios))
    all_same = all(ok for by in same.values() for ok in by.values())
    print(f"corpus: {n} documents, {tokens if tokens is not None else '-'} tokens; same token arrays as hf: "
          + (", ".join(f"{part} {b} {'yes' if ok else 'NO, first at document ' + str(first_diff[part][b])}"
                       for part, by in same.items() for b, ok in by.items()) or "not compared"))
    head = f"{'':<22}" + "".join(f"{b + (' (' + recorded[b] + ')' if b == 'auto' else ''):>26}" for b in backends)
    print(head)
    for what, cells, ratios in rows:
        line = f"{what:<22}"
        for b in backends:
            v = cells.get(b)
            cell = "-" if v is None else (f"{v / 1e6:.2f} M" if what.endswith("_per_s") else f"{v:,.2f} s")
            if b in ratios:
                cell += f" ({ratios[b]:.1f}x)"
            line += f"{cell:>26}"
        print(line)
    line = json.dumps({"bench": "backends_e2e", "command": " ".join(["bench/backends_e2e.py", *(
        argv if argv is not None else sys.argv[1:])]), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "documents": n, "text_bytes": text_bytes, "tokens": tokens, "backends": list(backends),
        "recorded_backend": recorded, "parts": list(parts), "workers": args.workers,
        "same_token_arrays": all_same, "same_token_arrays_by_part": same, "first_difference": first_diff,
        "ratio_to_hf": {what: ratios for what, _, ratios in rows},
        "rounds": args.rounds, "steps": args.steps, "results": res}, sort_keys=True)
    print(line)
    _save(line, Path(args.out))
    return 0 if all_same else 1


def _save(line: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
