"""The line index of a raw jsonl object as a derived node-cache object: a restarted or second daemon counts no line.

A raw fill's `LineIndex` (lineindex.py) saves the out-of-order path a pass
over the object (0.2-0.4 s per GB) but lived only in the daemon that made it.
It depends only on the raw object's bytes, so it is a derived object of the
node cache like cached tokens and the tiktoken encoding (fastcache.py), keyed
by BLAKE3 of::

    {"kind": "sluice.derived/1", "raw": <raw object digest>, "transform": "sluice-lineindex/2"}

written once after the fill that built it, its BLAKE3 recorded by the cache
(checked on verify-on-read like any fill), counted in the budget, evictable.
A flat binary file, never unpickled::

    b"SLLIDX2\\0"  u32 LE header length  header JSON (UTF-8)  zero pad to 8
    m_records: n x i64 LE    m_lines: n x i64 LE    m_offsets: n x i64 LE

header: {"format", "digest", "size", "records", "lines", "scanned", "n",
"payload"}: the `LineIndex` fields, and "b3:<hex>" of the counts
(size, records, lines, scanned, n as five i64 LE) followed by the three
arrays' bytes, checked on every read (the arrays are 0.4 MB per GB of text: hashing
them costs far less than counting the lines). Version 1 hashed the arrays
only, so a flipped digit of a count in its header passed every check
(found: "lines" 3291 -> 2291; "records" 1234 -> 1224 would make a good
object's last records "beyond its end")
(tests/test_attack_lineindex.py); its files are refused (bad magic) and,
keyed by the old transform, never looked up. A file that is not exactly
that shape, was made for another object (digest or size), whose payload does
not hash to its header's digest or whose marks are not well formed
(`LineIndex.usable`) is refused with a CacheError naming the file; the caller
then drops it from the cache and counts the lines instead.
"""

from __future__ import annotations

import struct
from array import array
from pathlib import Path

import numpy as np

from sluice.errors import CacheError
from sluice.flatfile import read_flat, write_flat
from sluice.tokenize.lineindex import LineIndex

FORMAT = "sluice-lineindex/2"
MAGIC = b"SLLIDX2\0"
_MAX_HEADER = 1 << 12  # a header holds a few numbers and two digests


def index_key(raw_digest: str) -> dict[str, str]:
    """The derived-object key inputs of the line index of the raw object `raw_digest`."""
    return {"raw": raw_digest, "transform": FORMAT}


def _payload_digest(counts: tuple[int, ...], data: bytes | memoryview) -> str:
    """BLAKE3 of the header's counts and the arrays: a flipped bit in either is found."""
    import blake3

    h = blake3.blake3(struct.pack("<5q", *counts))
    h.update(data)
    return "b3:" + h.hexdigest()


def write_index(path: str | Path, index: LineIndex) -> None:
    """Write `index` to `path` in the format of the module docstring."""
    arrays = b"".join(np.asarray(a, dtype="<i8").tobytes() for a in (index.m_records, index.m_lines, index.m_offsets))
    header = {
        "format": FORMAT, "digest": index.digest, "size": index.size, "records": index.records,
        "lines": index.lines, "scanned": index.scanned, "n": len(index.m_offsets),
        "payload": _payload_digest((index.size, index.records, index.lines, index.scanned, len(index.m_offsets)),
                                   arrays),
    }
    write_flat(path, MAGIC, header, (arrays,))


def read_index(path: str | Path, digest: str, size: int) -> LineIndex:
    """The `LineIndex` of the raw object (`digest`, `size`) from a file `write_index` wrote for it;
    CacheError naming the file (and what is wrong) for any other file."""
    where = f"cached line index {path}"
    data = Path(path).read_bytes()
    shape = {"format": str, "digest": str, "size": int, "records": int, "lines": int, "scanned": int, "n": int,
             "payload": str}
    header, at = read_flat(data, MAGIC, shape, where=where, fmt=FORMAT, max_header=_MAX_HEADER, error=CacheError)
    if header["format"] != FORMAT or header["digest"] != digest or header["size"] != size:
        raise CacheError(f"{where}: made for {header['format']} of {header['digest']} ({header['size']} bytes), "
                         f"not {FORMAT} of {digest} ({size} bytes)")
    n = header["n"]
    counts = (header["size"], header["records"], header["lines"], header["scanned"], n)
    if not all(0 <= c < 2**63 for c in counts) or at + 24 * n != len(data):
        raise CacheError(f"{where}: {n} marks do not fill the file's {len(data)} bytes")
    body = memoryview(data)[at:]
    if _payload_digest(counts, body) != header["payload"]:
        raise CacheError(f"{where}: its marks do not hash to {header['payload']} (damaged)")
    cols = [array("q", np.frombuffer(body, dtype="<i8", count=n, offset=8 * n * k).astype(np.int64).tobytes())
            for k in range(3)]
    index = LineIndex(digest=digest, size=size, records=header["records"], lines=header["lines"],
                      scanned=header["scanned"], m_records=cols[0], m_lines=cols[1], m_offsets=cols[2])
    if not index.usable(digest, size):
        raise CacheError(f"{where}: its marks are not well formed for {digest} ({size} bytes)")
    return index
