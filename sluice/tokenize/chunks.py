"""The texts of one raw object, streamed in bounded chunks (record order).

`iter_text_chunks` yields lists of document texts, each list at most
`max_records` texts and at most `max_bytes` characters plus its last text
(parquet: `max_records` rows per batch), so the memory of a reader does not depend on the
object's size or its compression ratio::

    for texts in iter_text_chunks(path, "jsonl", "zstd", "text", where, max_bytes=1 << 20):
        encoder.encode_batch(texts)      # one bounded chunk at a time

Decompression reads at most `_READ` decoded bytes at a time (gzip's and
zstd's stream readers bound their output per read), whatever the ratio: a
megabyte of gzip that expands to gigabytes is decoded window by window.

The record rules are the manifest's (docs/manifest.md, `sluice.manifest.formats`):
jsonl lines go through the same line parser that freezing uses (`JsonlScanner`:
blank lines are not records, each record is a JSON object with a string under
`text_field`, errors name the object and the line); a webdataset record is a
run of tar members sharing a key; parquet rows are read batch by batch.
The object's bytes were verified by the node cache before they are read here.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any, BinaryIO

from sluice.errors import SourceReadError
from sluice.manifest.decode import DecodedReader  # the freeze's bounded decoder and its truncation check
from sluice.manifest.jsonl import JsonlScanner  # the freeze's own line rule and its errors
from sluice.manifest.tar_samples import MAX_MEMBER_BYTES, member_key  # the member rule and size limit

_READ = 256 << 10  # decoded bytes per read


def decoded_stream(raw: BinaryIO, compression: str, where: str) -> Any:
    """A file-like of the decoded bytes whose read(n) returns at most n bytes.

    Compressed objects go through the freeze's own decoder (`DecodedReader`):
    bounded output per call whatever the compression ratio, and a stream cut
    inside a zstd frame or gzip member is a SourceReadError naming `where`
    (zstandard's stream reader would end quietly there, reading a shorter
    object).
    """
    if compression == "none":
        return raw
    if compression in ("gzip", "zstd"):
        return DecodedReader(raw, compression, where)
    raise SourceReadError(f"{where}: unknown compression {compression!r}")


def iter_text_chunks(
    path: str,
    fmt: str,
    compression: str,
    text_field: str,
    where: str,
    *,
    max_bytes: int = 1 << 20,
    max_records: int = 4096,
    first_bytes: int | None = None,
) -> Iterator[list[str]]:
    """Yield the object's document texts in record order, in bounded chunks.

    `first_bytes` (default `max_bytes`) bounds the first chunk; each next
    chunk's bound doubles up to `max_bytes`: the first documents are ready
    sooner, later chunks amortize the per-call cost.

    Raises SourceReadError naming `where` (and the line or record) on a bad
    record or a corrupt stream. The caller checks the total against the
    manifest's record count.
    """
    if max_bytes < 1 or max_records < 1:
        raise SourceReadError(f"{where}: chunk bounds must be positive (max_bytes={max_bytes}, max_records={max_records})")
    if fmt == "parquet":
        yield from _parquet(path, compression, text_field, where, max_records)
        return
    if fmt not in ("jsonl", "webdataset"):
        raise SourceReadError(f"{where}: format {fmt!r} has no texts to tokenize")
    try:
        with ExitStack() as stack:
            raw = stack.enter_context(open(path, "rb"))
            stream = decoded_stream(raw, compression, where)
            if stream is not raw:
                stack.callback(stream.close)
            if fmt == "jsonl":
                yield from _jsonl(stream, text_field, where, _limits(first_bytes, max_bytes), max_records)
            else:
                yield from _webdataset(stream, text_field, where, _limits(first_bytes, max_bytes), max_records)
    except OSError as exc:  # gzip raises BadGzipFile (an OSError), files EIO
        raise SourceReadError(f"{where}: cannot decode ({exc})") from exc
    except EOFError as exc:
        raise SourceReadError(f"{where}: truncated {compression} stream ({exc})") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("zstd"):  # zstandard.ZstdError
            raise SourceReadError(f"{where}: corrupt zstd stream ({exc})") from exc
        raise


def _limits(first: int | None, top: int) -> Iterator[int]:
    limit = max(1, min(first or top, top))
    while True:
        yield limit
        limit = min(2 * limit, top)


def _jsonl(stream: Any, text_field: str, where: str, limits: Iterator[int], max_records: int) -> Iterator[list[str]]:
    scanner = JsonlScanner(where, text_field, "full", True)
    chunk: list[str] = []
    size = 0
    max_bytes = next(limits)
    done = False
    while not done:
        piece = stream.read(_READ)
        if piece:
            scanner.feed(piece)
        else:
            scanner.finish()
            done = True
        texts, scanner.texts = scanner.texts or [], []
        for text in texts:
            chunk.append(text)
            size += len(text)
            if len(chunk) >= max_records or size >= max_bytes:
                yield chunk
                chunk, size, max_bytes = [], 0, next(limits)
    if chunk:
        yield chunk


def _webdataset(stream: Any, text_field: str, where: str, limits: Iterator[int], max_records: int) -> Iterator[list[str]]:
    texts: list[str] = []
    size = 0
    max_bytes = next(limits)
    key: str | None = None
    text: str | None = None
    records = 0

    def close_sample() -> str:
        if text is None:
            raise SourceReadError(f"{where}: sample {key!r} (record {records - 1}) has no member with suffix {text_field!r}")
        return text

    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for index, member in enumerate(tar):
                if member.isdir():
                    continue
                if not member.isreg() or member.size > MAX_MEMBER_BYTES:
                    raise SourceReadError(f"{where}: tar member {index} {member.name!r}: not a regular file within "
                                          f"{MAX_MEMBER_BYTES} bytes")
                mkey, suffix = member_key(member.name, where, index)
                if mkey != key:
                    if key is not None:
                        texts.append(close_sample())
                        if len(texts) >= max_records or size >= max_bytes:
                            yield texts
                            texts, size, max_bytes = [], 0, next(limits)
                    key, text = mkey, None
                    records += 1
                if suffix == text_field:
                    fobj = tar.extractfile(member)
                    data = fobj.read() if fobj is not None else b""
                    size += len(data)
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise SourceReadError(
                            f"{where}: sample {mkey!r} (record {records - 1}): member {member.name!r} is not UTF-8"
                        ) from exc
            if key is not None:
                texts.append(close_sample())
    except tarfile.TarError as exc:
        raise SourceReadError(f"{where}: not a valid tar archive ({exc})") from exc
    if texts:
        yield texts


def _parquet(path: str, compression: str, text_field: str, where: str, max_records: int) -> Iterator[list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if compression != "none":
        raise SourceReadError(f"{where}: format 'parquet' cannot be {compression}-compressed")
    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=max_records, columns=[text_field])
        first = 0
        for batch in batches:
            texts = batch.column(0).to_pylist()
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise SourceReadError(f"{where}: record {first + i}: column {text_field!r} is {t!r}, expected a string")
            first += len(texts)
            yield texts
    except (pa.ArrowException, KeyError, OSError) as exc:
        raise SourceReadError(f"{where}: cannot read parquet column {text_field!r} ({exc})") from exc
