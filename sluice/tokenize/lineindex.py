"""The line index of a plain jsonl object, built from the bytes a cache fill hashes.

`RecordLocator` (records.py) finds record r of a jsonl object by counting
lines up to it; for the last record of a 1 GB object that is a second pass
over the whole object right after the cache fill read it (0.21 s at best, 0.8 s
under load). A `LineIndexer` is the fill's observer (`NodeCache.fetch(obj,
location, observe=indexer.feed)`): it sees every chunk the fill hashes and
leaves the kind of marks the locator leaves, so the locator starts with the
object already indexed::

    indexer = LineIndexer()
    pin = cache.fetch(obj, location, observe=indexer.feed)   # returns only if the digest matched
    index = indexer.finish(obj.digest, obj.size)             # None unless it saw exactly those bytes
    RecordLocator(pin.path, "jsonl", "none", "text", where, index=index, digest=obj.digest)

Marks: for every window boundary b = k * `window` bytes, one mark at the first
line start at or after b (several boundaries inside one long line share a
mark): (records before it, lines before it, its offset). A line is a record
unless it is blank (b"" or b"\\r", the freeze's rule); a last line without a
newline counts, as the locator supplies its newline.

Trust: the index is tied to the digest of the bytes it was built from.
`finish` gives one only when the indexer saw a whole try of the fill from
offset 0 to exactly `size` bytes, contiguously (a try that failed and was
retried starts again at offset 0 and resets it), and the caller calls it only
after the fill returned, that is after the digest matched; the locator uses
an index only when its digest and size equal the object's and its marks are
well formed (`LineIndex.usable`), and counts lines itself otherwise.

Cost and bounds: one numpy pass per chunk (newline positions, about 7 GB/s
per core here, plus a few small-array steps per chunk: 0.28-0.67 s per GB
in 256 KiB chunks at load 5, more than BLAKE3's 0.21-0.27 s). So the fill
feeds a `StagedIndexer`: the fill's thread only copies each chunk into a
1 MiB staging buffer (one memcpy of an L2-hot chunk), and a thread of its
own indexes the staged megabytes on another core (numpy releases the GIL in
the pass); at a cold start that core is idle, the token fill and the demand
task waiting for the same raw object. Memory: 24 bytes per mark, about 0.4
MB per GB of text at 64 KiB windows, plus `StagedIndexer.BUFFERS` staging
buffers of `STAGE` bytes (the fill waits for a free one: the index never lags
further).
Compressed objects are not indexed here: the fill sees their compressed
bytes, and the locator indexes their decoded spool as before.
"""

from __future__ import annotations

import queue
import threading
from array import array
from dataclasses import dataclass

import numpy as np

from sluice.npsets import sorted_unique

WINDOW = 64 << 10  # bytes per mark: the locator's `_WINDOW`


@dataclass(frozen=True)
class LineIndex:
    """The marks of one object's lines (never mutated once made; see the module docstring)."""

    digest: str  # of the bytes indexed ("b3:<hex>")
    size: int  # bytes indexed
    records: int  # records (non-blank lines) in the object
    lines: int  # lines, counting a last line without a newline
    scanned: int  # `size`, plus 1 for the newline the locator supplies to a last line without one
    m_records: array  # per mark: records before it
    m_lines: array  # per mark: lines before it
    m_offsets: array  # per mark: its byte offset (a line start)

    @property
    def nbytes(self) -> int:
        return 24 * len(self.m_offsets)

    def usable(self, digest: str, size: int) -> bool:
        """Whether this index describes the object with `digest` and `size`, and its marks are well
        formed (a first mark at 0; offsets strictly increasing, counts not decreasing, all within
        the object). A False here means: count the lines instead."""
        if self.digest != digest or self.size != size or self.scanned not in (size, size + 1):
            return False
        n = len(self.m_offsets)
        if len(self.m_records) != n or len(self.m_lines) != n or (n == 0) != (size == 0):
            return False
        if n == 0:
            return self.records == 0
        off = np.frombuffer(self.m_offsets, np.int64)
        rec = np.frombuffer(self.m_records, np.int64)
        lin = np.frombuffer(self.m_lines, np.int64)
        return bool(off[0] == 0 and rec[0] == 0 and lin[0] == 0 and off[-1] < size
                    and (np.diff(off) > 0).all() and (np.diff(rec) >= 0).all() and (np.diff(lin) > 0).all()
                    and rec[-1] <= self.records <= self.lines and lin[-1] < self.lines
                    and (rec <= lin).all())


class LineIndexer:
    """Builds a `LineIndex` from the chunks of one object, fed in order (a fill's `observe`)."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"line index window must be positive, got {window}")
        self._window = window
        self._reset()

    def _reset(self) -> None:
        self._pos = 0  # bytes seen
        self._lines = 0  # newlines seen
        self._records = 0  # non-blank lines ended
        self._line_start = 0  # offset of the line in progress
        self._start_cr = False  # whether that line's first byte is "\r" (once seen)
        self._next = 0  # the next window boundary without a mark
        self._broken = False  # chunks came out of order: no index from this try
        self._m_records, self._m_lines, self._m_offsets = array("q"), array("q"), array("q")

    def feed(self, chunk: memoryview, offset: int) -> None:
        """Index bytes [offset, offset + len(chunk)); offset 0 starts again (a new try of the fill).
        Keeps no reference to `chunk`."""
        if offset == 0:
            self._reset()
        if self._broken or offset != self._pos:
            self._broken = True
            return
        a = np.frombuffer(chunk, np.uint8)
        n = len(a)
        if n == 0:
            return
        if self._line_start == offset:  # the line in progress starts here
            self._start_cr = bool(a[0] == 13)
        ends = np.flatnonzero(a == 10)
        if len(ends):
            starts = np.empty_like(ends)  # of the lines these newlines end, relative (the first may be < 0)
            starts[0] = self._line_start - offset
            starts[1:] = ends[:-1] + 1
            cr = np.empty(len(ends), dtype=bool)
            cr[0] = self._start_cr
            cr[1:] = a[starts[1:]] == 13
            lengths = ends - starts
            blank = (lengths == 0) | ((lengths == 1) & cr)
            before = np.zeros(len(ends) + 1, dtype=np.int64)  # records before line j
            np.cumsum(~blank, out=before[1:])
            line_starts = np.empty(len(ends) + 1, dtype=np.int64)  # absolute starts of lines j = 0..len(ends)
            line_starts[0] = self._line_start
            line_starts[1:] = ends + 1 + offset
            last = int(line_starts[-1])
            if self._next <= last:
                bounds = np.arange(self._next, last + 1, self._window, dtype=np.int64)
                idx = sorted_unique(np.searchsorted(line_starts, bounds))
                self._m_records.extend((before[idx] + self._records).tolist())
                self._m_lines.extend((idx + self._lines).tolist())
                self._m_offsets.extend(line_starts[idx].tolist())
                self._next = int(bounds[-1]) + self._window
            self._records += int(before[-1])
            self._lines += len(ends)
            self._line_start = last
            if last < offset + n:
                self._start_cr = bool(a[last - offset] == 13)
        del a
        self._pos += n

    def finish(self, digest: str, size: int) -> LineIndex | None:
        """The index of the `size` bytes seen, tagged with `digest` (call it only once the fill's
        digest matched); None if the chunks seen were not exactly bytes [0, size), in order.
        Call it once: the indexer is spent afterwards."""
        if self._broken or self._pos != size:
            return None
        self._broken = True  # the arrays now belong to the index
        records, lines, scanned = self._records, self._lines, size
        m_records, m_lines, m_offsets = self._m_records, self._m_lines, self._m_offsets
        while m_offsets and m_offsets[-1] >= size:  # a mark at the end: no line starts there
            m_records.pop()
            m_lines.pop()
            m_offsets.pop()
        if self._line_start < size:  # a last line without a newline: the locator supplies one
            if self._next <= self._line_start:  # boundaries up to its start: marked at its start
                m_records.append(records)
                m_lines.append(lines)
                m_offsets.append(self._line_start)
            blank = size - self._line_start == 1 and self._start_cr
            records += 0 if blank else 1
            lines += 1
            scanned = size + 1
        return LineIndex(digest=digest, size=size, records=records, lines=lines, scanned=scanned,
                         m_records=m_records, m_lines=m_lines, m_offsets=m_offsets)


class StagedIndexer:
    """A `LineIndexer` run on a thread of its own, fed through staging buffers (see the module docstring).

    `feed` (the fill's observer) copies the chunk into the current staging
    buffer and hands a full one to the thread; `finish` hands over the rest,
    waits for the thread and returns the index. `close` stops the thread
    without an index (a fill that failed); both are safe to call more than
    once. A bug in the indexing is raised again by `finish`, never hidden.
    """

    STAGE = 1 << 20
    BUFFERS = 4

    def __init__(self, window: int = WINDOW) -> None:
        self._indexer = LineIndexer(window)
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._work: queue.Queue[tuple[bytearray, int, int] | None] = queue.Queue()
        self._made = 0  # staging buffers allocated (at most BUFFERS)
        self._thread: threading.Thread | None = None
        self._stage: bytearray | None = None
        self._stage_at = 0  # the object offset of the stage's first byte
        self._staged = 0  # bytes in the stage
        self._error: BaseException | None = None

    def feed(self, chunk: memoryview, offset: int) -> None:
        """Stage bytes [offset, offset + len(chunk)); a new try (offset 0) or a gap hands over the stage first."""
        if self._stage is not None and offset != self._stage_at + self._staged:
            self._hand_over()
        n, done = len(chunk), 0
        while done < n:
            if self._stage is None:
                self._stage, self._stage_at, self._staged = self._take(), offset + done, 0
            k = min(n - done, self.STAGE - self._staged)
            self._stage[self._staged : self._staged + k] = chunk[done : done + k]
            self._staged += k
            done += k
            if self._staged == self.STAGE:
                self._hand_over()

    def _take(self) -> bytearray:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sluice-line-index", daemon=True)
            self._thread.start()
        if self._made < self.BUFFERS and self._free.empty():
            self._made += 1
            return bytearray(self.STAGE)
        return self._free.get()

    def _hand_over(self) -> None:
        if self._stage is not None:
            self._work.put((self._stage, self._stage_at, self._staged))
            self._stage = None

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            buf, at, n = item
            if self._error is None:
                try:
                    with memoryview(buf) as view:
                        self._indexer.feed(view[:n], at)
                except BaseException as exc:  # raised again by `finish`
                    self._error = exc
            self._free.put(buf)

    def close(self) -> None:
        """Index what is staged and stop the thread."""
        self._hand_over()
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None

    def finish(self, digest: str, size: int) -> LineIndex | None:
        """`LineIndexer.finish` once every staged byte is indexed."""
        self.close()
        if self._error is not None:
            raise self._error
        return self._indexer.finish(digest, size)
