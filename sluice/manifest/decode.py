"""Bounded decompression of gzip and zstd streams (concatenated members/frames).

Memory stays bounded whatever the compression ratio (a 131 KB zstd file can
expand to 4 GiB):

* gzip: output is capped per call with zlib's `max_length` (DECODE_WINDOW).
* zstd: the decompressor object has no such cap, so `ZstdFrames` walks the
  frame and block headers of the stored bytes as they arrive (3 bytes per
  block, at most 128 KiB decoded each) and cuts the input into pieces of at
  most `ZSTD_BLOCKS` blocks: one call then yields at most 1 MiB, however small
  the blocks (an RLE block is 4 bytes). Real data (blocks of tens of KB) goes
  through in calls of about a megabyte (still in cache when the lines are
  checked); the walk costs one small Python step per block.

Decoded pieces are produced lazily: the caller consumes each before the next
is made. A stream that ends before its end-of-stream marker (a gzip member
or a zstd frame cut short, or an empty file) is a SourceReadError
("truncated"); bytes that are no frame are "corrupt".
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from typing import Any

from sluice.errors import SourceReadError

DECODE_WINDOW = 1 << 20  # gzip: decoded bytes per decompress call
ZSTD_BLOCKS = 8  # zstd: blocks per decompress call (each <= 128 KiB out, so <= 1 MiB: it stays in cache for the line check)
COALESCE = 1 << 20  # small decoded pieces are joined up to this size before they are handed on
_READ = 8 << 20  # bytes a DecodedReader.read() without a size returns at most


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528, little-endian
_DID_BYTES = (0, 1, 2, 4)  # Dictionary_ID_flag -> field size
_FCS_BYTES = (0, 2, 4, 8)  # Frame_Content_Size_flag -> field size (flag 0: 1 byte when Single_Segment)


class ZstdFrames:
    """Walks the frames and blocks of a zstd stream (RFC 8878) as its bytes arrive.

    `cut(data)` splits `data` into (piece, kind, ends_frame) with kind "data"
    (feed it to the decompressor) or "skip" (a skippable frame); a data piece
    holds at most ZSTD_BLOCKS blocks and never spans two frames. Up to 3 bytes
    of an unfinished frame magic are carried to the next call. `complete()`
    tells whether the stream so far ends exactly at a frame boundary.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.carry = b""  # bytes of a frame magic not yet complete
        self.state = "magic"
        self.kind = "data"
        self.need = 0  # header bytes still to collect in `hdr`
        self.hdr = bytearray()
        self.skip = 0  # content bytes to pass over
        self.checksum = False
        self.last = False  # the block being skipped is the frame's last
        self.frames = 0

    def complete(self) -> bool:
        return self.frames > 0 and self.state == "magic" and not self.carry

    def _corrupt(self, what: str) -> SourceReadError:
        return SourceReadError(f"{self.where}: corrupt zstd stream ({what})")

    def cut(self, data: bytes | memoryview) -> Iterator[tuple[memoryview, str, bool]]:
        buf = self.carry + data if self.carry else data
        self.carry = b""
        view, n, p, start, blocks = memoryview(buf), len(buf), 0, 0, 0
        while p < n:
            ended = False
            if self.state == "magic":
                if n - p < 4:
                    self.carry = bytes(view[p:])
                    n = p  # the piece ends before the carried bytes
                    break
                magic = bytes(buf[p : p + 4])
                p += 4
                if magic == _ZSTD_MAGIC:
                    self.kind, self.state, self.need = "data", "fhd", 1
                elif magic[1:] == b"\x2a\x4d\x18" and magic[0] & 0xF0 == 0x50:  # 0x184D2A5?
                    self.kind, self.state, self.need = "skip", "skiplen", 4
                else:
                    raise self._corrupt(f"no frame magic at a frame start, got {magic.hex()}")
                continue
            if self.skip:
                k = min(self.skip, n - p)
                p += k
                self.skip -= k
                if self.skip:
                    break
                if self.state == "content":  # a block ended
                    blocks += 1
                    if not self.last:
                        self.state, self.need = "block", 3
                    elif self.checksum:
                        self.state, self.need = "checksum", 4
                    else:
                        ended = True
                else:  # the body of a skippable frame
                    ended = True
            else:
                k = min(self.need - len(self.hdr), n - p)
                self.hdr += view[p : p + k]
                p += k
                if len(self.hdr) < self.need:
                    break
                ended = self._header(bytes(self.hdr))
                self.hdr.clear()
            if ended:
                self.state, self.frames = "magic", self.frames + 1
            if ended or blocks >= ZSTD_BLOCKS:
                yield view[start:p], self.kind, ended
                start, blocks = p, 0
        if n > start:
            yield view[start:n], self.kind, False

    def _header(self, h: bytes) -> bool:
        """Parse a complete header field; True when it ends the frame."""
        if self.state == "fhd":
            d = h[0]
            if d & 0x08:
                raise self._corrupt("reserved bit set in the frame header")
            single = bool(d & 0x20)
            self.checksum = bool(d & 0x04)
            fcs = _FCS_BYTES[d >> 6] or (1 if single else 0)
            rest = (0 if single else 1) + _DID_BYTES[d & 3] + fcs
            self.state, self.need = ("fhrest", rest) if rest else ("block", 3)
        elif self.state == "fhrest":
            self.state, self.need = "block", 3
        elif self.state == "block":
            v = int.from_bytes(h, "little")
            kind, size = (v >> 1) & 3, v >> 3
            if kind == 3:
                raise self._corrupt("reserved block type")
            self.last = bool(v & 1)
            self.skip = 1 if kind == 1 else size  # an RLE block stores one byte
            self.state = "content"
            if self.skip == 0:  # an empty raw block
                if not self.last:
                    self.state, self.need = "block", 3
                elif self.checksum:
                    self.state, self.need = "checksum", 4
                else:
                    return True
        elif self.state == "checksum":
            return True
        elif self.state == "skiplen":
            self.skip = int.from_bytes(h, "little")
            self.state = "skipbody"
            if self.skip == 0:
                return True
        return False


class Decoder:
    """Incremental gzip/zstd decoding over concatenated members/frames; detects truncation."""

    def __init__(self, compression: str, where: str) -> None:
        self.compression, self.where = compression, where
        self.obj: Any = None
        self.started = False
        self.frames = ZstdFrames(where) if compression == "zstd" else None

    def _new(self) -> Any:
        if self.compression == "gzip":
            return zlib.decompressobj(wbits=31)
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def feed(self, data: bytes | memoryview) -> Iterator[bytes]:
        """Decoded bytes of `data`, lazily, in pieces of at most DECODE_WINDOW (gzip) or 1 MiB (zstd).

        Consume each piece before asking for the next: memory then stays
        bounded whatever the compression ratio.
        """
        if self.frames is not None:
            yield from self._zstd(data)
            return
        held: list[bytes] = []
        size = 0
        for part in self._gzip(data):
            held.append(part)
            size += len(part)
            if size >= COALESCE:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)

    def _zstd(self, data: bytes | memoryview) -> Iterator[bytes]:
        assert self.frames is not None
        for piece, kind, ends in self.frames.cut(data):
            self.started = True
            if kind != "data":
                continue
            if self.obj is None:
                self.obj = self._new()
            try:
                out = self.obj.decompress(piece)
            except Exception as exc:  # zstandard.ZstdError
                raise SourceReadError(f"{self.where}: corrupt zstd stream ({exc})") from exc
            if ends:
                if not self.obj.eof:  # the headers say the frame ended here; the decoder must agree
                    raise SourceReadError(f"{self.where}: corrupt zstd stream (a frame's blocks end before its content)")
                self.obj = None  # the next frame gets a fresh decompressor
            if out:
                yield out

    def _gzip(self, data: bytes | memoryview) -> Iterator[bytes]:
        piece = data  # bytes or a memoryview: zlib reads either in place
        more = False  # zlib may hold more output for input it already took
        while piece or more:
            if self.obj is None:
                self.obj, self.started = self._new(), True
            try:
                out = self.obj.decompress(piece, DECODE_WINDOW)
                more = len(out) == DECODE_WINDOW
                piece = self.obj.unconsumed_tail  # input left when the window filled
            except zlib.error as exc:
                raise SourceReadError(f"{self.where}: corrupt gzip stream ({exc})") from exc
            if out:
                yield out
            if self.obj.eof:  # a member ended; what follows starts the next one
                piece, more = self.obj.unused_data, False
                self.obj = None

    def finish(self) -> None:
        done = self.frames.complete() if self.frames is not None else (self.obj is None and self.started)
        if not done:
            raise SourceReadError(
                f"{self.where}: truncated {self.compression} stream (ended before the end-of-stream marker)"
            )


class DecodedReader(io.RawIOBase):
    """File-like view of the decompressed bytes of a hashing reader (for tarfile)."""

    def __init__(self, src: Any, compression: str, where: str) -> None:
        self.src, self.dec, self.buf, self.done = src, Decoder(compression, where), bytearray(), False
        self.parts: Iterator[bytes] = iter(())  # decoded pieces of the raw bytes read last

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        # Decode lazily, only as far as `want` needs: the buffer holds at most
        # `want` plus one decoded piece.
        want = _READ if n is None or n < 0 else n
        while len(self.buf) < want and not self.done:
            part = next(self.parts, None)
            if part is not None:
                self.buf += part
                continue
            raw = self.src.read(256 << 10)
            if not raw:
                self.dec.finish()
                self.done = True
                break
            self.parts = self.dec.feed(raw)
        out = bytes(self.buf[:want])
        del self.buf[:want]
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)
