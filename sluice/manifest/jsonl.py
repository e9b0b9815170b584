"""The jsonl record rule: split lines, count records, validate each line.

A *record* is a non-empty line (a line that is `""` or `"\\r"` is blank). With
`check="full"` every record must be a JSON object (as `json.loads` reads it)
with a string under `text_field` and no unpaired surrogate escape in it; a bad
line fails with the object and its line number.

Two paths give the same answer:

* **The block path** (when `msgspec` is installed): the complete lines of a
  block of up to `BLOCK` bytes are checked in C. The newlines are found (one
  memchr per line when lines are long, numpy over the block when they are
  short) and every non-blank line must start with `{` and end with `}` (or
  `}\\r`); msgspec decodes the block's values in one call; the value count
  must equal the non-blank line count, and every value must hold a string
  under `text_field`. (A decode into a Struct of the text field alone skips
  the other values: msgspec then checks their syntax but not their UTF-8
  nor Python's limit on integer digits; with those checks added back it
  gained 0-3%, so it is not used: docs/manifest.md.) Why this is exact: a
  JSON string cannot hold a raw newline, so every newline lies between
  tokens; `}` followed (across whitespace) by `{` is valid JSON only between
  two top-level values, so every newline is a value boundary, and equal
  counts leave one value per line. msgspec accepts a subset of what
  `json.loads` accepts (it refuses NaN/Infinity, lone surrogate escapes and
  out-of-range numbers).
* **The line path**: each line through `json.loads`, exactly as before. A
  block that the block path does not accept in full (any refusal above, a
  leading space, a NaN) is re-read line by line here, which either accepts it
  (NaN is valid for `json.loads`) or raises the error naming the line.

So the block path changes speed only: the records counted, the texts read and
every error message are those of the line path. One edge is not exact, and
never was: both parsers stop at Python's recursion limit counted from the
caller's stack depth, so a line nested about 990 levels deep may pass in one
place and fail in another (here msgspec allowed 996 levels where `json.loads`
allowed 992). `check="count"` counts
records from newlines without parsing (see `_count`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from sluice.errors import SourceReadError

try:  # an optional wheel (extra `fast`): the block path
    import msgspec

    _DECODER: Any = msgspec.json.Decoder()
    _DECODE_ERRORS: tuple[type[BaseException], ...] = (msgspec.MsgspecError, RecursionError, ValueError)
except ImportError:  # pragma: no cover - exercised by the line path tests
    _DECODER = None
    _DECODE_ERRORS = ()

BLOCK = 1 << 20  # bytes of complete lines checked per block: bounds the newline index (8 bytes a line)
LONG_LINE = 1024  # mean line bytes from which lines are found one by one (memchr) rather than with numpy
COALESCE = 1 << 20  # the line path splits bigger chunks (bounds its per-line bookkeeping)

PAIR_SLICE = 1 << 20  # newline-mask bytes ANDed per step by the count's blank-line test (see _adjacent_newlines)


def scratch_for(n: int) -> Any:
    """A bool array big enough for `_count` on chunks of up to `n` bytes (newline mask + pair slice)."""
    return np.empty(n + PAIR_SLICE, dtype=bool)


_NON_EMPTY = re.compile(rb"[^\n]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _blank_lines_after_first(chunk: Any, n: int) -> int:
    """Blank lines ("" or "\\r") ending at a newline after the chunk's first newline, counted
    with numpy a megabyte at a time (a chunk of blank lines never becomes a list of lines)."""
    a = np.frombuffer(chunk, np.uint8, count=n)
    blanks = 0
    for lo in range(0, n, COALESCE):
        start = max(0, lo - 2)  # two bytes of look-behind from the previous slice
        part = a[start : min(n, lo + COALESCE)]
        skip = lo - start
        nl, cr = part == 10, part == 13
        # newline right after a newline: "\n\n"; after "\n\r": "\n\r\n"
        blanks += int(np.count_nonzero((nl[1:] & nl[:-1])[max(0, skip - 1):]))
        blanks += int(np.count_nonzero((nl[2:] & cr[1:-1] & nl[:-2])[max(0, skip - 2):]))
    return blanks


class JsonlScanner:
    """Line splitter + record rule for jsonl, fed chunk by chunk.

    `feed(chunk, n)` takes bytes or a reused bytearray of which the first `n`
    bytes are valid; `finish()` ends the object. `records` counts records,
    `texts` (when `collect`) holds their texts in order.
    """

    def __init__(self, where: str, text_field: str, check: str, collect: bool, max_line: int = 64 << 20,
                 *, block_path: bool = True) -> None:
        self.where, self.text_field, self.check, self.max_line = where, text_field, check, max_line
        self.texts: list[str] | None = [] if collect else None
        self.lines = 0  # complete lines consumed
        self.records = 0
        self.pending = bytearray()
        self.partial = 0  # count mode: bytes of the line not yet ended (pending keeps only 2 of them)
        self.scratch = np.empty(0, dtype=bool)  # the newline count's (a caller may lend a reused one)
        self.fast = block_path and _DECODER is not None
        self._long_lines = False  # how the block path finds lines (see _shape)

    def feed(self, chunk: Any, n: int | None = None) -> None:
        n = len(chunk) if n is None else n
        if self.check == "count" and self.texts is None:
            if n > COALESCE:  # bounds the blank-line bookkeeping (a chunk of blank lines)
                view = memoryview(chunk)
                for i in range(0, n, COALESCE):
                    self._count(bytes(view[i : min(n, i + COALESCE)]))
                return
            self._count(chunk, n)
            return
        first = chunk.find(b"\n", 0, n)
        if first < 0:
            self.pending += memoryview(chunk)[:n]
            self._check_length(len(self.pending), self.lines + 1)
            return
        last = chunk.rfind(b"\n", 0, n)
        # The line begun in the previous chunk, then blocks of whole lines, read in place.
        if self.pending:
            head = bytes(self.pending) + bytes(memoryview(chunk)[: first + 1])
            self._lines(head, 0, len(head))
        else:
            self._lines(chunk, 0, first + 1)
        start = first + 1
        while start <= last:
            end = chunk.rfind(b"\n", start, min(start + BLOCK, last + 1))
            if end < 0:  # one line longer than BLOCK
                end = chunk.find(b"\n", start, last + 1)
            self._lines(chunk, start, end + 1)
            start = end + 1
        self.pending = bytearray(memoryview(chunk)[last + 1 : n])
        self._check_length(len(self.pending), self.lines + 1)

    def _lines(self, chunk: Any, lo: int, hi: int) -> None:
        """Consume chunk[lo:hi]: complete lines, the last ending with a newline."""
        if not (self.fast and self._block(chunk, lo, hi)):
            self._line_by_line(bytes(memoryview(chunk)[lo:hi]))

    def _shape(self, chunk: Any, lo: int, hi: int) -> tuple[int, int, int] | None:
        """(lines, records, longest line) of chunk[lo:hi] when every non-blank line
        starts with "{" and ends with "}" or "}\r"; None otherwise.

        Long lines (the common case) are walked with memchr in Python, one step
        a line; short ones with numpy, a few passes over the bytes.
        """
        if self._long_lines:
            find = chunk.find
            lines = records = longest = 0
            s = lo
            while s < hi:
                e = find(b"\n", s, hi)
                size = e - s
                lines += 1
                if size > 1 or (size == 1 and chunk[s] != 13):
                    c = chunk[e - 1]
                    if chunk[s] != 123 or (c != 125 and not (c == 13 and size >= 2 and chunk[e - 2] == 125)):
                        return None
                    records += 1
                    longest = max(longest, size)
                s = e + 1
            return lines, records, longest
        a = np.frombuffer(chunk, np.uint8, count=hi - lo, offset=lo)
        ends = np.flatnonzero(a == 10)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lens = ends - starts
        first = a[starts]  # for an empty line: its own newline
        last = a[ends - 1]  # for an empty first line: the block's last byte (masked below)
        before_cr = a[np.maximum(ends - 2, 0)]
        blank = (lens == 0) | ((lens == 1) & (first == 13))
        shaped = (first == 123) & ((last == 125) | ((last == 13) & (lens >= 2) & (before_cr == 125)))
        if not bool(np.all(blank | shaped)):
            return None
        return ends.size, ends.size - int(np.count_nonzero(blank)), int(lens.max())

    def _block(self, chunk: Any, lo: int, hi: int) -> bool:
        """The block path (see the module docstring); False leaves the block unconsumed."""
        shape = self._shape(chunk, lo, hi)
        if shape is None or shape[2] > self.max_line:
            return False
        lines, records, _ = shape
        self._long_lines = (hi - lo) >= LONG_LINE * lines  # the next block is likely alike
        try:
            values = _DECODER.decode_lines(memoryview(chunk)[lo:hi])
        except _DECODE_ERRORS:
            return False
        if len(values) != records:
            return False
        try:  # every value is a dict: each non-blank line starts with "{"
            texts = [v[self.text_field] for v in values]
        except KeyError:
            return False
        if texts and set(map(type, texts)) != {str}:
            return False
        self.lines += lines
        self.records += records
        if self.texts is not None:
            self.texts.extend(texts)
        return True

    def _line_by_line(self, head: bytes) -> None:
        """The line path over complete lines; raises naming the first bad line.

        Only non-empty lines are visited (runs of blank lines are skipped in
        C, so a block of blank lines costs no Python per line); a line's
        number is the newlines before it, plus one.
        """
        base, pos, before = self.lines, 0, 0
        for match in _NON_EMPTY.finditer(head):
            before += head.count(b"\n", pos, match.start())
            pos = match.start()
            line = match.group()
            self._check_length(len(line), base + before + 1)
            self._line(line, base + before + 1)
        self.lines = base + head.count(b"\n")

    def _check_length(self, size: int, number: int) -> None:
        if size > self.max_line:
            raise SourceReadError(
                f"{self.where}: line {number}: longer than the limit of {self.max_line} bytes "
                f"(a document that large, or a compression bomb)"
            )

    def _count(self, chunk: Any, n: int | None = None) -> None:
        # Fast path: records = complete lines minus blank ones. Newlines are
        # counted with numpy (SIMD compare into a reused scratch array), and a
        # blank line can only hide behind "\n\n" (two adjacent newlines in that
        # mask: `_adjacent_newlines`), a "\r", or at the start of the pending
        # line. Only when one of those shows up is the chunk split and
        # counted line by line. `chunk` is bytes or a reused bytearray of which
        # the first `n` bytes are valid.
        n = len(chunk) if n is None else n
        if self.scratch.size < n + PAIR_SLICE:
            self.scratch = scratch_for(n)
        eq = self.scratch[:n]
        np.equal(np.frombuffer(chunk, np.uint8, count=n), 10, out=eq)
        newlines = int(np.count_nonzero(eq))
        if newlines == 0:
            self.pending += chunk[: max(0, 2 - len(self.pending))]
            self.partial += n
            self._check_length(self.partial, self.lines + 1)
            return
        first = chunk.find(b"\n", 0, n)
        self._check_length(self.partial + first, self.lines + 1)
        if n > self.max_line:  # a whole line could fit inside this chunk (only with a small max_line)
            ends = np.flatnonzero(eq)
            gaps = np.diff(ends) - 1
            if gaps.size and int(gaps.max()) > self.max_line:
                k = int(np.argmax(gaps > self.max_line))
                self._check_length(int(gaps[k]), self.lines + k + 2)
        start = bytes(self.pending) + bytes(chunk[:first]) if first <= 2 else b"xx"
        first_blank = start in (b"", b"\r")
        suspect = chunk.find(b"\r", 0, n) >= 0 or self._adjacent_newlines(eq)
        blanks = _blank_lines_after_first(chunk, n) if suspect else 0
        self.lines += newlines
        self.records += newlines - blanks - (1 if first_blank else 0)
        last = chunk.rfind(b"\n", 0, n)
        # Only whether the partial line is blank matters: keep its first 2 bytes.
        self.pending = bytearray(chunk[last + 1 : min(last + 3, n)])
        self.partial = n - last - 1

    def _adjacent_newlines(self, eq: Any) -> bool:
        """Whether two newlines are adjacent ("\\n\\n": a blank line): `eq` (the chunk's newline
        mask, at the start of `scratch`) ANDed with itself shifted by one, PAIR_SLICE bytes at a
        time into the rest of `scratch` (one in-cache pass; 16-bit compares at both alignments
        of the raw bytes took 1.5x as long)."""
        n = eq.size
        pairs = self.scratch[n : n + PAIR_SLICE]
        for lo in range(0, n - 1, PAIR_SLICE):
            hi = min(n - 1, lo + PAIR_SLICE)
            out = pairs[: hi - lo]
            np.logical_and(eq[lo:hi], eq[lo + 1 : hi + 1], out=out)
            if out.any():
                return True
        return False

    def text_of_line(self, line: bytes, number: int) -> str | None:
        """The text of one record line (`number` is 1-based, for errors); None for a blank line.

        The same rule and errors as a full scan, for a reader that located the
        line itself (out-of-order tokenization, sluice.tokenize.records).
        """
        self.texts = []
        self._line(line, number)
        return self.texts[0] if self.texts else None

    def _line(self, line: bytes, number: int) -> None:
        if line in (b"", b"\r"):
            return
        self.records += 1
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise SourceReadError(f"{self.where}: line {number}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
        except json.JSONDecodeError as exc:
            raise SourceReadError(f"{self.where}: line {number}: not JSON ({exc.msg} at column {exc.colno})") from exc
        except RecursionError as exc:
            raise SourceReadError(f"{self.where}: line {number}: JSON nested too deeply") from exc
        except ValueError as exc:  # e.g. an integer beyond Python's 4300-digit conversion limit
            raise SourceReadError(f"{self.where}: line {number}: not usable JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise SourceReadError(f"{self.where}: line {number}: expected a JSON object, got {type(obj).__name__}")
        text = obj.get(self.text_field)
        if not isinstance(text, str):
            what = "missing" if self.text_field not in obj else f"not a string ({type(text).__name__})"
            raise SourceReadError(f"{self.where}: line {number}: text field {self.text_field!r} {what}")
        # A \uD800-\uDFFF escape decodes to a lone surrogate: not Unicode text, and
        # the tokenizer refuses it (TypeError) long after freeze. Only an escape
        # can make one (the line itself was valid UTF-8), so look only then.
        if (b"\\ud" in line or b"\\uD" in line) and _SURROGATE.search(text):
            raise SourceReadError(f"{self.where}: line {number}: text field {self.text_field!r} holds an unpaired "
                                  "surrogate escape (\\ud800-\\udfff): not Unicode text")
        if self.texts is not None:
            self.texts.append(text)

    def finish(self) -> None:
        if self.check == "count" and self.texts is None:
            if bytes(self.pending) not in (b"", b"\r"):
                self.records += 1
            return
        if self.pending:
            self.lines += 1
            self._check_length(len(self.pending), self.lines)
            self._line(bytes(self.pending), self.lines)
            self.pending = bytearray()
