"""Bounded decompression of gzip and zstd streams (concatenated members/frames).

Memory stays bounded whatever the compression ratio (a 131 KB zstd file can
expand to 4 GiB): gzip output is capped per call with zlib's `max_length`;
zstd's decompressobj has no such cap, so it is fed at most `ZSTD_PIECE`
compressed bytes at a time, and one zstd block (at least 4 bytes) expands to
at most 128 KiB, so a call yields at most 32 MiB. Decoded pieces are produced
lazily: the caller consumes each before the next is made. A stream that ends
before its end-of-stream marker is a SourceReadError ("truncated").
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from typing import Any

from sluice.errors import SourceReadError

DECODE_WINDOW = 8 << 20  # gzip: decoded bytes per decompress call
ZSTD_PIECE = 1 << 10  # zstd: compressed bytes per call (<= 32 MiB out)
COALESCE = 1 << 20  # small decoded pieces are joined up to this size before they are handed on
_READ = 8 << 20  # bytes a DecodedReader.read() without a size returns at most


class Decoder:
    """Incremental gzip/zstd decoding over concatenated members/frames; detects truncation."""

    def __init__(self, compression: str, where: str) -> None:
        self.compression, self.where = compression, where
        self.obj: Any = None
        self.started = False

    def _new(self) -> Any:
        if self.compression == "gzip":
            return zlib.decompressobj(wbits=31)
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Decoded bytes of `data`, lazily, in pieces of at most DECODE_WINDOW + 32 MiB.

        Consume each piece before asking for the next: memory then stays
        bounded whatever the compression ratio.
        """
        held: list[bytes] = []
        size = 0
        for part in self._decode(data):
            held.append(part)
            size += len(part)
            if size >= COALESCE:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)

    def _decode(self, data: bytes) -> Iterator[bytes]:
        gzip = self.compression == "gzip"
        step = max(1, len(data) if gzip else ZSTD_PIECE)
        view = memoryview(data)
        for i in range(0, len(view), step):
            piece: bytes = bytes(view[i : i + step])
            more = False  # gzip: zlib may hold more output for input it already took
            while piece or more:
                if self.obj is None:
                    self.obj, self.started = self._new(), True
                try:
                    if gzip:
                        out = self.obj.decompress(piece, DECODE_WINDOW)
                        more = len(out) == DECODE_WINDOW
                        piece = self.obj.unconsumed_tail  # input left when the window filled
                    else:
                        out, piece = self.obj.decompress(piece), b""
                except Exception as exc:  # zlib.error / zstandard.ZstdError
                    raise SourceReadError(f"{self.where}: corrupt {self.compression} stream ({exc})") from exc
                if out:
                    yield out
                if self.obj.eof:  # a member/frame ended; what follows starts the next one
                    piece, more = self.obj.unused_data, False
                    self.obj = None

    def finish(self) -> None:
        if self.obj is not None or not self.started:
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
