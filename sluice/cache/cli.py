"""`sluice cache {stats,verify,gc,warm}`: inspect and maintain a node cache folder."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from sluice.cliargs import ranged
from sluice.errors import CacheError, SluiceError
from sluice.progress import add_progress_argument, progress_bar

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1048576', '512M', '10G', '1.5T' (binary units, optional 'B'/'iB') -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size such as 1048576, 512M or 10G")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not number < 2**63:  # also inf: the index stores sizes as 64-bit integers
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: a byte size must be below 2**63")
    value = int(number)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a byte size must be positive")
    return value


def open_cache(directory: str, budget: int | None, *, must_exist: bool, collect: bool, roots: Any = None) -> Any:
    """The NodeCache at `directory` with its recorded budget (or `budget`); CacheError naming the folder
    when it is not a node cache (`must_exist`) or records no budget."""
    from sluice.cache.index import Index
    from sluice.cache.store import NodeCache

    root = Path(directory)
    if not (root / "index").is_dir():
        if must_exist or budget is None:
            raise CacheError(f"cache {root}: not a node cache (no index/ folder); "
                             "create one with `sluice cache warm MANIFEST DIR --budget SIZE`")
    elif budget is None:
        index = Index(root)
        with index.read() as txn:
            budget = index.meta(txn, b"budget") or None
        index.close()
        if budget is None:
            raise CacheError(f"cache {root}: the index records no budget; pass --budget SIZE")
    return NodeCache(root, budget, collect=collect, allowed_roots=roots)


def _print(args: argparse.Namespace, obj: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(obj, sort_keys=True))
    else:
        print("\n".join(lines))


def _stats(args: argparse.Namespace) -> int:
    cache = open_cache(args.dir, None, must_exist=True, collect=False)
    try:
        stats = cache.stats(all_processes=True).to_dict()
    finally:
        cache.close()
    width = max(map(len, stats))
    _print(args, stats, [f"{k:<{width}}  {v}" for k, v in stats.items()])
    return 0


def _verify(args: argparse.Namespace) -> int:
    cache = open_cache(args.dir, None, must_exist=True, collect=False)
    try:
        report = cache.verify_all()
    finally:
        cache.close()
    lines = [f"checked {report.checked}, ok {report.ok}, damaged {len(report.damaged)}, busy {len(report.busy)}"]
    lines += [f"DAMAGED {key}: {reason} (quarantined, removed from the index)" for key, reason in report.damaged]
    lines += [f"busy (being filled, not checked): {key}" for key in report.busy]
    _print(args, report.to_dict(), lines)
    return 1 if report.damaged else 0


def _gc(args: argparse.Namespace) -> int:
    cache = open_cache(args.dir, args.budget, must_exist=True, collect=False)
    try:
        debris = cache.collect_debris().to_dict()
        evicted = cache.enforce_budget()
        stats = cache.stats()
    finally:
        cache.close()
    out = {**debris, "evicted": evicted, "objects": stats.objects, "bytes": stats.bytes,
           "budget_bytes": stats.budget_bytes}
    _print(args, out, [f"{k}: {v}" for k, v in out.items()])
    return 0


def _warm(args: argparse.Namespace) -> int:
    from sluice.cache.roots import check_manifest, roots_for
    from sluice.loaderd.physical.lineindexes import LineIndexes
    from sluice.manifest.model import load_manifest

    manifest = load_manifest(args.manifest)
    roots = roots_for(manifest, args.allow_root)
    check_manifest(manifest, roots, where=f"manifest {args.manifest}")  # before anything is read
    objects = [obj for src in manifest.sources for obj in src.objects]
    unique = list({obj.digest: obj for obj in objects}.values())
    # Plain jsonl objects get their line index stored too (what a daemon locates records with
    # instead of counting lines: docs/tokenize.md, "The line index from the raw fill").
    indexable = {obj.digest for src in manifest.sources if src.format == "jsonl"
                 for obj in src.objects if obj.compression == "none"}
    cache = open_cache(args.dir, args.budget, must_exist=False, collect=True, roots=roots)
    failures: list[str] = []
    filled = fill_bytes = present = 0
    tokens = None
    indexes = LineIndexes(cache)
    done = {"objects": 0, "tokens": 0}  # for the line an interrupted warm ends with
    try:
        with progress_bar(args, total=sum(o.size for o in unique), desc=f"warm {Path(args.dir).name}",
                          unit="B", unit_scale=True) as bar:
            for obj in unique:
                # Classify each object by what this process did, so the counts always sum to
                # the total: an object another warmer filled while we waited for its lock
                # was neither a hit nor a fill of ours, and is "present" (not ours to fill).
                try:
                    ours = _fetch(cache, manifest, obj, indexes if obj.digest in indexable else None)
                except SluiceError as exc:  # report every bad object, not just the first
                    failures.append(str(exc))
                else:
                    if ours:
                        filled += 1
                        fill_bytes += obj.size
                    else:
                        present += 1
                bar.update(obj.size)
                done["objects"] += 1
        tokens = _warm_tokens(args, manifest, cache, done) if args.tokens else None
    except KeyboardInterrupt:
        texts = len({o.digest for src in manifest.sources if src.format != "tokens" for o in src.objects})
        stage = (f"tokens of {done['tokens']} of {texts} text objects kept" if done["objects"] == len(unique)
                 else f"{done['objects']} of {len(unique)} objects fetched")
        raise KeyboardInterrupt(f"cache warm {args.dir}: {stage}; what is published stays verified, "
                                "and the same command continues from there") from None
    finally:
        cache.close()
    out = {"objects": len(unique), "filled": filled, "present": present,
           "fill_bytes": fill_bytes, "failed": len(failures), "errors": failures,
           "line_indexes_stored": indexes.stored}
    lines = [f"{out['objects']} objects: {out['filled']} filled ({out['fill_bytes']} bytes), "
             f"{out['present']} already present, {out['failed']} failed; "
             f"{indexes.stored} line indexes stored"] + [f"FAILED {e}" for e in failures]
    if tokens is not None:
        out["tokens"] = tokens.to_dict()
        lines += [f"tokens of {tokens.objects} text objects: {tokens.tokenized} tokenized ({tokens.tokens} tokens), "
                  f"{tokens.present} already present, {len(tokens.failures)} failed"]
        lines += [f"FAILED {e}" for e in tokens.failures]
    _print(args, out, lines)
    return 1 if failures or (tokens is not None and tokens.failures) else 0


def _fetch(cache: Any, manifest: Any, obj: Any, indexes: Any) -> bool:
    """Fetch `obj` into the cache; True if this process filled it. With `indexes` (a plain jsonl
    object) also store its line index: built by the fill's observer, or, when the object was cached
    already without one, in one pass over the cached file (`LineIndexes.ensure`)."""
    from sluice.tokenize.lineindex import StagedIndexer

    indexer = None if indexes is None else StagedIndexer()
    fills_before = cache.stats().fills  # (the fills of every process: the index's store counts as one)
    try:
        pin = cache.fetch(obj, manifest.resolve(obj.location), observe=None if indexer is None else indexer.feed)
        ours = cache.stats().fills > fills_before
    finally:
        if indexer is not None:
            indexer.close()
    with pin:
        if indexes is not None:  # the fill returned: its bytes matched obj.digest
            indexes.ensure(obj, str(pin.path), indexer.finish(obj.digest, obj.size))
    return ours


def _warm_tokens(args: argparse.Namespace, manifest: Any, cache: Any, done: dict[str, int]) -> Any:
    """Tokens of every text object into the cache (sluice.tokenize.tokcache; docs/tokenize.md);
    counts the objects finished in `done["tokens"]`."""
    from sluice.tokenize import available_cpus, encoder_for_manifest
    from sluice.tokenize.tokcache import warm_tokens

    encoder = encoder_for_manifest(manifest, cache=cache)  # the tiktoken backend's encoding is kept too
    texts = {obj.digest: obj.size for src in manifest.sources if src.format != "tokens" for obj in src.objects}
    with progress_bar(args, total=sum(texts.values()), desc=f"tokens {Path(args.dir).name}",
                      unit="B", unit_scale=True) as bar:
        def progress(size: int) -> None:
            done["tokens"] += 1
            bar.update(size)

        return warm_tokens(manifest, cache, encoder, progress=progress,
                           workers=args.token_workers or available_cpus())


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `sluice cache ...` to the top-level CLI."""
    cache = subparsers.add_parser("cache", help="inspect and maintain a node cache",
                                  description="Inspect and maintain a node cache folder.")
    sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    p = sub.add_parser("stats", help="counters and totals (cumulative over all processes)")
    p.add_argument("dir", metavar="DIR", help="cache folder")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_stats)

    p = sub.add_parser("verify", help="re-hash every object; exit 1 if any is damaged",
                       description="Re-hash every published object. Damaged ones are quarantined and removed "
                                   "from the index (the next fetch refills them); exit status 1 if any was found.")
    p.add_argument("dir", metavar="DIR", help="cache folder")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_verify)

    p = sub.add_parser("gc", help="collect debris and evict down to the budget",
                       description="Remove leftovers of killed fills (temporary files, stale reservations, "
                                   "unindexed objects, unheld lock files), prune the quarantine, and evict "
                                   "least recently used unpinned objects until the budget holds.")
    p.add_argument("dir", metavar="DIR", help="cache folder")
    p.add_argument("--budget", type=parse_bytes, metavar="SIZE", help="new byte budget (e.g. 50G); default: the recorded one")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_gc)

    p = sub.add_parser("warm", help="prefetch every object of a manifest into a cache",
                       description="Fetch (verify and publish) every object of MANIFEST into the cache DIR; "
                                   "exit status 1 if any object failed. Every object location must lie within "
                                   "an allowed root (--allow-root). The counts printed sum to the number of "
                                   "objects: filled by this command, already present (or filled meanwhile by "
                                   "another process), failed. The line index of every plain jsonl object is stored "
                                   "too (what loaderd locates records with instead of counting lines).")
    p.add_argument("manifest", metavar="MANIFEST", help="manifest file")
    p.add_argument("dir", metavar="DIR", help="cache folder (created if missing; then --budget is required)")
    p.add_argument("--budget", type=parse_bytes, metavar="SIZE", help="byte budget (e.g. 50G); default: the recorded one")
    p.add_argument("--tokens", action="store_true",
                   help="also tokenize every text object with the manifest's tokenizer and keep the tokens in the "
                        "cache (what loaderd and `sluice plan` read instead of tokenizing; docs/tokenize.md)")
    p.add_argument("--token-workers", type=ranged(int, 1, 1024, "--token-workers"), default=None, metavar="N",
                   help="with --tokens: tokenizing processes, one Rust thread each (default: CPUs available)")
    add_progress_argument(p)
    p.add_argument("--allow-root", action="append", metavar="ROOT",
                   help="a folder or URL prefix (s3://bucket/prefix/, gs://, az://, abfs://, hf://, "
                        "https://host/path/) object locations may lie within (repeatable); default: the manifest's "
                        "own folder only "
                        "(remote objects need an explicit URL root). A manifest with "
                        "any location outside is refused (exit 2) before anything is read")
    p.add_argument("--json", action="store_true", help="one JSON object (implies --no-progress)")
    p.set_defaults(func=_warm)


