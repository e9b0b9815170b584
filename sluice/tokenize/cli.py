"""`sluice tokenize {train,pretokenize,check,identity}`."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from sluice.errors import SpecError, TokenizerError
from sluice.progress import add_progress_argument, progress_wanted


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenize",
        help="train, identify and apply tokenizers",
        description="Train a byte-level BPE offline, show a tokenizer's identity, pre-tokenize a manifest.",
    )
    sub = parser.add_subparsers(dest="tokenize_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    train = sub.add_parser(
        "train",
        help="train a byte-level BPE tokenizer.json offline",
        description=(
            "Train a byte-level BPE (byte alphabet, ByteLevel pre-tokenizer and decoder) on local files. "
            "CORPUS may be files or directories; directories contribute *.jsonl, *.jsonl.gz, *.jsonl.zst, "
            "*.parquet, *.py, *.txt and *.md files recursively, in sorted order (jsonl: the --text-field of each "
            "line; parquet: the --text-field column) and skip other files, saying which and why. "
            "The same corpus and options give a byte-identical tokenizer.json."
        ),
    )
    train.add_argument("corpus", nargs="+", metavar="CORPUS", help="files or directories of text")
    train.add_argument("-o", "--output", required=True, help="tokenizer.json to write (atomically)")
    train.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    train.add_argument(
        "--special",
        action="append",
        metavar="TOKEN",
        help="a special token (repeatable; ids in the order given). Default: <|endoftext|> <|pad|> <|bos|>",
    )
    train.add_argument("--text-field", default="text",
                       help="field of jsonl lines, or column of parquet files, to train on (default: text)")
    train.add_argument("--json", action="store_true", help="print the result as one JSON object")
    train.set_defaults(func=_train)

    pre = sub.add_parser(
        "pretokenize",
        help="write .sltok shards for a manifest and the derived manifest",
        description=(
            "Tokenize every object of every non-'tokens' source of MANIFEST with its tokenizer (digest-checked), "
            "verifying each raw object's BLAKE3, into DIR/shards/*.sltok, and write DIR/manifest.json whose "
            "objects record their lineage (raw digest, tokenizer digest, transform). Prints the derived dataset ID. "
            "The output is byte-identical for any --workers."
        ),
    )
    pre.add_argument("manifest", metavar="MANIFEST", help="a frozen manifest.json")
    pre.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for the derived dataset")
    pre.add_argument(
        "--workers", type=int, default=None, help="worker processes, one Rust thread each (default: CPUs available)"
    )
    pre.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="who tokenizes: local worker processes (default) or one Ray task per object "
                     "(needs sluice[ray]; same shards and manifest bytes; see docs/deploy.md)")
    pre.add_argument("--address", default=None, metavar="ADDR",
                     help="Ray cluster for --engine ray (auto, ray://HEAD:10001); default: a local Ray for the call")
    add_progress_argument(pre)
    pre.add_argument("--json", action="store_true", help="print the result as one JSON object")
    pre.set_defaults(func=_pretokenize)

    check = sub.add_parser(
        "check",
        help="prove a tokenizer backend gives the same ids as tokenizers on a manifest's documents",
        description=(
            "Encode the documents of every text object of MANIFEST with tokenizers (the hf backend) and with "
            "BACKEND, both built from the manifest's tokenizer.json (digest-checked), and compare the ids of each "
            "document. Objects are fetched through a node cache (digest-verified). Exit status 0 when every "
            "compared document has the same ids, 1 when any differs (the first ones are listed), 2 on an error, "
            "including a tokenizer the backend cannot represent (the message says why)."
        ),
    )
    check.add_argument("manifest", metavar="MANIFEST", help="a frozen manifest.json")
    check.add_argument("--backend", choices=["tiktoken", "fastokens", "tokie"], default=None,
                       help="backend to check (default: the manifest's, or tiktoken for an hf manifest)")
    check.add_argument("--sample", type=int, metavar="N",
                       help="compare about N documents: the first ceil(N / text objects) of each object "
                            "(default: every document)")
    check.add_argument("--cache", metavar="DIR", help="node cache folder to read objects through "
                                                      "(default: a temporary one, removed after)")
    check.add_argument("--cache-budget", default="64GiB", metavar="SIZE",
                       help="byte budget for a cache folder created here (default 64GiB)")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check.set_defaults(func=_check)

    ident = sub.add_parser(
        "identity",
        help="print a tokenizer's digest, version, vocab size and special tokens",
        description="Print the identity of a tokenizer.json: b3 digest of its bytes, version field, vocab size, special tokens.",
    )
    ident.add_argument("tokenizer", metavar="TOKENIZER", help="a tokenizer.json")
    ident.add_argument("--json", action="store_true", help="print as one JSON object")
    ident.set_defaults(func=_identity)


def _emit(args: argparse.Namespace, obj: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(obj, sort_keys=True))
    else:
        print("\n".join(lines))


def _train(args: argparse.Namespace) -> int:
    from sluice.tokenize.train import DEFAULT_SPECIALS, train_bpe

    result = train_bpe(
        args.corpus,
        args.output,
        vocab_size=args.vocab_size,
        special_tokens=tuple(args.special) if args.special else DEFAULT_SPECIALS,
        text_field=args.text_field,
    )
    obj = {
        "path": result.path,
        "digest": result.digest,
        "vocab_size": result.vocab_size,
        "files": result.files,
        "documents": result.documents,
        "bytes": result.bytes,
        "text_field": args.text_field,
        "read": result.read,
        "skipped": [{"path": p, "why": why} for p, why in result.skipped],
    }
    read = ", ".join(f"{n['files']} {fmt} ({n['documents']} documents)" for fmt, n in sorted(result.read.items()))
    lines = [
        f"wrote      {result.path}",
        f"digest     {result.digest}",
        f"vocab_size {result.vocab_size}",
        f"corpus     {result.files} files, {result.documents} documents, {result.bytes} characters",
        f"read       {read} (jsonl/parquet field {args.text_field!r})",
    ]
    shown = 10  # a folder of thousands of other files is summed up, not listed
    lines += [f"skipped    {p}: {why}" for p, why in result.skipped[:shown]]
    if len(result.skipped) > shown:
        lines.append(f"skipped    ... and {len(result.skipped) - shown} more files (--json lists them all)")
    _emit(args, obj, lines)
    return 0


def _pretokenize(args: argparse.Namespace) -> int:
    from sluice.manifest.model import load_manifest
    from sluice.tokenize.threads import available_cpus
    from sluice.tokenize.pretokenize import pretokenize

    workers = args.workers if args.workers is not None else available_cpus()
    if workers < 1:
        raise TokenizerError(f"--workers: expected >= 1, got {workers}")
    manifest = load_manifest(args.manifest)
    if args.engine == "ray":
        from sluice.engines.ray_engine import LOCAL_CPUS, pretokenize_ray

        result = pretokenize_ray(manifest, args.output, address=args.address, progress=progress_wanted(args),
                                 num_cpus=args.workers or LOCAL_CPUS)
    else:
        if args.address:
            raise SpecError("tokenize pretokenize: --address names a Ray cluster; it needs --engine ray")
        result = pretokenize(manifest, args.output, workers=workers, progress=progress_wanted(args))
    rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
    obj = {
        "dataset_id": result.dataset_id,
        "manifest": result.path,
        "source_dataset_id": manifest.dataset_id,
        "shards": result.objects,
        "documents": result.documents,
        "tokens": result.tokens,
        "raw_bytes": result.raw_bytes,
        "workers": workers,
        "engine": args.engine,
        "seconds": round(result.seconds, 3),
    }
    _emit(
        args,
        obj,
        [
            result.dataset_id,
            f"manifest  {result.path}",
            f"from      {manifest.dataset_id}",
            f"shards    {result.objects}, {result.documents} documents, {result.tokens} tokens",
            f"time      {result.seconds:.2f} s with {workers} workers ({rate:,.0f} tokens/s)",
        ],
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    import tempfile

    from sluice.cache import NodeCache
    from sluice.cache.cli import parse_bytes
    from sluice.manifest.model import load_manifest
    from sluice.tokenize.check import check_backend

    manifest = load_manifest(args.manifest)
    backend = args.backend
    if backend is None:
        backend = manifest.tokenizer.backend if manifest.tokenizer is not None else "tiktoken"
        backend = "tiktoken" if backend == "hf" else backend
    try:
        budget = parse_bytes(args.cache_budget)
    except argparse.ArgumentTypeError as exc:
        raise TokenizerError(f"--cache-budget: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="sluice-check-") as tmp:
        with NodeCache(args.cache or tmp, budget, durable=False) as cache:
            result = check_backend(manifest, backend, cache=cache, sample=args.sample)
    speed = result.hf_seconds / result.backend_seconds if result.backend_seconds > 0 else 0.0
    what = f"first {math.ceil(args.sample / max(1, result.objects))} documents of each object" if args.sample else "every document"
    lines = [
        f"{'SAME' if result.equal else 'DIFFERENT'} ids: {backend} vs hf on {result.documents} documents "
        f"({what}) of {result.objects} text objects, {result.tokens} tokens",
        f"time      hf {result.hf_seconds:.2f} s, {backend} {result.backend_seconds:.2f} s ({speed:.1f}x)",
    ]
    if not result.equal:
        lines.append(f"{result.mismatched} documents differ; first ones:")
        lines += [f"  {m.describe(backend)}" for m in result.mismatches]
    _emit(args, result.to_dict(), lines)
    return 0 if result.equal else 1


def _identity(args: argparse.Namespace) -> int:
    from sluice.tokenize.encoder import load_tokenizer

    enc = load_tokenizer(args.tokenizer)
    specials = [{"id": s.id, "content": s.content} for s in enc.special_tokens]
    obj = {
        "path": os.fspath(args.tokenizer),
        "digest": enc.digest,
        "version": enc.version,
        "vocab_size": enc.vocab_size,
        "special_tokens": specials,
    }
    _emit(
        args,
        obj,
        [
            f"digest         {enc.digest}",
            f"version        {enc.version}",
            f"vocab_size     {enc.vocab_size}",
            "special_tokens " + (", ".join(f"{s['id']}={s['content']}" for s in specials) or "(none)"),
        ],
    )
    return 0
