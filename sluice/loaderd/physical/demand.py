"""Documents tokenized out of order, before the in-order fill of their object reaches them.

A text object is tokenized front to back into the token shard the node cache
keeps (docsource.py, tokcache.py); a step in `block` order draws documents
from anywhere in the object, so without this the first step of a 300 MB
object waits for nearly all of it. `Demand` holds, per object in progress,
the records a step needs beyond the fill's position: the ones a packer is
waiting for (`wanted`) and the ones prefetch announced for the next steps
(`ahead`, kept per caller, i.e. per replica's producer thread, and
replaced by that caller's every prefetch, so work for a position a RESTORE
left behind is dropped before it starts, and one replica never drops
another's). One demand task per object reads
those records' texts with a `RecordLocator` (counting lines, parsing only
the records asked for), encodes them in one call and parks the arrays in
`side`, where the waiting packer takes them::

    packer: doc(r), r far beyond the fill  ->  wanted += {r}; wait
    demand task: texts(wanted, else the next of ahead) -> encode_batch -> side[r]; notify
    fill reaches r: writes side[r] as it is (FillEncoder: not tokenized again), then drops it

The ids are the same: `encode_batch` encodes each text on its own (the
tokenizer has no cross-document state), and the locator gives the texts
`iter_text_chunks` gives (tests/test_records.py). So which path made a
document's tokens never changes a byte served.

Bounds, per object in progress: `side` at most `SIDE_BYTES` of token arrays;
past it the oldest go to a spill file (unlinked, in the node cache's tmp/,
closed with the object's entry) that the fill and the packers read back, at
most `SPILL_BYTES` of disk and `SPILL_DOCS` documents not yet reached by the
fill (about 100 bytes of memory each); past those they are dropped (a packer
that still needs one asks again, the fill tokenizes it again). A disk that
refuses a write (full, a short write, the folder gone) ends spilling for the
object, and one that does not give back a whole array (a failed read) is
treated the same way: not held, made again; never a short array. Without the
spill, a 300 MB object read once in block order had 108k of its 151k
records tokenized twice (docs/tokenize.md, "Each document tokenized once");
one demand batch at most `BATCH` records (`AHEAD_BATCH` when nobody waits,
so a packer's record waits behind at most that many); `ahead` is each
caller's last prefetch's records (a bounded number of steps per replica); the locator's bounds are in
sluice/tokenize/records.py.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Any

import numpy as np

SIDE_BYTES = 16 << 20  # token arrays parked per object (about 250 steps of 16k uint32 tokens)
# Past SIDE_BYTES the oldest parked arrays go to a spill file (unlinked, in the cache's tmp/) that the fill
# reads back instead of tokenizing them again, up to these bounds per object; past them they are dropped.
SPILL_BYTES = 512 << 20  # disk
SPILL_DOCS = 1 << 17  # documents spilled and not yet reached by the fill (memory: ~100 bytes each)
BATCH = 512  # records per demand batch (one encode call)
AHEAD_BATCH = 64  # records per batch made only because prefetch announced them

YIELD_S = 2.0  # the longest an in-order fill waits between two chunks for demand tasks
# A fill whose chunks (decode, encode, write) take less than this (the median of its last few) does not
# pause for demand tasks: a demand batch waits behind such a chunk no longer than behind another demand
# batch, and the fill, not the demand path, then tokenizes the object (fastokens makes a 256 KiB chunk in
# 1-6 ms here; `tokenizers` in 0.1-0.4 s). Finished objects are served from their map by the fused path;
# while one fills, every step falls back to the plan's (docs/logical.md, reason `filling`).
# DocSource._between_chunks applies it.
FREE_CHUNK_S = 0.02
YIELD_CHUNKS = 8  # else a pause lasts at most this many chunks' time (and `YIELD_S`): the fill gets >= 1/9
FAST_FILL_BACKENDS = ("fastokens",)  # taken as cheap until their chunks are timed (below)
_UNTIMED = 2  # the first chunk (32 KiB) and the first encode (pool start, cold caches) are not timed
_TIMED = 5  # the chunks the median is taken over


class FillPace:
    """One fill's chunk clock: the median time of its last `_TIMED` chunks (decode, encode, write; not its
    pauses, not the first `_UNTIMED`), from which `lap` says how long it may pause. Until it has timed 3,
    a backend of `FAST_FILL_BACKENDS` is taken to be cheap (no pause) and any other to be slow (up to
    `YIELD_S`, as every fill paused before): the first batch of a slow backend keeps the pool."""

    __slots__ = ("mark", "seen", "times", "cheap")

    def __init__(self, backend: str = "hf") -> None:
        self.mark = 0.0  # the end of the last pause (0.0: before the first chunk)
        self.seen = 0
        self.times: list[float] = []
        self.cheap = backend in FAST_FILL_BACKENDS

    def lap(self, now: float) -> float:
        """A chunk ended at `now`: the longest pause after it (0: none)."""
        if self.mark:
            self.seen += 1
            if self.seen > _UNTIMED:
                self.times = [*self.times[-(_TIMED - 1):], now - self.mark]
        if len(self.times) < 3:
            return 0.0 if self.cheap else YIELD_S
        median = sorted(self.times)[len(self.times) // 2]
        return 0.0 if median < FREE_CHUNK_S else min(YIELD_S, YIELD_CHUNKS * median)


class Demand:
    """The out-of-order state of one object in progress; guarded by its entry's condition."""

    __slots__ = ("key", "wanted", "ahead", "side", "side_bytes", "busy", "locator", "served", "spill_dir",
                 "spill", "spill_at", "spilled")

    def __init__(self, key: tuple[int, int], spill_dir: str | None = None) -> None:
        self.key = key  # (source, object)
        self.wanted: set[int] = set()
        # Announced records per caller (a producer thread: one per replica), each an ordered set in
        # need order; a caller's prefetch replaces only its own (DocSource.prefetch).
        self.ahead: dict[int, dict[int, None]] = {}
        self.side: OrderedDict[int, np.ndarray] = OrderedDict()
        self.side_bytes = 0
        self.busy = False  # a demand task is scheduled or running
        self.locator: Any = None  # opened by the task on first use; closed by it (or by `close` when idle)
        self.served = 0  # documents tokenized by this path
        # Arrays past SIDE_BYTES: appended to `spill` (u32 LE token count, then the tokens), by record;
        # the fill takes them back (`reuse`). None spill_dir: dropped instead.
        self.spill_dir = spill_dir
        self.spill: Any = None
        self.spill_at = 0  # bytes written to it (never reused: at most SPILL_BYTES)
        self.spilled: dict[int, int] = {}  # record -> its offset in `spill`

    def take(self, ready: int) -> list[int]:
        """Under the lock: the next batch of records to make (beyond `ready`, not yet made), removed
        from the sets: what packers wait for first, else the next announced ones in need order,
        the callers' announcements taken in turn (one replica's steps do not wait behind another's)."""
        wanted = sorted(r for r in self.wanted if r >= ready and not self.has(r))
        self.wanted = set(wanted[BATCH:])
        if wanted:
            todo = wanted[:BATCH]
            for ahead in self.ahead.values():
                for r in todo:
                    ahead.pop(r, None)
            return todo
        todo, chosen = [], set()
        queues = [(caller, iter(list(ahead))) for caller, ahead in self.ahead.items()]
        while queues and len(todo) < AHEAD_BATCH:
            for caller, it in list(queues):
                r = next(it, None)
                if r is None:
                    queues.remove((caller, it))
                    continue
                del self.ahead[caller][r]
                if r >= ready and not self.has(r) and r not in chosen:
                    todo.append(r)
                    chosen.add(r)
                    if len(todo) == AHEAD_BATCH:
                        break
        self.ahead = {caller: ahead for caller, ahead in self.ahead.items() if ahead}
        return todo

    def announce(self, caller: int, records: list[int], ready: int) -> bool:
        """Under the lock: `caller`'s announced records of this object are now `records` (in need order,
        those beyond `ready`), replacing only that caller's earlier ones; True if any is left."""
        ahead = {r: None for r in records if r >= ready}
        if ahead:
            self.ahead[caller] = ahead
        else:
            self.ahead.pop(caller, None)
        return bool(ahead)

    def drop_ahead(self, caller: int | None = None) -> int:
        """Under the lock: drop `caller`'s announced records (every caller's: None); how many were dropped."""
        if caller is None:
            dropped = sum(map(len, self.ahead.values()))
            self.ahead.clear()
            return dropped
        return len(self.ahead.pop(caller, ()))

    def park(self, records: list[int], arrays: list[np.ndarray], ready: int) -> tuple[int, int, int]:
        """Under the lock: keep what was made (beyond `ready`); past `SIDE_BYTES` the oldest go to the
        spill file, or are dropped past its bounds. Returns (made but already passed by the fill,
        spilled, dropped): the first and last are documents whose tokens the fill makes again
        (counted by DocSource, docs/tokenize.md "Each document tokenized once")."""
        late = 0
        for r, a in zip(records, arrays):
            if r >= ready and not self.has(r):
                self.side[r] = a
                self.side_bytes += a.nbytes
            elif r < ready:
                late += 1
        self.served += len(records)
        spilled = dropped = 0
        while self.side_bytes > SIDE_BYTES and len(self.side) > len(records):
            r, old = self.side.popitem(last=False)
            self.side_bytes -= old.nbytes
            if self._spill(r, old):
                spilled += 1
            else:
                dropped += 1
        return late, spilled, dropped

    def has(self, record: int) -> bool:
        """Under the lock: whether the record's tokens are held (parked or spilled)."""
        return record in self.side or record in self.spilled

    def get(self, record: int) -> np.ndarray | None:
        """Under the lock: the record's tokens if held (parked, or read back from the spill file)."""
        got = self.side.get(record)
        if got is None and record in self.spilled:
            got = self._read(self.spilled[record])
            if got is None:  # not given back whole: no longer held, so a demand batch makes it again
                del self.spilled[record]
        return got

    def reuse(self, record: int) -> np.ndarray | None:
        """Under the lock: `get` for the fill, which reaches each record once: a spilled one is
        forgotten once read back."""
        got = self.side.get(record)
        if got is None and record in self.spilled:
            got = self._read(self.spilled.pop(record))
        return got

    def _spill(self, record: int, tokens: np.ndarray) -> bool:
        """Append `tokens` to the spill file; False (dropped) past the bounds, without a folder, or
        when the disk refuses (no more spilling for this object)."""
        size = 4 + tokens.nbytes
        if self.spill_dir is None or len(self.spilled) >= SPILL_DOCS or self.spill_at + size > SPILL_BYTES:
            return False
        try:
            if self.spill is None:
                self.spill = tempfile.TemporaryFile(prefix="demand-spill-", dir=self.spill_dir)
            data = np.uint32(len(tokens)).astype("<u4").tobytes() + tokens.astype("<u4", copy=False).tobytes()
            # A disk that fills up mid-write takes part of it and returns a short count without raising:
            # such a record must never be read back (tests/test_attack_demand_spill.py).
            if os.pwrite(self.spill.fileno(), data, self.spill_at) != len(data):
                raise OSError("short write")
        except OSError:
            self.spill_at = SPILL_BYTES
            return False
        self.spilled[record] = self.spill_at
        self.spill_at += size
        return True

    def _read(self, offset: int) -> np.ndarray | None:
        """The array spilled at `offset`; None (not held: tokenized again) if the disk does not give
        back what was written."""
        fd = self.spill.fileno()
        try:
            head = os.pread(fd, 4, offset)
            n = int(np.frombuffer(head, "<u4")[0]) if len(head) == 4 else -1
            data = os.pread(fd, 4 * n, offset + 4) if n >= 0 else b""
        except OSError:
            return None
        if n < 0 or len(data) != 4 * n:
            return None
        return np.frombuffer(data, "<u4").astype(np.uint32, copy=False)

    def passed(self, ready: int) -> None:
        """Under the lock: the fill now serves [0, ready): drop what it passed."""
        for r in [r for r in self.side if r < ready]:
            self.side_bytes -= self.side.pop(r).nbytes
        self.wanted = {r for r in self.wanted if r >= ready}
        self.ahead = {caller: kept for caller, ahead in self.ahead.items()
                      if (kept := {r: None for r in ahead if r >= ready})}

    def release(self) -> None:
        """Drop parked arrays and pending records; close the locator (only when no task uses it)."""
        self.side.clear()
        self.side_bytes = 0
        self.wanted.clear()
        self.ahead.clear()
        self.spilled.clear()
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        if not self.busy:
            self.close_locator()

    def close_locator(self) -> None:
        if self.locator is not None:
            self.locator.close()
            self.locator = None



class FillEncoder:
    """The in-order fill's encoder for an object that has a demand path: documents the demand task
    already made (still parked in `demand.side`) are taken from there, not tokenized again.

    Contract (as `sluice.tokenize.tokcache.tokenize_into` calls it): `encode_batch` is called once
    per chunk, chunks in record order from record 0, so the k-th text of a call is record
    `first + k`. The ids are the same either way (the demand path encodes each text on its own
    with the same tokenizer), so the token object written is byte for byte a plain fill's
    (tests/test_demand_reuse.py). Everything else is the wrapped encoder's.
    """

    def __init__(self, encoder: Any, entry: Any) -> None:
        self._enc = encoder
        self._entry = entry
        self._next = 0  # the record of the next text
        self.reused = 0  # documents taken from the demand path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._enc, name)

    def restart(self) -> None:
        """The fill writes the object again from record 0 (tokcache.fill_tokens, a full disk)."""
        self._next = 0

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        first, n = self._next, len(texts)
        self._next += n
        taken: dict[int, np.ndarray] = {}
        entry = self._entry
        with entry.cond:
            demand = entry.demand
            if demand is not None and (demand.side or demand.spilled):
                for r in range(first, first + n):
                    a = demand.reuse(r)
                    if a is not None:
                        taken[r - first] = a
        if not taken:
            out: list[np.ndarray] = self._enc.encode_batch(texts)
            return out
        rest = [i for i in range(n) if i not in taken]
        made = self._enc.encode_batch([texts[i] for i in rest]) if rest else []
        merged: list[Any] = [None] * n
        for i, a in taken.items():
            merged[i] = a
        for i, a in zip(rest, made):
            merged[i] = a
        self.reused += len(taken)
        return merged
