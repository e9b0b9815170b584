"""The one corpus and tokenizer every loader reads, generated under a work folder.

Documents: the Python standard library's sources (this machine's, no
download), cut into 60-line documents, repeated with a copy marker until the
target size. Written as jsonl.zst shards (sluice, HF datasets, Grain), the same
documents as WebDataset tars (one .txt member per document), and a plain-text
sample the byte-level BPE is trained on with `sluice tokenize train`.
sluice's side is prepared with its own CLI: `manifest freeze`, `tokenize
pretokenize`, `cache warm --tokens`.

Two workloads (`WORKLOADS`), each in its own folder: ``single`` (one source,
four shards; what the bench always ran) and ``mixture`` (the same documents cut
into five sources of two shards each, weights by tokens 0.35/0.25/0.2/0.12/0.08,
the default `piece_tokens`, concat 2048: what a training run reads; run.py's
`variant_manifest` freezes the same with best-fit, or by sequences). The peers
read the same documents unmixed (their jobs concat every shard in order). A
prepared corpus is reused only while its key holds: sizes, workload, and a
digest of this file and of sluice's manifest, tokenize and cache packages (the
defaults a freeze writes, the token arrays, the cache layout), so a change of
any rebuilds it.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

RUNSPEC = """run_id = "peers"
seed = 7
lanes = 8
global_batch = 8
micro_batch = 8
resume = "exact"
order = "block"
"""


WORKLOADS = ("single", "mixture")
# The mixture workload's sources: (name, weight by tokens).
MIXTURE = (("web", "0.35"), ("code", "0.25"), ("books", "0.2"), ("papers", "0.12"), ("forums", "0.08"))


def spec(name: str, paths: str, sources: tuple[tuple[str, str], ...] = ()) -> str:
    """The dataset spec: one source "code" reading `paths`, or where `sources` is given one source per
    (name, weight), reading ``shards/<name>-*.jsonl.zst``."""
    if sources:
        return _head(name) + "".join(_source(n, f"shards/{n}-*.jsonl.zst", w) for n, w in sources)
    return _head(name) + _source("code", paths, "1")


def _head(name: str) -> str:
    return f"""name = "{name}"
tokenizer = "tokenizer.json"

[packing]
seq_len = 2048
algorithm = "concat"
eos = "<|endoftext|>"
pad = "<|pad|>"
separator = "eos"

[mixture]
policy = "quota"
unit = "tokens"
"""


def _source(name: str, paths: str, weight: str) -> str:
    return f"""
[[sources]]
name = "{name}"
paths = ["{paths}"]
format = "jsonl"
text_field = "text"
weight = "{weight}"
exhaustion = "repeat"
"""


def documents(target_bytes: int) -> Iterator[str]:
    """60-line documents of the stdlib, repeated (with a copy marker) until target_bytes of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts)
    total, copy = 0, 0
    while True:
        for path in files:
            try:
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue
            for start in range(0, len(lines), 60):
                doc = f"# {path.name} copy {copy}\n" + "".join(lines[start:start + 60])
                total += len(doc)
                yield doc
                if total >= target_bytes:
                    return
        copy += 1


def sluice(*args: str) -> str:
    """The real CLI, with the repo's python; stops the bench with its stderr on failure."""
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench/peers: `sluice {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def write_shards(out: Path, docs: list[str], shards: int, prefix: str = "code") -> None:
    import zstandard

    (out / "shards").mkdir(parents=True, exist_ok=True)
    (out / "tars").mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // shards)
    cctx = zstandard.ZstdCompressor(level=3)
    for s in range(shards):
        part = docs[s * per:(s + 1) * per]
        body = "".join(json.dumps({"text": d}) + "\n" for d in part).encode()
        (out / "shards" / f"{prefix}-{s:03d}.jsonl.zst").write_bytes(cctx.compress(body))
        with tarfile.open(out / "tars" / f"{prefix}-{s:03d}.tar", "w") as tar:
            for i, d in enumerate(part):
                data = d.encode()
                info = tarfile.TarInfo(f"{s:03d}{i:07d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


# sluice's packages whose code decides the prepared files: the manifest a freeze writes (and its defaults), the
# token arrays pretokenize and `cache warm --tokens` make, the node cache's layout the warmed caches are in.
DIGESTED = ("manifest", "tokenize", "cache")


def code_digest() -> str:
    """A digest of what decides the prepared files besides the sizes: this file and sluice's `DIGESTED`
    packages (a change to either rebuilds the corpus rather than serve a stale one)."""
    h = hashlib.blake2b(digest_size=16)
    ours = [p for pkg in DIGESTED for p in sorted((REPO / "sluice" / pkg).rglob("*.py"))]
    for path in [Path(__file__).resolve(), *ours]:
        h.update(str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name).encode() + b"\0"
                 + path.read_bytes())
    return h.hexdigest()


def prepare(out: Path, *, mb: int, vocab: int, shards: int = 4, workload: str = "single") -> dict:
    """Build (once per key: sizes, workload, `code_digest`) the corpus, tokenizer, manifests and warmed caches
    of `workload` (`WORKLOADS`); return their paths. A stale folder is emptied first."""
    stamp = out / "prepared.json"
    key = {"mb": mb, "vocab": vocab, "shards": shards, "workload": workload, "code": code_digest()}
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        return json.loads(stamp.read_text())["paths"]
    if stamp.exists():  # a prepared folder of another key: stale shards, caches and peer data would be read
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    docs = list(documents(mb * 1_000_000))
    if workload == "mixture":  # contiguous fifths of the documents, one source each, two shards a source
        per = -(-len(docs) // len(MIXTURE))
        for i, (name, _) in enumerate(MIXTURE):
            write_shards(out, docs[i * per:(i + 1) * per], 2, prefix=name)
    else:
        write_shards(out, docs, shards)
    sample = docs[: max(1, len(docs) // 4)]
    (out / "train.txt").write_text("".join(sample), encoding="utf-8")
    sluice("tokenize", "train", str(out / "train.txt"), "-o", str(out / "tokenizer.json"), "--vocab-size", str(vocab))
    (out / "dataset.toml").write_text(spec("peers-bench", "shards/code-*.jsonl.zst",
                                           MIXTURE if workload == "mixture" else ()))
    (out / "run.toml").write_text(RUNSPEC)
    sluice("manifest", "freeze", str(out / "dataset.toml"), "-o", str(out / "manifest.json"), "--no-progress")
    sluice("tokenize", "pretokenize", str(out / "manifest.json"), "-o", str(out / "derived"), "--no-progress")
    sluice("cache", "warm", str(out / "manifest.json"), str(out / "cache-tok"), "--tokens", "--budget", "8GiB", "--no-progress")
    sluice("cache", "warm", str(out / "derived" / "manifest.json"), str(out / "cache-pretok"), "--budget", "8GiB", "--no-progress")
    paths = {
        "tokenizer": str(out / "tokenizer.json"),
        "shards": sorted(str(p) for p in (out / "shards").glob("*.jsonl.zst")),
        "tars": sorted(str(p) for p in (out / "tars").glob("*.tar")),
        "manifest": str(out / "manifest.json"),
        "derived": str(out / "derived" / "manifest.json"),
        "runspec": str(out / "run.toml"),
        "cache_tok": str(out / "cache-tok"),
        "cache_pretok": str(out / "cache-pretok"),
        "documents": len(docs),
        "workload": workload,
        "text_bytes": sum(len(d) for d in docs),
    }
    stamp.write_text(json.dumps({"key": key, "paths": paths}))
    return paths


def tiktoken_manifest(out: Path) -> str:
    """The corpus's manifest frozen with `tokenizer_backend = "tiktoken"` (once), after `sluice tokenize
    check` proved both backends give the same ids on every document of it; its path."""
    return backend_manifest(out, "tiktoken")


def backend_manifest(out: Path, backend: str) -> str:
    """The corpus's manifest frozen with `tokenizer_backend = BACKEND` (once), after `sluice tokenize
    check --backend BACKEND` proved it gives the ids of `tokenizers` on every document of it; its path."""
    manifest = out / f"manifest-{backend}.json"
    if not manifest.exists():
        spec_text = (out / "dataset.toml").read_text()
        (out / f"dataset-{backend}.toml").write_text(f'tokenizer_backend = "{backend}"\n' + spec_text)
        sluice("tokenize", "check", str(out / "manifest.json"), "--backend", backend)
        sluice("manifest", "freeze", str(out / f"dataset-{backend}.toml"), "-o", str(manifest), "--no-progress")
    return str(manifest)


def one_object(out: Path, mb: int, order: str = "block") -> tuple[str, str]:
    """A manifest of one generated jsonl object of about `mb` MB (for the shard-size sweep) and a run
    spec with that sample `order`; (manifest, runspec)."""
    folder = out / f"sweep-{mb}"
    manifest = folder / "manifest.json"
    if not manifest.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "big.jsonl", "w", encoding="utf-8") as f:
            for d in documents(mb * 1_000_000):
                f.write(json.dumps({"text": d}) + "\n")
        (folder / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
        (folder / "dataset.toml").write_text(spec(f"sweep-{mb}", "big.jsonl"))
        (folder / "run.toml").write_text(RUNSPEC)
        sluice("manifest", "freeze", str(folder / "dataset.toml"), "-o", str(manifest), "--no-progress")
    runspec = folder / f"run-{order}.toml"
    runspec.write_text(RUNSPEC.replace('order = "block"', f'order = "{order}"'))
    return str(manifest), str(runspec)
