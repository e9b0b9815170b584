"""`make demo`: the whole story on an embedded default corpus.

The corpus is the Python standard library's own source files (they exist on
every machine), turned into jsonl.zst shards (code) and parquet shards (docs:
the modules' docstrings) by this script. Steps:

1. train a byte-level BPE tokenizer offline on that corpus;
2. write a dataset spec and freeze it (twice: same dataset ID);
3. show the manifest;
4. plan the first steps of a run offline;
5. (with torch) train a small model from loaderd batches, crash, resume, and
   check that the stream and the parameters match an uninterrupted run.

Run as ``python -m sluice.demo --out DIR``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

DATASET_SPEC = """\
# Demo dataset: the Python standard library, as code and as docstrings.
name = "stdlib-demo"
tokenizer = "tokenizer.json"
access = "public"

[notes]
origin = "CPython standard library sources on this machine"

[packing]
seq_len = 128
algorithm = "concat"
eos = "<|endoftext|>"
pad = "<|pad|>"
separator = "eos"

[mixture]
policy = "quota"
unit = "tokens"

[[sources]]
name = "code"
paths = ["shards/code-*.jsonl.zst"]
format = "jsonl"
text_field = "text"
weight = "0.7"
exhaustion = "repeat"

[[sources]]
name = "docs"
paths = ["shards/docs-*.parquet"]
format = "parquet"
text_field = "text"
weight = "0.3"
exhaustion = "repeat"
"""

RUN_SPEC = """\
run_id = "demo"
seed = 1234
lanes = 8
global_batch = 16
micro_batch = 4
resume = "exact"
"""


def stdlib_files(limit: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return files[:limit]


def build_corpus(out: Path, *, files: int = 240, per_shard: int = 800) -> None:
    """Write shards/code-NNN.jsonl.zst and shards/docs-NNN.parquet under `out`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    code, docs = [], []
    for path in stdlib_files(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = text.splitlines(keepends=True)
        for start in range(0, len(lines), 60):  # documents of 60 lines: many, of varied length
            code.append({"text": "".join(lines[start : start + 60]), "path": f"{path.name}:{start + 1}"})
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append({"text": doc, "path": path.name})
    cctx = zstandard.ZstdCompressor(level=3)
    for i in range(0, len(code), per_shard):
        lines = "".join(json.dumps(r) + "\n" for r in code[i : i + per_shard]).encode()
        (shards / f"code-{i // per_shard:03d}.jsonl.zst").write_bytes(cctx.compress(lines))
    per_doc_shard = max(1, len(docs) // 4 + 1)
    for i in range(0, len(docs), per_doc_shard):
        table = pa.table({"text": [d["text"] for d in docs[i : i + per_doc_shard]], "path": [d["path"] for d in docs[i : i + per_doc_shard]]})
        pq.write_table(table, shards / f"docs-{i // per_doc_shard:03d}.parquet")


def sluice(*args: str) -> str:
    """Run the real CLI in a subprocess (as a user would) and return its stdout."""
    cmd = [sys.executable, "-m", "sluice.cli", *args]
    shown = " ".join(args) if len(args) < 12 else " ".join([*args[:2], "...", *args[-4:]])
    print(f"$ sluice {shown}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"demo: `sluice {' '.join(args)}` failed with exit {proc.returncode}")
    sys.stdout.write(proc.stdout)
    return proc.stdout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo-out", help="working folder (default demo-out)")
    parser.add_argument("--no-train", action="store_true", help="stop after planning (no torch needed)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    print("== 1. corpus: the standard library as jsonl.zst (code) and parquet (docstrings)")
    build_corpus(out)
    print("== 2. tokenizer: byte-level BPE trained offline")
    corpus = [str(p) for p in stdlib_files(120)]
    sluice("tokenize", "train", *corpus, "-o", str(out / "tokenizer.json"), "--vocab-size", "2048")
    (out / "dataset.toml").write_text(DATASET_SPEC)
    (out / "run.toml").write_text(RUN_SPEC)
    print("== 3. freeze, twice: the dataset ID is a pure function of the bytes and the policies")
    first = sluice("manifest", "freeze", str(out / "dataset.toml"), "-o", str(out / "manifest.json"), "--no-progress").strip()
    second = sluice("manifest", "freeze", str(out / "dataset.toml"), "-o", str(out / "manifest-again.json"), "--no-progress").strip()
    if first.splitlines()[-1] != second.splitlines()[-1]:
        raise SystemExit(f"demo: freezing twice gave different IDs: {first} vs {second}")
    print(f"same dataset ID twice: {first.splitlines()[-1]}")
    sluice("manifest", "show", str(out / "manifest.json"))
    print("== 4. plan: what steps 0..3 serve, per replica (R=2), computed offline")
    sluice("plan", str(out / "manifest.json"), str(out / "run.toml"), "--steps", "0:4", "--replicas", "2", "--cache", str(out / "cache"))
    sluice("ledger", str(out / "manifest.json"), str(out / "run.toml"), "--until-step", "3", "--cache", str(out / "cache"))
    if args.no_train:
        return 0
    try:
        from sluice import demo_train
    except ImportError:
        print("(training story not available in this build)")
        return 0
    return demo_train.run(out)


if __name__ == "__main__":
    raise SystemExit(main())
