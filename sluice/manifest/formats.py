"""The format registry: hash, count and validate source objects; read their texts.

Formats (`model.FORMATS`) and what a *record* is in each:

| format       | record                                   | text                                   |
| ------------ | ---------------------------------------- | -------------------------------------- |
| `jsonl`      | a non-empty line (empty = `""` or `"\\r"`) | the string under key `text_field`      |
| `parquet`    | a row (count from the file metadata)     | the string column `text_field`         |
| `webdataset` | a sample: consecutive tar members sharing a key (name up to the first dot of the basename) | member with suffix `text_field`, UTF-8 |
| `tokens`     | a document of a `.sltok` shard           | none (token ids, see token_shard.py)   |

Compression comes from the suffix (`.gz` -> gzip, `.zst`/`.zstd` -> zstd) and
applies to jsonl and webdataset; the object digest is always over the stored
(compressed) bytes.

One pass: `scan_object` reads each object once in big chunks, feeds every chunk
to BLAKE3 and, in the same loop, to the record counter/validator. The jsonl
record rule lives in `jsonl.py`, bounded decompression in `decode.py`, tar
streams in `tar_samples.py`.

Validation levels for jsonl (`check`, see `jsonl.py`):
* ``"full"`` (default): every non-empty line must be what `json.loads` reads
  as a JSON object with a string under `text_field`; a bad line is reported
  with object and line number. Checked a block of lines at a time in C
  (msgspec + numpy) when msgspec is installed, line by line otherwise.
* ``"count"``: records are counted from newlines (numpy compares over a
  reused buffer, no per-chunk allocation); lines are not parsed, so a bad
  line is only reported later, by `read_texts` (object + line number) when
  the daemon reads it. Use for corpora from a trusted pipeline.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from sluice.errors import Cancelled, SourceReadError
from sluice.manifest import token_shard
from sluice.manifest.decode import Decoder
from sluice.manifest.jsonl import JsonlScanner, scratch_for
from sluice.manifest.tar_samples import read_samples
from sluice.manifest.storage import S3Options, is_remote, open_input, open_random

CHUNK = 8 << 20  # raw read size: big enough that per-chunk Python overhead vanishes
# Read buffers kept for the next object of this process (more in use at once are
# freed when done): a fresh 8 MiB buffer costs 3-30 ms of allocation and page
# faults on first touch (timed alone at load 3-7), as long as hashing a 32 MiB object.
POOL_MAX = 2
# The longest document: a jsonl line or a webdataset text member. It bounds the
# line buffer (a newline-free bomb fails here, not in the allocator).
MAX_LINE_BYTES = 64 << 20
CHECKS = ("full", "count")

# Suffixes a directory walk picks up for each format (explicit files and glob
# matches are taken whatever their name).
FORMAT_SUFFIXES = {
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".ndjson", ".ndjson.gz", ".ndjson.zst"),
    "parquet": (".parquet",),
    "webdataset": (".tar", ".tar.gz", ".tgz", ".tar.zst"),
    "tokens": (".sltok",),
}


def compression_for(location: str) -> str:
    """Compression implied by a location's suffix: "gzip", "zstd" or "none"."""
    low = location.lower()
    if low.endswith((".gz", ".tgz")):
        return "gzip"
    if low.endswith((".zst", ".zstd")):
        return "zstd"
    return "none"


@dataclass
class ScanResult:
    digest: str
    size: int
    records: int
    header: dict[str, Any] | None = None  # the .sltok header for `tokens`
    etag: str | None = None  # object store ETag of the very response that was hashed
    version: str | None = None  # object store version ID, where the store has one
    top_token: int | None = None  # `tokens`: the largest token id stored (-1 when none), for the vocabulary check


_pools: dict[str, list[Any]] = {"read": [], "scratch": []}
_pool_lock = threading.Lock()


@contextmanager
def _pooled(kind: str) -> Iterator[Any]:
    """A CHUNK-sized buffer for one scan, reused across objects (at most POOL_MAX of a kind
    kept idle): "read" is a bytearray, "scratch" a numpy bool array (the newline count's)."""
    pool = _pools[kind]
    with _pool_lock:
        buf = pool.pop() if pool else None
    if buf is None:
        buf = bytearray(CHUNK) if kind == "read" else scratch_for(CHUNK)
    try:
        yield buf
    finally:
        with _pool_lock:
            if len(pool) < POOL_MAX:
                pool.append(buf)


def _store_identity(raw: Any) -> tuple[str | None, str | None]:
    """(ETag, version) from a store's response metadata (pyarrow's S3 stream, remote.RemoteReader);
    (None, None) for local files."""
    get_meta = getattr(raw, "metadata", None)
    if get_meta is None:
        return None, None
    try:
        meta = get_meta() or {}
    except (OSError, AttributeError):
        return None, None

    def value(*names: str) -> str | None:
        for name in names:
            for key in (name, name.encode()):  # pyarrow gives str keys, bytes values
                v = meta.get(key)
                if v:
                    return (v.decode() if isinstance(v, bytes) else str(v)).strip('"') or None
        return None

    return value("ETag", "etag"), value("VersionId", "x-amz-version-id")


@dataclass
class _Reader(io.RawIOBase):
    """A raw reader that hashes (and counts) every byte that passes through it."""

    raw: Any
    stop: threading.Event | None = None
    on_bytes: Callable[[int], None] | None = None
    hasher: Any = None  # a blake3 hasher, or None to only count bytes
    size: int = 0
    etag: str | None = None
    version: str | None = None

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.stop is not None and self.stop.is_set():
            raise Cancelled()
        data = self.raw.read(CHUNK if n is None or n < 0 else n)
        if data:
            if self.hasher is not None:
                self.hasher.update(data)
            self.size += len(data)
            if self.on_bytes is not None:
                self.on_bytes(len(data))
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def fill(self, buf: bytearray) -> int:
        """Read up to len(buf) bytes into `buf` (no allocation); returns the count, 0 at the end."""
        if self.stop is not None and self.stop.is_set():
            raise Cancelled()
        n = self.raw.readinto(buf) or 0
        if n:
            if self.hasher is not None:
                self.hasher.update(memoryview(buf)[:n])
            self.size += n
            if self.on_bytes is not None:
                self.on_bytes(n)
        return n

    def drain(self) -> None:
        with _pooled("read") as buf:
            while self.fill(buf):
                pass

    @property
    def digest(self) -> str:
        return "b3:" + self.hasher.hexdigest()


def _jsonl(
    src: _Reader, compression: str, where: str, text_field: str, check: str, collect: bool, max_line: int
) -> JsonlScanner:
    scanner = JsonlScanner(where, text_field, check, collect, max_line)
    dec = Decoder(compression, where) if compression != "none" else None
    if dec is None:
        # One pass, no per-chunk allocation: read into one reused buffer,
        # hash it and count/check it in place.
        count = check == "count" and not collect
        with _pooled("read") as buf, _pooled("scratch") as scratch:
            scanner.scratch = scratch
            while n := src.fill(buf):
                if count:
                    scanner._count(buf, n)
                else:
                    scanner.feed(buf, n)
        scanner.finish()
        return scanner
    with _pooled("read") as buf:  # the stored bytes, read in place (the decoder copies what it keeps)
        while n := src.fill(buf):
            for part in dec.feed(memoryview(buf)[:n]):
                if part:
                    scanner.feed(part)
    dec.finish()
    scanner.finish()
    return scanner


def _parquet_file(location: str, where: str, s3: S3Options | None) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if is_remote(location):
            return pq.ParquetFile(open_random(location, s3))
        return pq.ParquetFile(location)
    except (pa.ArrowException, OSError) as exc:
        raise SourceReadError(f"{where}: not a readable parquet file ({exc})") from exc


def _parquet_rows(location: str, where: str, text_field: str, s3: S3Options | None) -> int:
    import pyarrow as pa

    pf = _parquet_file(location, where, s3)
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise SourceReadError(f"{where}: parquet column {text_field!r} not found (columns: {schema.names})")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise SourceReadError(f"{where}: parquet column {text_field!r} has type {typ}, expected string")
    meta = pf.metadata
    col = schema.get_field_index(text_field)
    for rg in range(meta.num_row_groups):
        stats = meta.row_group(rg).column(col).statistics
        if stats is not None and stats.has_null_count and stats.null_count:
            raise SourceReadError(f"{where}: parquet column {text_field!r} has {stats.null_count} null(s) in row group {rg}")
    return int(meta.num_rows)


def _tokens(src: _Reader, where: str) -> tuple[int, dict[str, Any], int]:
    """(records, header, largest token id or -1) of a `.sltok` object, in the one pass that hashes it.

    The largest id is taken as the bytes pass (numpy's max over each read, ~10 GB/s): a shard made
    by hand can hold ids its tokenizer never gives, which no later reader checks (the digest then
    vouches for the bytes), so freeze compares it with the vocabulary."""
    header, data = token_shard.read_header(src, where)
    dtype = token_shard.DTYPES[header["dtype"]]
    tokens_at = data + 8 * (header["n_docs"] + 1)
    top, carry = -1, b""  # carry: a token's first bytes at the end of one read
    with _pooled("read") as buf:
        while True:
            at = src.size
            n = src.fill(buf)
            if not n:
                break
            view = memoryview(buf)[max(tokens_at - at, 0):n] if at + n > tokens_at else memoryview(b"")
            if carry and len(view):
                k = min(dtype.itemsize - len(carry), len(view))
                carry, view = carry + bytes(view[:k]), view[k:]
                if len(carry) == dtype.itemsize:
                    top, carry = max(top, int(np.frombuffer(carry, dtype)[0])), b""
            whole = len(view) - len(view) % dtype.itemsize
            if whole:
                top = max(top, int(np.frombuffer(view[:whole], dtype).max()))
            if whole < len(view):
                carry += bytes(view[whole:])
    need = tokens_at + dtype.itemsize * header["n_tokens"]
    if src.size != need:
        raise SourceReadError(f"{where}: size {src.size} bytes, header implies {need} (truncated or padded)")
    return int(header["n_docs"]), header, top


@contextmanager
def _reading(
    location: str,
    where: str,
    *,
    s3: S3Options | None = None,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    hashing: bool = True,
) -> Iterator[_Reader]:
    """Open `location` as a (hashing) _Reader; I/O failures become SourceReadError naming `where`."""
    raw = open_input(location, s3)
    try:
        try:
            reader = _Reader(raw, stop, on_bytes, blake3.blake3() if hashing else None)
            reader.etag, reader.version = _store_identity(raw)
            yield reader
        except OSError as exc:
            raise SourceReadError(f"{where}: read failed ({exc})") from exc
    finally:
        raw.close()


def scan_object(
    location: str,
    fmt: str,
    compression: str,
    text_field: str,
    *,
    where: str | None = None,
    check: str = "full",
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    s3: S3Options | None = None,
    max_line: int = MAX_LINE_BYTES,
) -> ScanResult:
    """Hash, measure and count the records of one object in a single pass.

    Raises SourceReadError naming the object (and line/record/member) when it
    cannot be read or breaks its format, or a document (jsonl line, webdataset
    text member) is longer than `max_line` bytes; `Cancelled` when `stop` gets set.
    Memory stays bounded whatever the object's size or compression ratio.
    """
    where = where or f"object {location}"
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}")
    if fmt in ("parquet", "tokens") and compression != "none":
        raise SourceReadError(f"{where}: format {fmt!r} cannot be {compression}-compressed")
    header, top = None, None
    with _reading(location, where, s3=s3, stop=stop, on_bytes=on_bytes) as src:
        if fmt == "jsonl":
            records = _jsonl(src, compression, where, text_field, check, False, max_line).records
        elif fmt == "webdataset":
            records, _ = read_samples(src, compression, where, text_field, check, False, max_line)
        elif fmt == "tokens":
            records, header, top = _tokens(src, where)
        elif fmt == "parquet":
            src.drain()
            records = _parquet_rows(location, where, text_field, s3)
        else:
            raise SourceReadError(f"{where}: unknown format {fmt!r}")
    return ScanResult(src.digest, src.size, records, header, src.etag, src.version, top)


def hash_object(
    location: str,
    *,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    s3: S3Options | None = None,
) -> tuple[str, int]:
    """BLAKE3 digest (`b3:<hex>`) and size of an object's stored bytes."""
    with _reading(location, f"object {location}", s3=s3, stop=stop, on_bytes=on_bytes) as src:
        src.drain()
    return src.digest, src.size


def count_records(
    local_path: str, fmt: str, compression: str, text_field: str, where: str, check: str = "full",
    max_line: int = MAX_LINE_BYTES,
) -> int:
    """Number of records in an object, validating each (see the module docstring)."""
    return scan_object(local_path, fmt, compression, text_field, where=where, check=check, max_line=max_line).records


def read_texts(
    local_path: str, fmt: str, compression: str, text_field: str, where: str, max_line: int = MAX_LINE_BYTES
) -> list[str]:
    """Every document text of one object, in record order (element i = record i).

    Raises SourceReadError naming `where` and the line/record at fault. Pre-
    tokenized `tokens` objects have no texts (use token_shard.open_shard).
    """
    if fmt == "tokens":
        raise SourceReadError(f"{where}: format 'tokens' holds token ids, not texts; open it with token_shard.open_shard")
    if fmt == "parquet":
        import pyarrow as pa

        if compression != "none":
            raise SourceReadError(f"{where}: format 'parquet' cannot be {compression}-compressed")
        pf = _parquet_file(local_path, where, None)
        try:
            column = pf.read(columns=[text_field]).column(text_field)
        except (pa.ArrowException, KeyError) as exc:
            raise SourceReadError(f"{where}: cannot read parquet column {text_field!r} ({exc})") from exc
        texts = column.to_pylist()
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise SourceReadError(f"{where}: record {i}: column {text_field!r} is {t!r}, expected a string")
        return texts
    # No hashing here: the cache verified the digest when it fetched the object.
    with _reading(local_path, where, hashing=False) as src:
        if fmt == "jsonl":
            out = _jsonl(src, compression, where, text_field, "full", True, max_line).texts
        elif fmt == "webdataset":
            _, out = read_samples(src, compression, where, text_field, "full", True, max_line)
        else:
            raise SourceReadError(f"{where}: unknown format {fmt!r}")
    return out if out is not None else []
