"""Is a zstd object whole? A walk over its frame and block headers (RFC 8878).

zstandard's `stream_reader` ends quietly when its input stops inside a frame
(it returns b"" as at a clean end), so a cut object would decode as a shorter
one. `check_zstd_complete` walks the headers only, with positioned reads: per
frame the header, then each block's 3-byte header (the payload is skipped by
its declared size), then the optional 4-byte checksum; skippable frames by their
length field. It costs one small read per block (a block decodes to at most
128 KiB), so a few milliseconds per gigabyte, and reads no payload.

    stream start ─ frame ─ frame ─ ... ─ end      (each frame ends with a block
                    │                             whose "last" bit is set)
                    magic, header, block, block, ..., [checksum]

It checks structure, not content: a corrupt payload is the decoder's to find
(zstandard raises ZstdError), and a cut that falls exactly between two frames
leaves a valid, shorter stream (the record count in the manifest catches it).
"""

from __future__ import annotations

import os

from sluice.errors import SourceReadError

_MAGIC = 0xFD2FB528
_SKIPPABLE_LO, _SKIPPABLE_HI = 0x184D2A50, 0x184D2A5F
_FCS_BYTES = (0, 2, 4, 8)  # by the frame content size flag (0 means 1 byte when single-segment)
_DICT_BYTES = (0, 1, 2, 4)


def check_zstd_complete(fd: int, where: str) -> None:
    """Raise SourceReadError naming `where` and the byte offset unless the file
    behind `fd` is a sequence of whole zstd frames (at least one).

    Reads with os.pread, so the file offset of `fd` is left where it was.
    """
    size = os.fstat(fd).st_size
    if size == 0:
        raise SourceReadError(f"{where}: truncated zstd stream (empty object, no frame)")

    def need(pos: int, n: int, what: str) -> bytes:
        data = os.pread(fd, n, pos)
        if len(data) < n:
            raise SourceReadError(
                f"{where}: truncated zstd stream (ends at byte {size} inside the {what} at byte {pos})"
            )
        return data

    pos = 0
    while pos < size:
        magic = int.from_bytes(need(pos, 4, "frame magic"), "little")
        if _SKIPPABLE_LO <= magic <= _SKIPPABLE_HI:
            pos += 8 + int.from_bytes(need(pos + 4, 4, "skippable frame header"), "little")
            if pos > size:
                raise SourceReadError(f"{where}: truncated zstd stream (ends at byte {size} inside a skippable frame)")
            continue
        if magic != _MAGIC:
            raise SourceReadError(f"{where}: not a zstd frame at byte {pos} (magic {magic:#010x})")
        fhd = need(pos + 4, 1, "frame header")[0]
        single = (fhd >> 5) & 1
        fcs = _FCS_BYTES[fhd >> 6] or single
        header = 1 + (0 if single else 1) + _DICT_BYTES[fhd & 3] + fcs
        need(pos + 4, header, "frame header")
        checksum = 4 if (fhd >> 2) & 1 else 0
        pos += 4 + header
        last = False
        while not last:
            block = int.from_bytes(need(pos, 3, "block header"), "little")
            last, kind, length = bool(block & 1), (block >> 1) & 3, block >> 3
            if kind == 3:
                raise SourceReadError(f"{where}: corrupt zstd stream (reserved block type at byte {pos})")
            pos += 3 + (1 if kind == 1 else length)  # an RLE block stores its one byte
            if pos > size:
                raise SourceReadError(f"{where}: truncated zstd stream (ends at byte {size} inside a block)")
        pos += checksum
        if pos > size:
            raise SourceReadError(f"{where}: truncated zstd stream (ends at byte {size} inside a frame checksum)")
