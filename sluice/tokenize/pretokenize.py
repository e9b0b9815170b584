"""Pre-tokenize a manifest: one `.sltok` shard per raw object, plus a derived manifest.

``pretokenize(manifest, "out/")`` writes::

    out/manifest.json                 derived manifest (canonical bytes)
    out/tokenizer.json                copy of the manifest's tokenizer (same digest)
    out/shards/<raw hex>.<key>.sltok  one shard per distinct raw object

For each object of each source whose format is not ``tokens``:

1. the raw bytes are verified against the manifest (size and BLAKE3; a local
   file is hashed, then read, and its inode/size/mtime must be unchanged
   afterwards; an ``s3://`` object is streamed into a temporary file while
   hashing) -- a mismatch raises DigestMismatch naming object, expected and
   actual digest;
2. its documents are read in bounded chunks (`sluice.tokenize.chunks`, the
   record rules of `sluice.manifest.formats`) and must
   number exactly the object's `records`;
3. they are encoded with `Encoder.encode_batch` (no bos/eos; framing is the
   packer's job) and written with `write_shard`, whose header names the raw
   digest, the tokenizer digest and `TRANSFORM`.

The shard name is the raw digest plus 16 hex of ``BLAKE3(raw, tokenizer,
transform, format, text_field)``: content-addressed by its inputs, so the same
raw object read the same way maps to one file.

The derived manifest keeps name, packing, mixture, access and notes; each
source keeps name, weight, exhaustion and the rest, with format ``tokens``
and objects = the shards: their own digest and size, the raw object's records
and start, compression ``none``, alias ``derived`` and lineage ``{"raw",
"tokenizer", "transform"}`` (so `ObjectRecord.sample_key`, and with it every
sample ID, is unchanged). Sources already of format ``tokens`` are carried
over, their locations rewritten relative to the output folder.

Parallelism: objects are tokenized by a pool of worker *processes* (forkserver
where available, else spawn; never fork, which would copy a tokenizers thread
pool) that each encode with one Rust thread. Output bytes do not depend on the
worker count or completion order: each shard is a pure function of its inputs
and the manifest is assembled in manifest order. Memory per worker: one
object's token arrays (about 2x their size while the shard is written) plus
one bounded chunk of texts and its encodings.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import blake3
import numpy as np

from sluice.errors import DigestMismatch, SourceReadError, TokenizerError
from sluice.manifest.canonical import canonical_bytes, digest_id
from sluice.fsutil import hash_file, hash_stream, write_atomic
from sluice.manifest.model import Manifest
from sluice.manifest.policies import TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source
from sluice.manifest.storage import S3Options, is_remote, open_input
from sluice.tokenize.encoder import TRANSFORM, Encoder, load_tokenizer
from sluice.tokenize.threads import configure_threads
SHARD_DIR = "shards"


@dataclass(frozen=True)
class ShardTask:
    key: str  # shard file name
    source: str
    location: str  # as written in the manifest
    path: str  # resolved local path or s3:// URI
    digest: str
    size: int
    records: int
    fmt: str
    compression: str
    text_field: str
    out_path: str


@dataclass(frozen=True)
class ShardDone:
    key: str
    digest: str
    size: int
    documents: int
    tokens: int


# (tasks, tokenizer path, tokenizer digest, progress, tokenizer backend) -> {shard key: ShardDone};
# raises the first failure.
ShardEngine = Callable[[list[ShardTask], str, str, "bool | None", str], dict[str, ShardDone]]


@dataclass(frozen=True)
class PretokenizeResult:
    manifest: Manifest
    path: str  # the derived manifest.json
    dataset_id: str
    objects: int  # shards written
    documents: int
    tokens: int
    raw_bytes: int
    seconds: float


def shard_name(raw_digest: str, tokenizer_digest: str, fmt: str, text_field: str, backend: str = "hf") -> str:
    """Content-addressed shard file name for a raw object read as (`fmt`, `text_field`) by `backend`."""
    inputs = {"raw": raw_digest, "tokenizer": tokenizer_digest, "transform": TRANSFORM, "format": fmt, "text_field": text_field}
    if backend != "hf":  # hf names stay as they were before backends existed
        inputs["backend"] = backend
    key = blake3.blake3(canonical_bytes(inputs)).hexdigest()
    return f"{raw_digest[3:]}.{key[:16]}.sltok"


def _mismatch(task: ShardTask, actual_digest: str, actual_size: int) -> DigestMismatch:
    return DigestMismatch(
        f"object {task.location} of source {task.source!r}: expected {task.digest} ({task.size} bytes), "
        f"actual {actual_digest} ({actual_size} bytes); the raw object changed after the manifest was frozen"
    )


def _stat_key(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _verified_chunks(task: ShardTask, tmp_dir: str, s3: S3Options | None = None) -> Iterator[list[str]]:
    """The object's documents in bounded chunks, read from bytes whose digest matches the manifest."""
    from sluice.tokenize.chunks import iter_text_chunks

    where = f"object {task.location} of source {task.source!r}"
    count = 0
    if is_remote(task.path):
        # Stream to a private temp file while hashing, then parse that exact file.
        fd, tmp = tempfile.mkstemp(prefix=f".raw-{os.getpid()}-", dir=tmp_dir)  # pid: see _remove_debris
        try:
            with os.fdopen(fd, "wb") as sink, open_input(task.path, s3) as stream:
                digest, size = hash_stream(stream, sink)
            if digest != task.digest or size != task.size:
                raise _mismatch(task, digest, size)
            for texts in iter_text_chunks(tmp, task.fmt, task.compression, task.text_field, where):
                count += len(texts)
                yield texts
        finally:
            Path(tmp).unlink(missing_ok=True)
    else:
        try:
            before = _stat_key(task.path)
        except FileNotFoundError as exc:
            raise SourceReadError(f"{where}: no such file {task.path}") from exc
        with open_input(task.path) as stream:
            digest, size = hash_stream(stream)
        if digest != task.digest or size != task.size:
            raise _mismatch(task, digest, size)
        for texts in iter_text_chunks(task.path, task.fmt, task.compression, task.text_field, where):
            count += len(texts)
            yield texts
        # The reader re-opens the file: the bytes it parsed are the verified
        # ones only if the file was not replaced or rewritten in between.
        if _stat_key(task.path) != before:
            raise DigestMismatch(
                f"{where}: file {task.path} changed while it was being pre-tokenized (expected {task.digest})"
            )
    if count != task.records:
        raise SourceReadError(f"{where}: {count} documents read, the manifest records {task.records}")


def tokenize_object(encoder: Encoder, task: ShardTask, s3: S3Options | None = None) -> ShardDone:
    """The per-object work of pretokenize, whatever the engine: verify, decode, tokenize, write the shard."""
    docs: list[np.ndarray] = []  # token arrays only: texts are held one bounded chunk at a time
    for texts in _verified_chunks(task, str(Path(task.out_path).parent), s3):
        docs.extend(encoder.encode_batch(texts))
    size = _write(task, encoder, docs)
    digest, hashed = hash_file(task.out_path)
    if hashed != size:  # pragma: no cover - the file is ours and was just renamed into place
        raise SourceReadError(f"shard {task.out_path}: {hashed} bytes on disk, {size} written")
    return ShardDone(task.key, digest, size, len(docs), int(sum(len(d) for d in docs)))


def _write(task: ShardTask, encoder: Encoder, docs: list[np.ndarray]) -> int:
    from sluice.manifest.token_shard import write_shard

    return write_shard(
        task.out_path, docs, tokenizer=encoder.digest, raw=task.digest, transform=TRANSFORM, vocab_size=encoder.vocab_size
    )


# Per worker process: the encoder, loaded once by the pool initializer, and
# the S3 options read by the parent at call time (a forkserver child inherits
# the environment of the fork server, not the caller's current one).
_WORKER_ENCODER: Encoder | None = None
_WORKER_S3: S3Options | None = None


def _init_worker(tokenizer_path: str, tokenizer_digest: str, s3: S3Options, backend: str = "hf") -> None:
    global _WORKER_ENCODER, _WORKER_S3
    configure_threads(1)  # processes are the parallelism; one Rust thread each
    _WORKER_ENCODER = load_tokenizer(tokenizer_path, tokenizer_digest, backend=backend)
    _WORKER_S3 = s3


def _worker(task: ShardTask) -> ShardDone:
    if _WORKER_ENCODER is None:  # pragma: no cover - the initializer always runs first
        raise TokenizerError("pretokenize worker started without its tokenizer")
    return tokenize_object(_WORKER_ENCODER, task, _WORKER_S3)


def _mp_context() -> multiprocessing.context.BaseContext:
    from sluice.procpool import pool_context

    return pool_context()  # Ctrl-C reaches this process only: it stops the pool (_run_tasks)


def _relocate(location: str, manifest: Manifest, out_dir: Path) -> str:
    """A location of `manifest`, rewritten to resolve the same from `out_dir`."""
    if is_remote(location) or os.path.isabs(location):
        return location
    return Path(os.path.relpath(os.path.abspath(manifest.resolve(location)), out_dir)).as_posix()


def pretokenize(
    manifest: Manifest,
    out_dir: str | os.PathLike[str],
    *,
    workers: int = 1,
    progress: bool | None = None,
    engine: ShardEngine | None = None,
) -> PretokenizeResult:
    """Tokenize every raw object of `manifest` into `out_dir` and write the derived manifest.

    `workers` processes (>= 1) tokenize objects in parallel; the output is
    byte-identical for any worker count. `progress`: a tqdm bar on stderr
    (None = only when stderr is a terminal). Raises TokenizerError (no or wrong
    tokenizer), DigestMismatch (raw bytes changed), SourceReadError (unreadable
    object or wrong record count). `engine` runs `tokenize_object` over the
    tasks (default: a pool of `workers` processes; `sluice.engines.ray_engine`
    runs them as Ray tasks); the manifest is assembled and written here, last.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TokenizerError(f"pretokenize workers: expected an integer >= 1, got {workers!r}")
    if manifest.tokenizer is None:
        raise TokenizerError(f"manifest {manifest.name!r} names no tokenizer; pretokenize needs one")
    started = time.perf_counter()
    out = Path(out_dir).resolve()
    if manifest.base_dir and out == Path(manifest.base_dir).resolve():
        raise TokenizerError(
            f"pretokenize output {out}: is the raw manifest's own folder; the derived dataset needs its own folder"
        )
    tok_path = manifest.resolve(manifest.tokenizer.location)
    if is_remote(tok_path):
        raise TokenizerError(f"manifest {manifest.name!r}: tokenizer {tok_path} must be a local file")
    # refuses a changed tokenizer (and one its backend cannot represent) up front
    encoder = load_tokenizer(tok_path, manifest.tokenizer.digest, backend=manifest.tokenizer.backend)
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    tasks: dict[str, ShardTask] = {}
    plan: list[tuple[Source, list[str]]] = []  # per raw source: the shard key of each object
    for src in manifest.sources:
        if src.format == "tokens":
            plan.append((src, []))
            continue
        keys = []
        for obj in src.objects:
            key = shard_name(obj.digest, encoder.digest, src.format, src.text_field, encoder.backend)
            keys.append(key)
            if key not in tasks:
                tasks[key] = ShardTask(
                    key=key,
                    source=src.name,
                    location=obj.location,
                    path=manifest.resolve(obj.location),
                    digest=obj.digest,
                    size=obj.size,
                    records=obj.records,
                    fmt=src.format,
                    compression=obj.compression,
                    text_field=src.text_field,
                    out_path=str(out / SHARD_DIR / key),
                )
        plan.append((src, keys))

    if engine is None:
        done = _run_tasks(list(tasks.values()), tok_path, encoder.digest, workers, progress, encoder.backend)
    else:
        done = engine(list(tasks.values()), tok_path, encoder.digest, progress, encoder.backend)

    sources = []
    for src, keys in plan:
        if src.format == "tokens":
            objects = tuple(replace(o, location=_relocate(o.location, manifest, out)) for o in src.objects)
            sources.append(replace(src, objects=objects))
            continue
        objects = []
        for obj, key in zip(src.objects, keys):
            result = done[key]
            objects.append(
                ObjectRecord(
                    location=f"{SHARD_DIR}/{key}",
                    digest=result.digest,
                    size=result.size,
                    records=obj.records,
                    start=obj.start,
                    compression="none",
                    alias="derived",
                    lineage={"raw": obj.digest, "tokenizer": encoder.digest, "transform": TRANSFORM},
                )
            )
        sources.append(replace(src, format="tokens", objects=tuple(objects)))

    # The derived dataset carries its own copy of the tokenizer, so the folder
    # is self-contained; same bytes, same digest.
    tok_bytes = Path(tok_path).read_bytes()
    if digest_id(tok_bytes) != encoder.digest:
        raise TokenizerError(f"tokenizer {tok_path}: changed while pre-tokenizing (expected {encoder.digest})")
    write_atomic(out / "tokenizer.json", tok_bytes)
    derived = Manifest(
        name=manifest.name,
        tokenizer=TokenizerRef(
            location="tokenizer.json",
            digest=manifest.tokenizer.digest,
            version=manifest.tokenizer.version,
            vocab_size=manifest.tokenizer.vocab_size,
            backend=manifest.tokenizer.backend,
        ),
        packing=manifest.packing,
        mixture=manifest.mixture,
        sources=tuple(sources),
        access=manifest.access,
        notes=dict(manifest.notes),
        base_dir=str(out),
    )
    data = derived.canonical_bytes()
    write_atomic(out / "manifest.json", data)
    return PretokenizeResult(
        manifest=derived,
        path=str(out / "manifest.json"),
        dataset_id=digest_id(data),
        objects=len(done),
        documents=sum(d.documents for d in done.values()),
        tokens=sum(d.tokens for d in done.values()),
        raw_bytes=sum(t.size for t in tasks.values()),
        seconds=time.perf_counter() - started,
    )


def _run_tasks(tasks: list[ShardTask], tok_path: str, tok_digest: str, workers: int, progress: bool | None,
               backend: str = "hf") -> dict[str, ShardDone]:
    from tqdm import tqdm

    from sluice.procpool import ctrl_c_deferred, stop_pool

    done: dict[str, ShardDone] = {}
    if not tasks:
        return done
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(
        total=sum(t.size for t in tasks), unit="B", unit_scale=True, desc="pretokenize", file=sys.stderr, disable=not show
    )
    # Biggest objects first: fewer stragglers at the end (order does not affect output).
    ordered = sorted(tasks, key=lambda t: (-t.size, t.key))
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(tasks)),
        mp_context=_mp_context(),
        initializer=_init_worker,
        initargs=(tok_path, tok_digest, S3Options.from_env(), backend),
    )
    try:
        # At most 2 tasks in flight per worker: the queue stays bounded however many objects there are.
        pending: dict[Future[ShardDone], ShardTask] = {}
        queue = iter(ordered)
        limit = 2 * min(workers, len(tasks))
        for task in queue:
            with ctrl_c_deferred():  # a submission may start a worker: never leave one half-started
                pending[pool.submit(_worker, task)] = task
            if len(pending) >= limit:
                break
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                task = pending.pop(fut)
                result = fut.result()  # re-raises the worker's SluiceError as is
                done[result.key] = result
                bar.update(task.size)
                nxt = next(queue, None)
                if nxt is not None:
                    with ctrl_c_deferred():
                        pending[pool.submit(_worker, nxt)] = nxt
    except KeyboardInterrupt:  # Ctrl-C: leave now, not after the running objects are tokenized
        _remove_debris(Path(tasks[0].out_path).parent, stop_pool(pool))
        raise
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    return done


def _remove_debris(shards: Path, pids: list[int]) -> None:
    """The temporary files terminated workers `pids` left in `shards` (a shard being written, an S3 copy)."""
    for pid in pids:
        for path in [*shards.glob(f".*.tmp-{pid}"), *shards.glob(f".raw-{pid}-*")]:
            path.unlink(missing_ok=True)
