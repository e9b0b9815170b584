"""Benchmark: every place tokens are made, with the `hf` backend and with `fastokens`, end to end.

Corpus: whole standard-library sources as one jsonl object (about 20 MB; no
download), a 8192-token byte-level BPE trained on 80 of them. Frozen twice,
`tokenizer_backend = "hf"` and `"fastokens"` (freeze proves the latter on its
sample). Then, each command a fresh process, backends interleaved:

* `sluice tokenize pretokenize --workers 1` (and the token arrays compared);
* `sluice cache warm --tokens --token-workers 1` (raw object already cached);
* on the fly: a real loaderd, cold node cache, `--steps` steps of 8 x 2048
  tokens to one client, from daemon start to the last batch;
* `sluice tokenize check --backend fastokens` on the hf manifest.

Prints a table and one JSON line; writes bench/out/backends_e2e.json.
Run: ``.venv/bin/python bench/backends_e2e.py [--rounds 2] [--steps 150]``
(about a minute on a 2-core machine; best round shown, every round in the JSON). Not a test: figures move with load.
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


def _corpus(work: Path, size: int) -> None:
    from sluice.demo import stdlib_files
    from sluice.tokenize.train import train_bpe

    written = 0
    with open(work / "code.jsonl", "w") as out:
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                line = json.dumps({"text": f.read_text(encoding="utf-8")}) + "\n"
            except (UnicodeDecodeError, OSError):
                continue
            out.write(line)
            written += len(line)
            if written >= size:
                break
    train_bpe([str(p) for p in stdlib_files(80)], work / "tokenizer.json", vocab_size=8192)
    for b in BACKENDS:
        (work / f"{b}.toml").write_text(
            f'name = "e2e"\ntokenizer = "tokenizer.json"\ntokenizer_backend = "{b}"\n'
            '[packing]\nseq_len = 2048\neos = "<|endoftext|>"\n'
            '[[sources]]\nname = "code"\npaths = ["code.jsonl"]\nformat = "jsonl"\nweight = "1"\n')


def _sluice(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sluice.cli", *args], check=True, capture_output=True, text=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--mb", type=int, default=20, help="corpus size in MB")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "backends_e2e.json"))
    args = ap.parse_args(argv)
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard

    res: dict[str, dict[str, list[float]]] = {}

    def note(what: str, backend: str, value: float) -> None:
        res.setdefault(what, {}).setdefault(backend, []).append(value)

    with tempfile.TemporaryDirectory(prefix="sluice-bench-backends-") as tmp:
        work = Path(tmp)
        _corpus(work, args.mb << 20)
        for b in BACKENDS:
            note("freeze_s", b, _sluice("manifest", "freeze", str(work / f"{b}.toml"), "-o", str(work / f"{b}.json"),
                                        "--no-progress"))
        m = load_manifest(work / "hf.json")
        tokens = None
        for _ in range(args.rounds):
            for b in BACKENDS:
                shutil.rmtree(work / f"out-{b}", ignore_errors=True)
                note("pretokenize_s", b, _sluice("tokenize", "pretokenize", str(work / f"{b}.json"), "-o",
                                                 str(work / f"out-{b}"), "--workers", "1", "--no-progress"))
                shutil.rmtree(work / f"cache-{b}", ignore_errors=True)
                _sluice("cache", "warm", str(work / f"{b}.json"), str(work / f"cache-{b}"), "--budget", "1G",
                        "--no-progress")
                note("warm_tokens_s", b, _sluice("cache", "warm", str(work / f"{b}.json"), str(work / f"cache-{b}"),
                                                 "--budget", "1G", "--tokens", "--token-workers", "1",
                                                 "--no-progress"))
                note("on_the_fly_tok_per_s", b, _on_the_fly(work, b, args.steps))
            shards = []
            for b in BACKENDS:
                d = load_manifest(work / f"out-{b}" / "manifest.json")
                shards.append(open_shard(d.resolve(d.sources[0].objects[0].location)))
            n = m.sources[0].objects[0].records
            same = all(shards[0].doc(i).tolist() == shards[1].doc(i).tolist() for i in range(n))
            tokens = sum(shards[0].doc(i).size for i in range(n))
        note("check_s", "fastokens", _sluice("tokenize", "check", str(work / "hf.json"), "--backend", "fastokens"))
    rows = []
    for what, by in res.items():
        rate = what.endswith("_per_s")  # else seconds: lower is better
        cells = {b: max(v) if rate else min(v) for b, v in by.items()}
        ratio = (cells["fastokens"] / cells["hf"] if rate else cells["hf"] / cells["fastokens"]) \
            if "hf" in cells and "fastokens" in cells else None
        rows.append((what, cells, ratio))
    print(f"corpus: {n} documents, {tokens:,} tokens; same token arrays (pretokenize): {same}")
    for what, cells, ratio in rows:
        shown = "  ".join(f"{b} {v / 1e6:.2f} M" if what.endswith("_per_s") else f"{b} {v:,.2f}"
                          for b, v in cells.items())
        print(f"{what:<22} {shown}" + (f"  ({ratio:.1f}x)" if ratio else ""))
    line = json.dumps({"bench": "backends_e2e", "documents": n, "tokens": tokens, "same_token_arrays": same,
                       "rounds": args.rounds, "steps": args.steps, "results": res}, sort_keys=True)
    print(line)
    _save(line, Path(args.out))
    return 0


def _save(line: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
