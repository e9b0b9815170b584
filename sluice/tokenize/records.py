"""The texts of chosen records of one raw object, out of order, without parsing the others.

`iter_text_chunks` reads an object front to back; a step in `block` order
needs documents from anywhere in it. `RecordLocator` finds record r by
counting lines, not by parsing them: newlines are counted in C
(`bytes.count`) and a JSON line is parsed only when its record is asked for::

    loc = RecordLocator(path, "jsonl", "zstd", "text", where, spool_dir=tmp)
    loc.texts([90_000, 17, 4_242])   # -> their texts, in the order asked
    loc.close()

How (jsonl): the decoded bytes are scanned once, as far as the furthest
record asked for, in windows of `_WINDOW` bytes cut at a line end; each
window start is a mark (records before it, lines before it, byte offset). To
read record r the locator finds the window holding it (bisection over the
marks), splits that window into lines once (its line table, kept while
recently used), then reads and parses only r's line with the freeze's own
line rule (`sluice.manifest.jsonl.JsonlScanner`: blank lines, "\\r", errors that
name the object and the line), so the text is the one `iter_text_chunks`
gives. A plain object is read in place (positioned reads); a compressed one is
decoded forward once into an unlinked spool file under `spool_dir`, only as
far as needed, and read back from there: decoding is never repeated.
Parquet: row-group row counts come from the footer; a record is read from
its row group (one column). WebDataset tars are not indexed (`supports`
says so; the caller waits for the in-order reader).

With a `LineIndex` (lineindex.py) built by the cache fill from the same
bytes and tied to their digest, a plain jsonl object starts out indexed: no
line is counted again. An index for other bytes (another digest or size) or a
malformed one is ignored (`used_index` stays False) and the lines are counted.

Bounds: memory is one window (64 KiB, or one line when a line is longer, up
to the manifest's 64 MiB line limit) plus 24 bytes of marks per window
scanned (about 0.4 MB per GB of text) plus the line tables of recently read
windows (24 bytes per record, at most `_TABLE_BYTES`, least recently used
dropped); disk is the decoded bytes of a
compressed object up to the furthest record asked for (freed at `close`).
"""

from __future__ import annotations

import bisect
import errno
import os
from collections import OrderedDict
import tempfile
from array import array
from typing import Any

import numpy as np

from sluice.errors import DISK_REFUSALS, CacheError, CacheWriteError, SourceReadError
from sluice.npsets import sorted_unique
from sluice.tokenize.lineindex import LineIndex

_WINDOW = 64 << 10  # decoded bytes per mark: a record read costs one window
_SCAN = 1 << 20  # decoded bytes indexed per numpy pass
_DECODE = 1 << 20  # decoded bytes appended to a spool per read of the decoder
_TABLE_BYTES = 4 << 20  # line tables of read windows kept (24 bytes per record: about 175k records)


def supports(fmt: str) -> bool:
    """Whether `RecordLocator` can read records of format `fmt` out of order."""
    return fmt in ("jsonl", "parquet")


class RecordLocator:
    """Random access to the texts of one raw jsonl or parquet object (see the module docstring)."""

    def __init__(self, path: str, fmt: str, compression: str, text_field: str, where: str, *,
                 spool_dir: str | None = None, window: int = _WINDOW, scan: int = _SCAN,
                 index: LineIndex | None = None, digest: str | None = None) -> None:
        """`window`: decoded bytes per mark (a record read costs one); `scan`: bytes indexed per pass.

        `index`: the object's line index from its cache fill, used only for a plain jsonl object
        whose verified `digest` and size it matches (see the module docstring)."""
        if not supports(fmt):
            raise SourceReadError(f"{where}: format {fmt!r} cannot be read out of order")
        if window < 1 or scan < 1:
            raise SourceReadError(f"{where}: window and scan must be positive (window={window}, scan={scan})")
        self.where = where
        self._impl: Any = (_Parquet(path, compression, text_field, where) if fmt == "parquet"
                           else _JsonlIndex(path, compression, text_field, where, spool_dir, window, scan))
        self.used_index = False  # whether `index` was taken (a test and bench hook)
        if index is not None and digest is not None and fmt == "jsonl":
            self.used_index = self._impl.adopt(index, digest)

    def texts(self, records: list[int]) -> list[str]:
        """The texts of `records` (any order, repeats allowed), in the order given.

        Raises SourceReadError naming the object (and line) for a bad record or
        a record beyond the object's end.
        """
        if not records:
            return []
        found = self._impl.texts(sorted(set(records)))
        return [found[r] for r in records]

    def close(self) -> None:
        self._impl.close()


class _JsonlIndex:
    def __init__(self, path: str, compression: str, text_field: str, where: str, spool_dir: str | None,
                 window: int, scan: int) -> None:
        from sluice.manifest.formats import MAX_LINE_BYTES
        from sluice.manifest.jsonl import JsonlScanner
        from sluice.tokenize.chunks import decoded_stream

        self.where = where
        self._window_bytes, self._scan_bytes = window, scan
        self._max_line = MAX_LINE_BYTES
        self._parser = JsonlScanner(where, text_field, "full", True)
        self._raw = open(path, "rb")
        self._stream: Any = None  # the decoder of a compressed object, read forward into the spool
        self._spool: Any = None
        self._spool_dir = spool_dir or tempfile.gettempdir()
        try:
            if compression == "none":
                self._fd = self._raw.fileno()
                self._size = os.fstat(self._fd).st_size
                self._eof = True
            else:
                self._stream = decoded_stream(self._raw, compression, where)
                try:
                    self._spool = tempfile.TemporaryFile(prefix="records-", dir=spool_dir)
                except OSError as exc:
                    raise _spool_error(exc, where, self._spool_dir, 0) from exc
                self._fd = self._spool.fileno()
                self._size = 0  # decoded bytes in the spool so far
                self._eof = False
        except BaseException:
            self.close()
            raise
        # Marks: window k starts at byte offsets[k] (a line start) after records[k] records and lines[k] lines.
        self._m_records, self._m_lines, self._m_offsets = array("q"), array("q"), array("q")
        self._scanned = 0  # bytes indexed (a line start)
        self._records = 0  # records before `_scanned`
        self._lines = 0
        self._done = False  # the whole object is indexed
        # Mark -> its records' line offsets and numbers (`_table`), least recently used first.
        self._tables: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._table_bytes = 0

    def adopt(self, index: LineIndex, digest: str) -> bool:
        """Start from `index` if it describes these bytes (a plain object of this digest and size);
        False (nothing changed) otherwise."""
        if self._stream is not None or self._scanned or not index.usable(digest, self._size):
            return False
        self._m_records, self._m_lines, self._m_offsets = index.m_records, index.m_lines, index.m_offsets
        self._scanned, self._records, self._lines = index.scanned, index.records, index.lines
        self._done = True  # the marks are complete: never extended, so the shared arrays stay as they are
        return True

    # -- reading decoded bytes ------------------------------------------------
    def _read(self, offset: int, n: int) -> bytes:
        """Up to `n` decoded bytes at `offset` (fewer only at the end of the object)."""
        while not self._eof and self._size < offset + n:
            self._decode_more()
        data = os.pread(self._fd, min(n, max(0, self._size - offset)), offset)
        return data

    def _decode_more(self) -> None:
        try:
            piece = self._stream.read(_DECODE)
        except OSError as exc:
            raise SourceReadError(f"{self.where}: cannot decode ({exc})") from exc
        except EOFError as exc:
            raise SourceReadError(f"{self.where}: truncated stream ({exc})") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("zstd"):
                raise SourceReadError(f"{self.where}: corrupt zstd stream ({exc})") from exc
            raise
        if not piece:
            self._eof = True
            return
        view, at = memoryview(piece), self._size
        try:  # positioned and unbuffered: a refused write leaves `_size` (what is readable) as it was
            while view:
                n = os.pwrite(self._fd, view, at)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                view, at = view[n:], at + n
        except OSError as exc:
            raise _spool_error(exc, self.where, self._spool_dir, self._size) from exc
        self._size += len(piece)

    def _window(self, offset: int, n: int) -> bytes:
        """The lines starting at `offset`: about `n` bytes cut after a newline (a missing final
        newline is supplied), or b"" at the end."""
        while True:
            data = self._read(offset, n)
            cut = data.rfind(b"\n")
            if cut >= 0:
                return data[: cut + 1]
            if len(data) < n:  # the end of the object: its last line has no newline
                return data + b"\n" if data else b""
            if n > self._max_line:
                raise SourceReadError(f"{self.where}: a line at byte {offset} is longer than the limit of "
                                      f"{self._max_line} bytes")
            n *= 2

    def _span(self, k: int) -> bytes:
        """The lines of mark k: from its offset to the next mark (or the end of what is indexed)."""
        start = self._m_offsets[k]
        end = self._m_offsets[k + 1] if k + 1 < len(self._m_offsets) else self._scanned
        data = self._read(start, end - start)
        return data if len(data) == end - start else data + b"\n"  # the supplied final newline

    # -- the index -------------------------------------------------------------
    def _extend(self, record: int) -> None:
        """Index the object until `record` is inside the indexed part (or the object ends).

        Newlines are found with numpy over `_SCAN` bytes at a time; a mark is
        put at the first line starting at or after every `_WINDOW` bytes.
        """
        while not self._done and self._records <= record:
            data = self._window(self._scanned, self._scan_bytes)
            if not data:
                self._done = True
                break
            starts, ends = _lines(data)
            blank = _blank(data, starts, ends)
            before = np.zeros(len(starts) + 1, dtype=np.int64)
            np.cumsum(~blank, out=before[1:])
            idx = sorted_unique(np.searchsorted(starts, np.arange(0, len(data), self._window_bytes)))
            idx = idx[idx < len(starts)]
            self._m_records.extend((before[idx] + self._records).tolist())
            self._m_lines.extend((idx + self._lines).tolist())
            self._m_offsets.extend((starts[idx] + self._scanned).tolist())
            self._records += int(before[-1])
            self._lines += len(starts)
            self._scanned += len(data)
        if record >= self._records:
            raise SourceReadError(f"{self.where}: record {record} is beyond the object's {self._records} records")

    def texts(self, records: list[int]) -> dict[int, str]:
        self._extend(records[-1])
        out: dict[int, str] = {}
        i = 0
        while i < len(records):
            # Mark k holds records [m_records[k], m_records[k + 1]); after marks with no
            # record in between, several share a count: the last of them holds it.
            k = bisect.bisect_right(self._m_records, records[i]) - 1
            starts, ends, lines = self._table(k)
            base = self._m_records[k]
            j = i
            while j < len(records) and records[j] < base + len(starts):
                j += 1
            # One read from the first asked line's start to the last one's end.
            first, last = int(starts[records[i] - base]), int(ends[records[j - 1] - base])
            data = self._read(first, last - first)
            for r in records[i:j]:
                n = r - base
                out[r] = self._parse(data[int(starts[n]) - first: int(ends[n]) - first], self._m_lines[k] + int(lines[n]) + 1)
            i = j
        return out

    def _table(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mark k's records: their lines' byte offsets (start, end without the newline) in the object
        and their line numbers within the mark. Scanning a window for its lines costs a numpy pass over
        it; a step in `block` order reads about one record per window, so the tables of recently read
        windows are kept (least recently used dropped past `_TABLE_BYTES`): each window is scanned
        about once, not once per record."""
        table = self._tables.get(k)
        if table is not None:
            self._tables.move_to_end(k)
            return table
        data = self._span(k)
        starts, ends = _lines(data)
        lines = np.flatnonzero(~_blank(data, starts, ends))
        offset = self._m_offsets[k]
        # A supplied final newline (no newline at the object's end) ends the last line at the object's end.
        table = (starts[lines] + offset, ends[lines] + offset, lines)
        self._tables[k] = table
        self._table_bytes += sum(a.nbytes for a in table)
        while self._table_bytes > _TABLE_BYTES and len(self._tables) > 1:
            _, old = self._tables.popitem(last=False)
            self._table_bytes -= sum(a.nbytes for a in old)
        return table

    def _parse(self, line: bytes, number: int) -> str:
        text = self._parser.text_of_line(line, number)
        if text is None:  # pragma: no cover - a located record line is never blank
            raise SourceReadError(f"{self.where}: line {number}: bug in sluice: no record at a record line")
        return text

    def close(self) -> None:
        for f in (self._stream, self._spool, self._raw):
            if f is not None:
                try:
                    f.close()
                except Exception:  # closing a half-read decoder may complain; nothing is lost
                    pass
        self._stream = self._spool = None


def _lines(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(start, end without the newline) of every line of `data` (which ends with a newline)."""
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    return starts, ends


def _blank(data: bytes, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which lines are blank: b"" or b"\\r" (the freeze's rule: not records)."""
    lengths = ends - starts
    return (lengths == 0) | ((lengths == 1) & (np.frombuffer(data, np.uint8)[starts] == 13))


class _Parquet:
    def __init__(self, path: str, compression: str, text_field: str, where: str) -> None:
        import pyarrow.parquet as pq

        if compression != "none":
            raise SourceReadError(f"{where}: format 'parquet' cannot be {compression}-compressed")
        self.where, self.text_field = where, text_field
        try:
            self._file = pq.ParquetFile(path)
        except Exception as exc:
            raise SourceReadError(f"{where}: cannot read parquet ({exc})") from exc
        meta = self._file.metadata
        self._firsts = [0]
        for g in range(meta.num_row_groups):
            self._firsts.append(self._firsts[-1] + meta.row_group(g).num_rows)

    def texts(self, records: list[int]) -> dict[int, str]:
        import pyarrow as pa

        if records[-1] >= self._firsts[-1]:
            raise SourceReadError(f"{self.where}: record {records[-1]} is beyond the object's {self._firsts[-1]} records")
        out: dict[int, str] = {}
        i = 0
        while i < len(records):
            g = bisect.bisect_right(self._firsts, records[i]) - 1
            try:
                column = self._file.read_row_group(g, columns=[self.text_field]).column(0)
            except (pa.ArrowException, KeyError, OSError) as exc:
                raise SourceReadError(f"{self.where}: cannot read parquet column {self.text_field!r} ({exc})") from exc
            while i < len(records) and records[i] < self._firsts[g + 1]:
                text = column[records[i] - self._firsts[g]].as_py()
                if not isinstance(text, str):
                    raise SourceReadError(f"{self.where}: record {records[i]}: column {self.text_field!r} is "
                                          f"{text!r:.80}, expected a string")
                out[records[i]] = text
                i += 1
        return out

    def close(self) -> None:
        self._file = None


def _spool_error(exc: OSError, where: str, folder: str, size: int) -> CacheError:
    """The error of a refused spool write: a CacheWriteError when the disk refused it (full, quota, I/O),
    so the caller can stop reading out of order instead of failing the object."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    message = (f"{where}: the spool of decoded bytes (an unlinked file in {folder}) refused a write after {size} bytes "
               f"({name}: {exc.strerror})")
    return CacheWriteError(message, exc.errno) if exc.errno in DISK_REFUSALS else CacheError(message)
