"""`sluice manifest freeze`: resolve every alias of a dataset spec to immutable
objects, hash and count them, and write the manifest atomically.

Pipeline::

    spec.toml --load_dataset_spec--> DatasetSpec
      -> plan: per source, per alias (declared order): files | globs | folders
         (recursive, sorted) | symlinks (target recorded) | pointer files
         (`latest`, `*.pointer`) | s3://bucket/prefix (listed, ETag recorded) |
         gs:// az:// abfs:// hf:// objects, folders, globs (listed through fsspec) |
         http(s):// object URLs (one each: http cannot list; size from Content-Length);
         objects sorted by recorded location within an alias
      -> scan: process or thread pool (scan_pool.py), one object per task, BLAKE3 +
         record count + line check in one pass, results in plan order
      -> Manifest (start offsets in plan order) -> temp file + fsync + rename

Nothing is written until every object has been read successfully; on any error
or SIGINT no manifest and no temp file remain.
"""

from __future__ import annotations

import glob
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import ManifestError, SpecError
from sluice.fsutil import write_atomic
from sluice.manifest import formats, remote, scan_pool
from sluice.manifest.fields import is_digest
from sluice.manifest.inputs import read_input
from sluice.manifest.model import Manifest
from sluice.manifest.policies import TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source
from sluice.manifest.spec import DatasetSpec, SourceSpec, load_dataset_spec, packing_policy
from sluice.manifest.storage import S3Options, is_remote, is_s3, s3_filesystem, split_s3
from sluice.manifest.tokenizer_ref import load_tokenizer, settle_backend

POINTER_SUFFIX = ".pointer"
POINTER_NAMES = ("latest",)
MAX_POINTER_DEPTH = 8
MAX_POINTER_BYTES = 4096
@dataclass(frozen=True)
class _Planned:
    source: int
    alias: str
    path: str  # what to open: absolute local path or URI
    location: str  # what the manifest records
    size: int


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _is_pointer(path: str) -> bool:
    name = os.path.basename(path)
    return name in POINTER_NAMES or name.endswith(POINTER_SUFFIX)


def _read_pointer(path: str, where: str) -> str:
    # read_input refuses a FIFO (open would block) or a device named `latest`.
    data = read_input(path, f"{where}: pointer file", MAX_POINTER_BYTES, ManifestError)
    try:
        target = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: pointer file {path} is not UTF-8 text") from exc
    if not target or "\n" in target:
        raise ManifestError(f"{where}: pointer file {path} must hold exactly one path, got {target!r}")
    return target if os.path.isabs(target) else os.path.normpath(os.path.join(os.path.dirname(path), target))


def walk_folder(folder: str, fmt: str) -> list[str]:
    """The files of format `fmt` under `folder` (by suffix), hidden files and folders skipped, in sorted order.

    The one folder walk: freeze resolves a folder source by it, and `sluice run` finds its inputs by it, so both
    see the same files in the same order.
    """
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and name.lower().endswith(formats.FORMAT_SUFFIXES[fmt]):
                found.append(os.path.join(root, name))
    return sorted(found)


def _local_entry(path: str, fmt: str, where: str, depth: int = 0) -> list[str]:
    """Resolve one concrete local path to the real paths of its files."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ManifestError(f"{where}: dangling symlink {path} -> {os.readlink(path)}")
    if not os.path.exists(path):
        raise ManifestError(f"{where}: no such file or folder {path}")
    if os.path.isdir(path):
        files = walk_folder(path, fmt)
        if not files:
            raise ManifestError(
                f"{where}: folder {path} holds no {fmt} files ({', '.join(formats.FORMAT_SUFFIXES[fmt])})"
            )
        return [os.path.realpath(f) for f in files]
    if _is_pointer(path):
        if depth >= MAX_POINTER_DEPTH:
            raise ManifestError(f"{where}: pointer chain deeper than {MAX_POINTER_DEPTH} at {path} (a loop?)")
        target = _read_pointer(path, where)
        if not os.path.exists(target):
            raise ManifestError(f"{where}: dangling pointer {path} -> {target} (no such file or folder)")
        return _local_entry(target, fmt, where, depth + 1)
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        raise ManifestError(f"{where}: {path} is not a regular file")
    if not os.access(real, os.R_OK):
        raise ManifestError(f"{where}: {path} is not readable (permission denied)")
    return [real]


def _s3_alias(uri: str, fmt: str, where: str, s3: S3Options | None) -> list[tuple[str, int]]:
    """(uri, size) of every object an s3:// URI names: the object itself, or all under the prefix."""
    from pyarrow import fs as pafs

    bucket, key = split_s3(uri)
    try:
        fs = s3_filesystem(s3)
        if key and not key.endswith("/"):
            info = fs.get_file_info(f"{bucket}/{key}")
            if info.type == pafs.FileType.File:
                return [(uri, int(info.size))]
        if not key or key.endswith("/"):
            parent = key  # a "folder" prefix
        elif "/" in key:
            parent = key.rsplit("/", 1)[0] + "/"  # list its folder, then keep keys starting with `key`
        else:
            parent = ""
        selector = pafs.FileSelector(f"{bucket}/{parent}".rstrip("/"), recursive=True, allow_not_found=True)
        infos = fs.get_file_info(selector)
    except OSError as exc:
        raise ManifestError(f"{where}: cannot list {uri} ({exc})") from exc
    out = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        obj_key = info.path[len(bucket) + 1 :]
        if not obj_key.startswith(key):
            continue
        if not obj_key.lower().endswith(formats.FORMAT_SUFFIXES[fmt]):
            continue  # a prefix lists like a folder: only files of the source's format
        out.append((f"s3://{bucket}/{obj_key}", int(info.size)))
    if not out:
        raise ManifestError(f"{where}: s3 prefix {uri} matches no {fmt} objects")
    return sorted(out)


def _rel(real: str, out_dir: str) -> str:
    return os.path.relpath(real, out_dir).replace(os.sep, "/")


def _plan_source(i: int, src: SourceSpec, out_dir: str, spec_path: str, s3: S3Options | None) -> list[_Planned]:
    planned: list[_Planned] = []
    for alias, resolved in zip(src.paths, src.resolved):
        where = f"dataset spec {spec_path}: sources[{i}]({src.name}).paths {alias!r}"
        items: list[_Planned] = []
        if is_remote(resolved):
            # ETag/version are taken later from the response that is hashed (s3: the GET; fsspec
            # schemes: the HEAD that opened it), so they describe the bytes behind the digest.
            listed = (_s3_alias(resolved, src.format, where, s3) if is_s3(resolved)
                      else remote.list_alias(resolved, formats.FORMAT_SUFFIXES[src.format], src.format, where))
            for uri, size in listed:
                items.append(_Planned(i, alias, uri, uri, size))
        else:
            if _has_magic(resolved):
                matches = sorted(glob.glob(resolved, recursive=True))
                if not matches:
                    raise ManifestError(f"{where}: glob matches nothing")
            else:
                matches = [resolved]
            for m in matches:
                for real in _local_entry(m, src.format, where):
                    items.append(_Planned(i, alias, real, _rel(real, out_dir), os.path.getsize(real)))
        items.sort(key=lambda p: p.location)
        planned.extend(items)
    return planned


class Progress:
    """tqdm over bytes with an objects counter; a no-op when disabled."""

    def __init__(self, enabled: bool, total_bytes: int, total_objects: int, desc: str = "freeze") -> None:
        self.bar = None
        self.total_objects, self.done = total_objects, 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                            file=sys.stderr, dynamic_ncols=True)
            self.bar.set_postfix_str(f"0/{total_objects} objects")

    def bytes(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def object_done(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.done}/{self.total_objects} objects")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class ScanJob:
    """One object to hash, count and validate: all a worker needs, on this machine or another."""

    path: str  # local path or URI, read where it is
    fmt: str
    compression: str
    text_field: str
    where: str  # names the object in errors
    check: str


# (jobs, s3 options, progress) -> one ScanResult per job, in job order; raises the first failure.
ScanEngine = Callable[[list[ScanJob], "S3Options | None", "Progress"], list[formats.ScanResult]]


def scan_job(job: ScanJob, *, s3: S3Options | None = None, stop: threading.Event | None = None,
             on_bytes: Callable[[int], None] | None = None) -> formats.ScanResult:
    """The per-object work of freeze, whatever the engine: BLAKE3 + record count + validation in one pass."""
    return scan_pool.scan_one(job, s3, stop, on_bytes)


def scan_local(jobs: list[ScanJob], *, threads: int | None, s3: S3Options | None,
               progress: Progress, processes: int | None = None,
               sizes: list[int] | None = None) -> list[formats.ScanResult]:
    """The local engine: one object per task on a process pool sized to the node when the scans are
    GIL-bound and big (`scan_pool.choose_processes`; `processes` 0 = never, N = N), else on `threads`
    threads. Results in job order; on any failure the running scans stop."""
    workers = scan_pool.choose_processes(jobs, sizes or [0] * len(jobs), processes)
    if workers:
        return scan_pool.scan_processes(jobs, workers=workers, s3=s3, progress=progress)
    return scan_pool.scan_threads(jobs, threads=threads, s3=s3, progress=progress)


def _check_output(out: Path) -> None:
    if not out.parent.is_dir():
        raise ManifestError(f"output {out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise ManifestError(f"output {out}: is a folder")


def _token_lineage(header: dict[str, Any], tok: TokenizerRef | None, where: str) -> dict[str, Any]:
    if tok is None:
        raise ManifestError(f"{where}: a 'tokens' source needs the spec's `tokenizer` to check what made the shard")
    if header.get("tokenizer") != tok.digest:
        raise ManifestError(
            f"{where}: shard was made with tokenizer {header.get('tokenizer')!r}, the spec's tokenizer is {tok.digest}"
        )
    lineage: dict[str, Any] = {"tokenizer": tok.digest, "transform": str(header.get("transform", ""))}
    raw = header.get("raw")
    if raw is not None:
        if not is_digest(raw):
            raise ManifestError(f"{where}: shard header 'raw' is {raw!r:.80}, expected b3:<64 lowercase hex> or null")
        lineage["raw"] = raw
    return lineage


def freeze(
    spec_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    threads: int | None = None,
    processes: int | None = None,
    progress: bool | None = None,
    check: str = "full",
    s3: S3Options | None = None,
    engine: ScanEngine | None = None,
    notes: list[str] | None = None,
) -> Manifest:
    """Freeze the dataset spec at `spec_path` into a manifest written to `out_path`.

    Returns the Manifest (its `dataset_id` is what the CLI prints). The file's
    content is exactly `manifest.canonical_bytes()`. Raises SpecError /
    ManifestError / SourceReadError / TokenizerError naming file, field, object
    and line; on any error or interruption nothing is left at `out_path`.
    `check` is the jsonl validation level (formats.CHECKS). `progress`: a bar on
    stderr (None: when stderr is a terminal). `engine` runs the
    per-object scans (`scan_job` over the list, results in list order; default:
    `scan_local`: a process pool (`processes`: None = automatic, sized to the
    node, for big GIL-bound scans; 0 = never) or a thread pool of `threads`;
    the manifest bytes are the same either way; `sluice.engines.ray_engine` runs
    them as Ray tasks); this function plans before and writes the manifest after.
    A `tokenizer_backend` other than "hf" is proven on a sample of the local
    text objects before the manifest is written ("auto": the fastest proven is
    recorded); `notes`, if given, gets a line per backend decision.
    """
    spec: DatasetSpec = load_dataset_spec(spec_path)
    out = Path(out_path).absolute()
    _check_output(out)
    out_dir = str(Path(os.path.realpath(out.parent)))
    tok_ref = tok = None
    if spec.tokenizer is not None:
        tok_ref, tok = load_tokenizer(spec.tokenizer, _rel(os.path.realpath(spec.tokenizer), out_dir), spec.path,
                                      spec.tokenizer_backend)
    packing = packing_policy(spec.packing, (tok.token_to_id if tok is not None else lambda _s: None), spec.path)
    if tok_ref is not None:
        try:
            packing.check_vocabulary(tok_ref.vocab_size, "")
        except ManifestError as exc:
            raise SpecError(f"dataset spec {spec.path}: {exc} (tokenizer {spec.tokenizer})") from exc

    planned: list[_Planned] = []
    for i, src in enumerate(spec.sources):
        planned.extend(_plan_source(i, src, out_dir, spec.path, s3))
    seen: dict[str, _Planned] = {}
    for p in planned:
        if p.path in seen:
            first = seen[p.path]
            raise ManifestError(
                f"dataset spec {spec.path}: duplicate object {p.path}: listed by source "
                f"{spec.sources[first.source].name!r} (paths {first.alias!r}) and source "
                f"{spec.sources[p.source].name!r} (paths {p.alias!r})"
            )
        seen[p.path] = p

    jobs = [
        ScanJob(p.path, spec.sources[p.source].format, formats.compression_for(p.path),
                spec.sources[p.source].text_field, f"source {spec.sources[p.source].name!r} object {p.path}", check)
        for p in planned
    ]
    bar = Progress(sys.stderr.isatty() if progress is None else progress, sum(p.size for p in planned), len(planned))
    try:
        if engine is None:
            results = scan_local(jobs, threads=threads, s3=s3, progress=bar, processes=processes,
                                 sizes=[p.size for p in planned])
        else:
            results = engine(jobs, s3, bar)
    finally:
        bar.close()

    by_digest: dict[str, _Planned] = {}
    objects: list[list[ObjectRecord]] = [[] for _ in spec.sources]
    for p, res in zip(planned, results):
        src = spec.sources[p.source]
        where = f"source {src.name!r} object {p.path}"
        if res.size != p.size:
            raise ManifestError(f"{where}: size changed while freezing ({p.size} -> {res.size} bytes)")
        if res.records and res.digest in by_digest:
            other = by_digest[res.digest]
            raise ManifestError(
                f"{where}: same bytes ({res.digest}) as {other.path}; identical objects would share sample IDs"
            )
        if res.records:
            by_digest[res.digest] = p
        lineage = None
        if src.format == "tokens":
            lineage = _token_lineage(res.header or {}, tok_ref, where)
            assert tok_ref is not None  # _token_lineage refused a tokens source without one
            if res.top_token is not None and res.top_token >= tok_ref.vocab_size:
                raise ManifestError(
                    f"{where}: token id {res.top_token} is outside the tokenizer's vocabulary "
                    f"({tok_ref.vocab_size} ids: 0..{tok_ref.vocab_size - 1}); the shard was not made by this "
                    "tokenizer as its header says: make it again with `sluice tokenize pretokenize`"
                )
        start = sum(o.records for o in objects[p.source])
        objects[p.source].append(
            ObjectRecord(
                location=p.location,
                digest=res.digest,
                size=res.size,
                records=res.records,
                start=start,
                compression=formats.compression_for(p.path),
                alias=p.alias,
                etag=res.etag,
                version=res.version,
                lineage=lineage,
            )
        )
    manifest = Manifest(
        name=spec.name,
        tokenizer=tok_ref,
        packing=packing,
        mixture=spec.mixture,
        sources=tuple(
            Source(
                name=s.name,
                format=s.format,
                text_field=s.text_field,
                weight=s.weight,
                exhaustion=s.exhaustion,
                paths=s.paths,
                objects=tuple(objects[i]),
                split=s.split,
                filters=s.filters,
                dedup=s.dedup,
                notes=s.notes,
            )
            for i, s in enumerate(spec.sources)
        ),
        access=spec.access,
        notes=spec.notes,
        base_dir=out_dir,
    )
    if tok_ref is not None and spec.tokenizer_backend != "hf":
        manifest = settle_backend(manifest, spec.tokenizer_backend, f"dataset spec {spec.path}", notes)
    try:
        write_atomic(out, manifest.canonical_bytes())
    except OSError as exc:  # a full disk, a read-only folder, a quota
        raise ManifestError(f"output {out}: cannot write the manifest ({exc.strerror or exc}); nothing was written") from exc
    return manifest


def freeze_summary(manifest: Manifest, out_path: str, seconds: float) -> dict[str, Any]:
    """The `--json` answer of freeze."""
    return {
        "dataset_id": manifest.dataset_id,
        "manifest": str(out_path),
        "sources": len(manifest.sources),
        "objects": sum(len(s.objects) for s in manifest.sources),
        "records": sum(s.records for s in manifest.sources),
        "bytes": sum(s.bytes for s in manifest.sources),
        "tokenizer_backend": manifest.tokenizer.backend if manifest.tokenizer is not None else None,
        "seconds": round(seconds, 3),
    }
