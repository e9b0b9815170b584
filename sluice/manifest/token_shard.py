"""The pre-tokenized shard format `sluice-tokens/1` (file suffix `.sltok`).

Layout (all integers little-endian), designed to be read with one memory map::

    offset 0   magic   b"SLTOK\\x00\\x01\\x00"                 8 bytes
    offset 8   hlen    uint32: length of the JSON header      4 bytes
    offset 12  header  UTF-8 JSON object, `hlen` bytes, then zero padding
                       up to the next multiple of 64
    data       offsets uint64[n_docs + 1], offsets[0] = 0,
                       offsets[i+1] - offsets[i] = tokens of document i
               tokens  dtype[n_tokens] (dtype "uint16" or "uint32")

The header holds ``{"format": "sluice-tokens/1", "dtype": ..., "n_docs": ...,
"n_tokens": ..., "tokenizer": "b3:...", "raw": "b3:..." | null,
"transform": "..."}``. Document i's tokens are
``tokens[offsets[i]:offsets[i+1]]``; a shard's record count is `n_docs`.
Documents hold only the tokenizer's output: framing tokens (bos/eos) are added
by the packer from the manifest's packing policy, so one shard serves any
separator policy.

Two writers make the same layout: `write_shard` (all documents in memory,
header exactly as long as its JSON) and `ShardWriter` (documents appended chunk
by chunk with bounded memory; the JSON header is padded with spaces to a fixed
length, because the token count is known only at the end). Readers accept
both: trailing whitespace is part of valid JSON.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sluice.errors import CacheError, SourceReadError

MAGIC = b"SLTOK\x00\x01\x00"
FORMAT = "sluice-tokens/1"
ALIGN = 64
MAX_HEADER = 1 << 20
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _pad(n: int) -> int:
    return (-n) % ALIGN


def encode_header(header: dict[str, Any]) -> bytes:
    body = _header_json(header)
    head = MAGIC + struct.pack("<I", len(body)) + body
    return head + b"\x00" * _pad(len(head))


def write_shard(
    path: str | os.PathLike[str],
    docs: list[np.ndarray] | list[list[int]],
    *,
    tokenizer: str,
    raw: str | None = None,
    transform: str = "",
    vocab_size: int | None = None,
) -> int:
    """Write `docs` (token id sequences) as a shard at `path` atomically; returns bytes written.

    The dtype is uint16 when `vocab_size` (or the largest id) fits, else uint32.
    """
    lengths = np.fromiter((len(d) for d in docs), dtype=np.uint64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype="<u8")
    np.cumsum(lengths, out=offsets[1:])
    if docs and all(isinstance(d, np.ndarray) and d.dtype.kind == "u" for d in docs):
        flat = np.concatenate(docs)  # encoder output (uint32): no 8-byte copy, cannot be negative
    else:
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    top = vocab_size - 1 if vocab_size else (int(flat.max()) if flat.size else 0)
    if flat.size and int(flat.min()) < 0:
        raise SourceReadError(f"token shard {path}: negative token id")
    dtype_name = "uint16" if top < 2**16 else "uint32"
    header = {
        "format": FORMAT,
        "dtype": dtype_name,
        "n_docs": len(docs),
        "n_tokens": int(offsets[-1]),
        "tokenizer": tokenizer,
        "raw": raw,
        "transform": transform,
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(encode_header(header))
            f.write(offsets.tobytes())
            f.write(flat.astype(DTYPES[dtype_name]).tobytes())
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


class ShardWriter:
    """Write a shard of a known document count chunk by chunk, with bounded memory.

    The offsets table and the header sit before the tokens, so the writer
    reserves their room (the header at its largest possible JSON length) and
    fills them with positioned writes: `add(docs)` writes the chunk's offsets
    and tokens at once, `finish()` writes the header. Memory held is one chunk's
    arrays. While writing, `doc_span(i)` / `read_doc(i)` give any document
    already added, read back from the file (what a streaming reader serves
    before the shard is complete).

        w = ShardWriter(path, n_docs=3, tokenizer="b3:..", vocab_size=4096)
        w.add([a, b]); w.add([c]); w.finish()    # open_shard(path) now works

    `memory_bytes > 0`: the shard is written to anonymous memory (a memfd, Linux),
    not to `path` (then only a name in messages), and may grow to at most that
    many bytes (CacheError past it): what a fill uses when the disk refused the
    file (tokcache.py). Its readers read it from memory alike.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        n_docs: int,
        *,
        tokenizer: str,
        vocab_size: int,
        raw: str | None = None,
        transform: str = "",
        memory_bytes: int = 0,
    ) -> None:
        if n_docs < 0:
            raise SourceReadError(f"token shard {path}: negative document count {n_docs}")
        self.path = str(path)
        self.n_docs = n_docs
        self._vocab_size = vocab_size
        self._header, self._hlen, self._offsets_at, self._tokens_at = _streamed_layout(
            n_docs, tokenizer=tokenizer, vocab_size=vocab_size, raw=raw, transform=transform)
        self.dtype_name = self._header["dtype"]
        self.dtype = DTYPES[self.dtype_name]
        self.docs = 0  # documents added so far
        self.tokens = 0
        self.memory_bytes = memory_bytes
        if memory_bytes > 0:
            self._check_memory(0)
            if not hasattr(os, "memfd_create"):
                raise CacheError(f"token shard {self.path}: no anonymous memory files (memfd) on this platform")
            self._fd = os.memfd_create("sluice-tokens", os.MFD_CLOEXEC)
        else:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def _check_memory(self, tokens: int) -> None:
        """In memory: refuse to grow past `memory_bytes` (the shard with `tokens` tokens in all)."""
        size = self._tokens_at + self.dtype.itemsize * tokens
        if self.memory_bytes > 0 and size > self.memory_bytes:
            raise CacheError(f"token shard {self.path}: held in memory, it would take {size} bytes, more than "
                             f"the {self.memory_bytes} bytes allowed")

    def add(self, docs: list[np.ndarray]) -> None:
        """Append documents (token id arrays, in record order)."""
        if self._fd < 0:
            raise SourceReadError(f"token shard {self.path}: add() after finish()")
        if self.docs + len(docs) > self.n_docs:
            raise SourceReadError(f"token shard {self.path}: more than the {self.n_docs} documents announced")
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        ends = np.cumsum(lengths, dtype=np.int64) + self.tokens
        self._check_memory(int(ends[-1]))
        flat = np.concatenate(docs) if len(docs) > 1 else np.asarray(docs[0])
        if flat.size and (int(flat.max()) >= self._vocab_size or int(flat.min()) < 0):
            raise SourceReadError(f"token shard {self.path}: a token id outside [0, {self._vocab_size})")
        _pwrite_all(self._fd, flat.astype(self.dtype, copy=False).tobytes(), self._tokens_at + self.dtype.itemsize * self.tokens)
        _pwrite_all(self._fd, ends.astype("<u8").tobytes(), self._offsets_at + 8 * (self.docs + 1))
        self.docs += len(docs)
        self.tokens = int(ends[-1])

    def reader(self) -> PartialShard:
        """A reader of the documents added so far (it owns a duplicate descriptor:
        it stays valid after `finish`, a rename or an unlink of the file)."""
        if self._fd < 0:
            raise SourceReadError(f"token shard {self.path}: reader() after finish()")
        return PartialShard(self.path, os.dup(self._fd), self._offsets_at, self._tokens_at, self.dtype)

    def finish(self) -> int:
        """Write the header once every announced document is added; returns the file size."""
        if self.docs != self.n_docs:
            raise SourceReadError(f"token shard {self.path}: {self.docs} documents written, {self.n_docs} announced")
        body = _header_json({**self._header, "n_tokens": self.tokens})
        body += b" " * (self._hlen - len(body))
        head = MAGIC + struct.pack("<I", self._hlen) + body
        _pwrite_all(self._fd, head + b"\x00" * _pad(len(head)) + b"\x00" * 8, 0)
        size = self._tokens_at + self.dtype.itemsize * self.tokens
        os.ftruncate(self._fd, size)  # an empty last chunk leaves nothing past the offsets
        self.close()
        return size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _streamed_layout(n_docs: int, *, tokenizer: str, vocab_size: int, raw: str | None,
                     transform: str) -> tuple[dict[str, Any], int, int, int]:
    """(header without n_tokens, reserved header length, offsets position, tokens position) of a streamed shard."""
    dtype_name = "uint16" if vocab_size - 1 < 2**16 else "uint32"
    header = {"format": FORMAT, "dtype": dtype_name, "n_docs": n_docs, "n_tokens": 0,
              "tokenizer": tokenizer, "raw": raw, "transform": transform}
    hlen = len(_header_json({**header, "n_tokens": 2**64 - 1}))  # room for the largest token count
    start = 12 + hlen
    offsets_at = start + _pad(start)
    return header, hlen, offsets_at, offsets_at + 8 * (n_docs + 1)


def open_partial(path: str | os.PathLike[str], n_docs: int, *, tokenizer: str, vocab_size: int,
                 raw: str | None = None, transform: str = "") -> PartialShard:
    """A reader of a shard another process is writing with `ShardWriter` (same arguments)."""
    header, _, offsets_at, tokens_at = _streamed_layout(n_docs, tokenizer=tokenizer, vocab_size=vocab_size,
                                                        raw=raw, transform=transform)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SourceReadError(f"token shard {path}: cannot open ({exc.strerror})") from exc
    return PartialShard(str(path), fd, offsets_at, tokens_at, DTYPES[header["dtype"]])


def _header_json(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class PartialShard:
    """Documents of a shard being written, read with positioned reads.

    `doc(i)` is valid for any document the writer has added (the caller knows
    which: it is told by whoever runs the writer). Reads copy (one document at
    a time); nothing is mapped, so the memory held is what the caller keeps.
    """

    def __init__(self, path: str, fd: int, offsets_at: int, tokens_at: int, dtype: np.dtype) -> None:
        self.path, self._fd, self._offsets_at, self._tokens_at, self._dtype = path, fd, offsets_at, tokens_at, dtype

    def doc(self, i: int) -> np.ndarray:
        if self._fd < 0:
            raise SourceReadError(f"token shard {self.path}: read after close")
        # offsets[0] is written last (with the header); a hole reads as the 0 it will be.
        first, end = struct.unpack("<QQ", os.pread(self._fd, 16, self._offsets_at + 8 * i))
        n = (end - first) * self._dtype.itemsize
        data = os.pread(self._fd, n, self._tokens_at + first * self._dtype.itemsize)
        if len(data) != n:
            raise SourceReadError(f"token shard {self.path}: document {i} is short ({len(data)} of {n} bytes)")
        return np.frombuffer(data, dtype=self._dtype)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_exact(f: BinaryIO, n: int) -> bytes:
    """`n` bytes, or fewer only at the end: a raw stream (an object store's) may return less per read."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_header(f: BinaryIO, where: str) -> tuple[dict[str, Any], int]:
    """Read and validate a shard header from an open binary file; returns (header, data offset)."""
    head = _read_exact(f, 12)
    if len(head) < 12 or head[:8] != MAGIC:
        raise SourceReadError(f"{where}: not a sluice token shard (bad magic {head[:8]!r})")
    (hlen,) = struct.unpack("<I", head[8:12])
    if hlen > MAX_HEADER:
        raise SourceReadError(f"{where}: token shard header length {hlen} exceeds {MAX_HEADER}")
    body = _read_exact(f, hlen)
    if len(body) != hlen:
        raise SourceReadError(f"{where}: token shard header truncated ({len(body)} of {hlen} bytes)")
    try:
        header = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceReadError(f"{where}: token shard header is not JSON ({exc})") from exc
    except RecursionError as exc:
        raise SourceReadError(f"{where}: token shard header is JSON nested too deeply") from exc
    except ValueError as exc:  # an integer beyond Python's 4300-digit conversion limit
        raise SourceReadError(f"{where}: token shard header is not usable JSON ({str(exc)[:200]})") from exc
    if not isinstance(header, dict):
        raise SourceReadError(f"{where}: token shard header is a JSON {type(header).__name__}, expected an object")
    if header.get("format") != FORMAT:
        raise SourceReadError(f"{where}: token shard header format is {header.get('format')!r:.80}, expected {FORMAT!r}")
    if not isinstance(header.get("dtype"), str) or header["dtype"] not in DTYPES:
        raise SourceReadError(f"{where}: token shard dtype {header.get('dtype')!r:.80} not in {sorted(DTYPES)}")
    for key in ("n_docs", "n_tokens"):
        value = header.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**53:
            raise SourceReadError(f"{where}: token shard header field {key!r} invalid: {value!r:.80}")
    start = 12 + hlen
    return header, start + _pad(start)


@dataclass(frozen=True)
class TokenShard:
    """A memory-mapped shard; `doc(i)` is a zero-copy view of document i."""

    path: str
    header: dict[str, Any]
    offsets: np.ndarray
    tokens: np.ndarray

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1  # open_shard checked offsets against the header's n_docs

    def doc(self, i: int) -> np.ndarray:
        # Called once per document served (the daemon's docs callback): one slice and one tolist,
        # not two numpy scalars converted one by one.
        if not 0 <= i < len(self.offsets) - 1:
            raise SourceReadError(f"token shard {self.path}: document {i} outside [0, {self.n_docs})")
        a, b = self.offsets[i:i + 2].tolist()
        return self.tokens[a:b]


class _PositionedReader:
    """`read(n)` over an open descriptor with positioned reads (its offset is never moved)."""

    def __init__(self, fd: int) -> None:
        self._fd, self._at = fd, 0

    def read(self, n: int) -> bytes:
        data = os.pread(self._fd, n, self._at)
        self._at += len(data)
        return data


def open_shard(path: str | os.PathLike[str], *, fd: int | None = None) -> TokenShard:
    """Memory-map a shard and check that its arrays fit the file exactly.

    `fd`: an open descriptor of the file to map instead of opening `path` (which then only names it in
    messages): the node cache maps the very inode it verified, whatever the path names meanwhile.
    """
    where = f"token shard {path}"
    try:
        if fd is None:
            with open(path, "rb") as f:
                header, data = read_header(f, where)
                size = os.fstat(f.fileno()).st_size
        else:
            header, data = read_header(_PositionedReader(fd), where)  # type: ignore[arg-type]
            size = os.fstat(fd).st_size
    except OSError as exc:
        raise SourceReadError(f"{where}: cannot read ({exc.strerror})") from exc
    n_docs, n_tokens = header["n_docs"], header["n_tokens"]
    dtype = DTYPES[header["dtype"]]
    need = data + 8 * (n_docs + 1) + dtype.itemsize * n_tokens
    if size != need:
        raise SourceReadError(f"{where}: size {size} bytes, header implies {need} (truncated or padded)")
    # A plain ndarray view of the map: slicing np.memmap subclasses costs
    # microseconds per document in __array_finalize__; the view keeps the map alive.
    if fd is None:
        raw = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    elif size == 0:
        raw = np.zeros(0, np.uint8)
    else:  # (the array keeps the map alive; the map keeps no descriptor)
        raw = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), np.uint8)
    offsets = raw[data : data + 8 * (n_docs + 1)].view("<u8")
    tokens = raw[data + 8 * (n_docs + 1) :].view(dtype)
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens or (n_docs and bool(np.any(np.diff(offsets.astype(np.int64)) < 0))):
        raise SourceReadError(f"{where}: document offsets are not monotone from 0 to n_tokens={n_tokens}")
    return TokenShard(str(path), header, offsets, tokens)
