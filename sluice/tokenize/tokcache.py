"""Tokens of a raw object as a derived node-cache object (docs/tokenize.md, "Tokens in the node cache").

The tokens of object `o` of source `s` under an encoder are a `.sltok` shard
(`sluice.manifest.token_shard`) stored in the node cache under the key
BLAKE3 of::

    {"kind": "sluice.derived/1", "raw": <object digest>, "tokenizer": <tokenizer digest>,
     "backend": "hf" | "tiktoken", "specials": "literal", "transform": "sluice-tokenize/1",
     "format": <source format>, "text_field": <source text field>}

so any change of bytes, tokenizer file, backend, transform version or reading
rule is another object. The cache writes it once (`put_derived`: one producer
per key across threads and processes, BLAKE3 of what was written recorded and
checked on verify-on-read), counts it in its budget, evicts it like any other
object, and every daemon and process on the node maps the same file.

`fill_tokens` is the producer: it streams the raw object in bounded chunks
(`iter_text_chunks`), encodes each chunk and appends it to a `ShardWriter`, so
memory is one chunk whatever the object's size. Callbacks let a reader serve
documents while the rest of the object is still being tokenized::

    got = fill_tokens(cache, manifest, s, o, encoder,
                      on_start=lambda reader: ..., on_chunk=lambda n_docs: ...)
    shard = open_shard(got.pin.path)   # got.stats is None on a hit (nothing tokenized)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import CacheError, CacheWriteError, ChunkDamaged, SluiceError, SourceReadError
from sluice.tokenize.encoder import TRANSFORM

CHUNK_BYTES = 1 << 20  # decoded input bytes per encode call (bounds the native Encodings alive at once)
FIRST_CHUNK_BYTES = 32 << 10  # the first chunk of an object: its first documents are ready sooner
CHUNK_RECORDS = 4096


@dataclass(frozen=True)
class FillStats:
    """What one fill did: documents and tokens written, seconds decoding and encoding."""

    documents: int
    tokens: int
    decode_seconds: float
    tokenize_seconds: float
    raw_bytes: int


@dataclass(frozen=True)
class Filled:
    """Outcome of `fill_tokens`.

    `pin`: the cached tokens, pinned (None when the cache could not keep what
    was made: then `reader` is a complete `PartialShard`, `note` says why
    naming the object and the cause, and the caller closes the reader).
    `held`: where such a reader's tokens are: "spool" (the unlinked file the
    fill wrote: the budget or the index refused it) or "memory" (the disk
    refused the file itself: tokenized again into memory, `memory_bytes`).
    `stats`: None when nothing was tokenized (a hit, or another process made them).
    """

    pin: Any
    stats: FillStats | None
    reader: Any = None
    note: str = ""
    held: str = ""


def token_key(manifest: Any, s: int, o: int, encoder: Any) -> dict[str, str]:
    """The derived-object key inputs of object `o` of source `s` under `encoder`."""
    src = manifest.sources[s]
    return {
        "raw": src.objects[o].digest,
        "tokenizer": encoder.digest,
        "backend": getattr(encoder, "backend", "hf"),
        "specials": encoder.specials_in_text,
        "transform": TRANSFORM,
        "format": src.format,
        "text_field": src.text_field,
    }


def lookup_tokens(cache: Any, manifest: Any, s: int, o: int, encoder: Any) -> Any | None:
    """The pinned cached tokens of the object, or None (never tokenizes)."""
    return cache.get_derived(token_key(manifest, s, o, encoder))


def fill_tokens(
    cache: Any,
    manifest: Any,
    s: int,
    o: int,
    encoder: Any,
    *,
    on_start: Callable[[Any], None] | None = None,
    on_chunk: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    chunk_records: int = CHUNK_RECORDS,
    cancelled: Callable[[], bool] | None = None,
    tokenize: Callable[[Path], tuple[Any, FillStats]] | None = None,
    raw: Any = None,
    memory_bytes: int = 0,
) -> Filled:
    """The pinned cached tokens of the object, tokenizing it if no process has.

    `on_start(reader)` gets a `PartialShard` over the shard being written
    (the caller then owns it and closes it); `on_chunk(n)` is called when
    documents [0, n) are readable from it. `cancelled()` is asked between
    chunks; when true the fill stops (nothing is published). `tokenize(tmp)`,
    if given, replaces the in-process tokenization: it writes the shard at
    `tmp` (e.g. from another process, `tokenize_into`) and returns (a
    PartialShard it handed to `on_start`, FillStats). Raises
    SourceReadError/DigestMismatch/CacheError naming the object on a bad raw
    object or a cache that cannot fill it; tokens made but not kept come back
    as a `Filled` with a reader (see there). `raw`: the raw object's pin if
    the caller already fetched it (kept open), else it is fetched here.

    A full disk (CacheWriteError: ENOSPC, EDQUOT, EIO, ... while writing the
    token file) with `memory_bytes > 0`: the object is tokenized again from
    its first record, in this thread, into anonymous memory of at most that
    many bytes, and comes back as a `Filled` with `held="memory"`. `on_start`
    then gets a second reader: the caller keeps serving from the first one
    (its documents stay readable: an unlinked file stays while open) until
    `on_chunk` reports the second one past them (entry.py, `Entry.start`).
    An encoder with a `restart()` method is told that the records start
    again from 0 (demand.FillEncoder). Without `memory_bytes` the error is raised.
    """
    src = manifest.sources[s]
    obj = src.objects[o]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    made: list[tuple[Any, FillStats]] = []

    def produce(tmp: Path) -> None:
        if tokenize is not None:
            made.append(tokenize(tmp))
            return
        made.append(tokenize_into(tmp, manifest, cache, encoder, s, o, on_start=on_start, on_chunk=on_chunk,
                                  chunk_bytes=chunk_bytes, chunk_records=chunk_records, cancelled=cancelled,
                                  raw=raw))

    # The reader belongs to the caller once `on_start` has it; else it is ours to close.
    try:
        pin = cache.put_derived(token_key(manifest, s, o, encoder), produce)
    except CacheError as exc:
        if made:
            reader, stats = made[0]  # made, but not kept (budget, index): still servable
            return Filled(None, stats, reader, f"{where}: tokens not kept in the node cache ({exc})", "spool")
        if not (memory_bytes > 0 and isinstance(exc, CacheWriteError)):
            raise
        # The disk refused the token file part way: what was written is lost with it (the first
        # reader still serves its documents), so the object is tokenized again into memory.
        restart = getattr(encoder, "restart", None)
        if restart is not None:
            restart()
        reader, stats = tokenize_into(None, manifest, cache, encoder, s, o, on_start=on_start, on_chunk=on_chunk,
                                      chunk_bytes=chunk_bytes, chunk_records=chunk_records, cancelled=cancelled,
                                      raw=raw, memory_bytes=memory_bytes)
        return Filled(None, stats, reader, f"{where}: the node cache's disk refused its tokens ({exc}); "
                      "tokenized again into memory and served from there", "memory")
    except BaseException:
        if made and on_start is None:
            made[0][0].close()
        raise
    if not made:
        return Filled(pin, None)
    if on_start is None:
        made[0][0].close()  # the caller maps the published file
    return Filled(pin, made[0][1])


def tokenize_into(
    tmp: Path | None,
    manifest: Any,
    cache: Any,
    encoder: Any,
    s: int,
    o: int,
    *,
    on_start: Callable[[Any], None] | None = None,
    on_chunk: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    chunk_records: int = CHUNK_RECORDS,
    cancelled: Callable[[], bool] | None = None,
    raw: Any = None,
    memory_bytes: int = 0,
) -> tuple[Any, FillStats]:
    """Write the object's token shard at `tmp`, chunk by chunk (the body of a fill).

    Returns (a PartialShard over it, FillStats); the reader is the caller's
    to close, or `on_start`'s owner's when given. A worker process runs this
    for `fill_tokens(tokenize=...)`, reporting progress with `on_chunk`.
    `tmp` None: the shard is written to anonymous memory of at most
    `memory_bytes` (ShardWriter), CacheError past it.
    """
    from sluice.manifest.token_shard import ShardWriter
    from sluice.tokenize.chunks import iter_text_chunks

    src = manifest.sources[s]
    obj = src.objects[o]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    given = raw is not None  # (a second fetch of a cached object re-hashes it when verify_on_read is set)
    if raw is None:
        raw = cache.fetch(obj, manifest.resolve(obj.location))
    try:
        guard = raw.guard()
        guard.ensure()  # (a no-op after the cache's verify-on-read) the bytes are verified before they are read
        writer = ShardWriter(f"(in memory) of {where}" if tmp is None else tmp, obj.records,
                             tokenizer=encoder.digest, vocab_size=encoder.vocab_size, raw=obj.digest,
                             transform=TRANSFORM, memory_bytes=memory_bytes if tmp is None else 0)
        reader = writer.reader()
        try:
            if on_start is not None:
                on_start(reader)
            t_decode = t_tokenize = 0.0
            mark = time.perf_counter()
            for texts in iter_text_chunks(raw.path, src.format, obj.compression, src.text_field, where,
                                          max_bytes=chunk_bytes, max_records=chunk_records,
                                          first_bytes=min(FIRST_CHUNK_BYTES, chunk_bytes)):
                t1 = time.perf_counter()
                t_decode += t1 - mark
                if cancelled is not None and cancelled():
                    raise SluiceError(f"{where}: tokenizing cancelled after {writer.docs} documents")
                if writer.docs + len(texts) > obj.records:
                    raise SourceReadError(f"{where}: more than the manifest's {obj.records} records")
                writer.add(encoder.encode_batch(texts))
                mark = time.perf_counter()
                t_tokenize += mark - t1
                if on_chunk is not None:
                    on_chunk(writer.docs)
            if writer.docs != obj.records:
                raise SourceReadError(f"{where}: decoded {writer.docs} records, manifest says {obj.records}")
            _unchanged(guard, where)  # what was read is what was verified: then the tokens may be published
            writer.finish()
        except BaseException as exc:
            writer.close()
            if on_start is None:
                reader.close()
            if isinstance(exc, SluiceError) and not isinstance(exc, ChunkDamaged):
                _unchanged(guard, where, exc)  # a decode error from bytes changed after verification says so
            raise
    finally:
        if not given:
            raw.close()
    return reader, FillStats(writer.docs, writer.tokens, t_decode, t_tokenize, obj.size)


def _unchanged(guard: Any, where: str, cause: BaseException | None = None) -> None:
    """Raise ChunkDamaged (from `cause`) if the raw object's file changed since its chunks were verified:
    damaged, or changed and restored while it was read (its tokens cannot be trusted either way)."""
    try:
        if guard.check():
            return
        damage = ChunkDamaged(f"{where}: the cached raw object changed while it was tokenized",
                              key=guard.key, chunk=-1)
    except ChunkDamaged as exc:
        damage = exc
    raise damage from cause


@dataclass(frozen=True)
class WarmReport:
    """What `warm_tokens` did: text objects seen, tokenized now, already cached, failures."""

    objects: int
    tokenized: int
    present: int
    tokens: int  # tokens written by this warm
    failures: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"objects": self.objects, "tokenized": self.tokenized, "present": self.present,
                "tokens": self.tokens, "failed": len(self.failures), "errors": list(self.failures)}


def warm_tokens(
    manifest: Any,
    cache: Any,
    encoder: Any,
    *,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> WarmReport:
    """Make sure the node cache holds the tokens of every text object of `manifest`.

    Every object is tried (a bad one does not stop the others); tokens the
    cache cannot keep (budget) count as failures, naming the object.
    `progress(raw_bytes)` is called after each object. `workers > 1`: a pool of
    that many processes (one Rust thread each) fills the cache; tokens travel
    as cache files, never through the pool's pipes.
    """
    seen: set[tuple[tuple[str, str], ...]] = set()
    tasks: list[tuple[int, int]] = []
    for s, src in enumerate(manifest.sources):
        if src.format == "tokens":
            continue
        for o in range(len(src.objects)):
            key = tuple(sorted(token_key(manifest, s, o, encoder).items()))
            if key not in seen:
                seen.add(key)
                tasks.append((s, o))
    if workers > 1 and len(tasks) > 1:
        outcomes = _warm_in_processes(manifest, cache, tasks, workers, progress)
    else:
        outcomes = []
        for s, o in tasks:
            outcomes.append(_warm_one(manifest, cache, encoder, s, o))
            if progress is not None:
                progress(manifest.sources[s].objects[o].size)
    failures = tuple(o[1] for o in outcomes if o[0] == "error")
    stats = [o[1] for o in outcomes if o[0] == "ok"]
    made = [st for st in stats if st is not None]
    return WarmReport(len(tasks), len(made), len(stats) - len(made), sum(st.tokens for st in made), failures)


def _warm_one(manifest: Any, cache: Any, encoder: Any, s: int, o: int) -> tuple[str, Any]:
    """("ok", FillStats | None if it was cached) or ("error", message): plain values for a pool."""
    try:
        got = fill_tokens(cache, manifest, s, o, encoder)
    except SluiceError as exc:  # report every bad object, not just the first
        return ("error", str(exc))
    if got.pin is None:
        got.reader.close()
        return ("error", got.note)
    got.pin.close()
    return ("ok", got.stats)


_WARM: tuple[Any, Any, Any] | None = None  # per worker process: (manifest, cache, encoder)


def _warm_init(manifest: Any, root: str, budget: int) -> None:
    global _WARM
    from sluice.cache import NodeCache
    from sluice.tokenize.encoder import encoder_for_manifest
    from sluice.tokenize.threads import configure_threads

    configure_threads(1)  # the processes are the parallelism
    cache = NodeCache(root, budget, collect=False)
    _WARM = (manifest, cache, encoder_for_manifest(manifest, cache=cache))  # a kept tiktoken encoding is read


def _warm_task(s: int, o: int) -> tuple[str, Any]:
    assert _WARM is not None, "bug in sluice: warm worker not initialised"
    manifest, cache, encoder = _WARM
    outcome = _warm_one(manifest, cache, encoder, s, o)
    cache.flush()  # counters of this process reach the index now, not at its exit
    return outcome


def _warm_in_processes(manifest: Any, cache: Any, tasks: list[tuple[int, int]], workers: int,
                       progress: Callable[[int], None] | None) -> list[tuple[str, Any]]:
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from sluice.procpool import ctrl_c_deferred, pool_context, stop_pool

    ctx = pool_context()  # Ctrl-C reaches this process only: it stops the pool (below)
    outcomes: list[tuple[str, Any]] = []
    todo = sorted(tasks, key=lambda t: -manifest.sources[t[0]].objects[t[1]].size)  # big ones first
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx, initializer=_warm_init,
                             initargs=(manifest, str(cache.root), cache.budget_bytes)) as pool:
        running: dict[Any, tuple[int, int]] = {}
        try:
            while todo or running:
                while todo and len(running) < 2 * workers:  # bounded queue, whatever the object count
                    s, o = todo.pop(0)
                    with ctrl_c_deferred():  # a submission may start a worker: never leave one half-started
                        running[pool.submit(_warm_task, s, o)] = (s, o)
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    s, o = running.pop(fut)
                    outcomes.append(fut.result())
                    if progress is not None:
                        progress(manifest.sources[s].objects[o].size)
        except BaseException:  # Ctrl-C: leave now, not after the queued objects are tokenized
            stop_pool(pool)  # a killed fill is debris the cache collects; what was published stays
            raise
    return outcomes
