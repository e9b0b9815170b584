"""The line indexes of raw jsonl objects a DocSource locates records in: in memory, and in the node cache.

A raw fill of a plain jsonl object builds its `LineIndex` from the bytes it
hashes (sluice/tokenize/lineindex.py); the out-of-order path then locates
any record without counting lines. `LineIndexes` keeps those indexes by
digest in memory (least recently used dropped past `MAX_BYTES` of marks) and
in the node cache (sluice/tokenize/lineindexfile.py), so a restarted daemon,
or a second one on the node, whose raw fetch is a hit, reads the index
instead of counting::

    index = indexes.get(digest)                    # in memory, or None
    index = indexes.load(obj, raw_path)            # from the node cache (kept in memory), or None
    indexes.keep(index); indexes.store(index)      # after a fill made one
    indexes.build_later(obj, raw_path)             # none stored (a raw hit): made off the serving path
    indexes.ensure(obj, raw_path, made)            # `sluice cache warm`: stored now, whatever it found

A stored index that its reader refuses (damaged, made for other bytes), or
whose record count is not the manifest's for the object, is
dropped from the node cache (quarantined, counted in `refused`, logged with
the file's name) and built again from the raw file in one pass, the pass the
locator would otherwise make, then stored again.

Thread-safe; every method may be called from fills and demand tasks at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from sluice.errors import CacheError, SluiceError
from sluice.tokenize.lineindex import LineIndex, LineIndexer

log = logging.getLogger("sluice.loaderd")

# Kept by digest, least recently used dropped past this many bytes of marks (0.4 MB per GB of
# text at 64 KiB windows: about 40 GB of objects).
MAX_BYTES = 16 << 20
_READ = 1 << 20  # bytes per read when an index is built again from the raw file
# Objects whose index waits to be built off the serving path (each holds an open descriptor of its
# raw file); past it `build_later` leaves the object to the next daemon.
MAX_PENDING = 16


class LineIndexes:
    """Line indexes by raw digest: a bounded in-memory LRU over the node cache's stored ones."""

    def __init__(self, cache: Any, max_bytes: int = MAX_BYTES) -> None:
        self._cache = cache
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_digest: OrderedDict[str, LineIndex] = OrderedDict()
        self._bytes = 0
        self.loaded = 0  # indexes read from the node cache (no line counted for them)
        self.refused = 0  # stored indexes refused (damaged or foreign), dropped and built again
        self.stored = 0  # indexes this process wrote to the node cache
        self.built = 0  # indexes built from a cached raw file that had none (build_later, ensure)
        self._pending: set[str] = set()  # digests queued for build_later; guarded by `_lock`
        self._builder: Any = None  # the ThreadPoolExecutor of build_later, started on first use
        self._closing = threading.Event()

    def close(self, deadline: float | None = None) -> list[str]:
        """Stop `build_later`'s thread (a build in progress stops at its next read; nothing is stored),
        waiting until `deadline` (time.monotonic(); None: as long as it takes); the names of threads still
        running then."""
        from sluice.procpool import stop_threads

        self._closing.set()
        with self._lock:
            builder = self._builder
        if builder is None:
            return []
        return stop_threads(builder, float("inf") if deadline is None else deadline)

    def ensure(self, obj: Any, raw_path: str, made: LineIndex | None = None) -> LineIndex | None:
        """Make sure the node cache holds the index of raw object `obj` (pinned at `raw_path`, its
        bytes checked): `made` (by the fill's indexer) stored; else the stored one (loaded; a refused
        one built again), else one built now in one pass over the file and stored. An index whose
        record count is not the manifest's (`obj.records`) is not stored: the object is not the
        jsonl the manifest describes, and its reader reports that. Synchronous (`sluice cache warm`)."""
        index = made if made is not None else self.get(obj.digest) or self.load(obj, raw_path)
        if index is not None:
            if made is not None and made.records == obj.records:
                self.keep(made)
                self.store(made)
            return index
        built = build_from_file(raw_path, obj.digest, obj.size)
        if built is None or built.records != obj.records:
            return None
        with self._lock:
            self.built += 1
        self.keep(built)
        self.store(built)
        return built

    def build_later(self, obj: Any, raw_path: str) -> bool:
        """Build, keep and store the index of raw object `obj` (pinned at `raw_path` now) on a thread of
        its own, once per digest; False when it is not queued (queued already, `MAX_PENDING` reached,
        closing, or the file cannot be opened). The file is opened here, so its bytes stay readable
        whatever the cache does with the pin afterwards."""
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            if (obj.digest in self._pending or len(self._pending) >= MAX_PENDING or self._closing.is_set()
                    or obj.digest in self._by_digest):
                return False
            try:
                f = open(raw_path, "rb", buffering=0)
            except OSError as exc:
                log.warning("the line index of raw object %s is not built (%s)", obj.digest, exc)
                return False
            self._pending.add(obj.digest)
            if self._builder is None:
                self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loaderd-lineindex")
            builder = self._builder
        try:
            builder.submit(self._build, obj, f)
        except RuntimeError:  # shut down meanwhile (closing)
            f.close()
            with self._lock:
                self._pending.discard(obj.digest)
            return False
        return True

    def _build(self, obj: Any, f: Any) -> None:
        try:
            with f:
                index = _build(f, obj.digest, obj.size, self._closing)
            if index is None or self._closing.is_set():
                return
            with self._lock:
                self.built += 1
            self.keep(index)
            self.store(index)
        except Exception as exc:  # (an I/O error): the next daemon counts, as before; never hidden
            log.warning("the line index of raw object %s could not be built: %r", obj.digest, exc)
        finally:
            with self._lock:
                self._pending.discard(obj.digest)

    def get(self, digest: str) -> LineIndex | None:
        """The index of the raw object `digest` if held in memory."""
        with self._lock:
            index = self._by_digest.get(digest)
            if index is not None:
                self._by_digest.move_to_end(digest)
            return index

    def keep(self, index: LineIndex | None) -> None:
        """Hold `index` in memory (None: nothing, e.g. the fill did not see the whole object)."""
        if index is None:
            return
        with self._lock:
            old = self._by_digest.pop(index.digest, None)
            self._bytes += index.nbytes - (old.nbytes if old is not None else 0)
            self._by_digest[index.digest] = index
            while self._bytes > self._max_bytes and len(self._by_digest) > 1:
                _, dropped = self._by_digest.popitem(last=False)
                self._bytes -= dropped.nbytes

    def store(self, index: LineIndex) -> None:
        """Write `index` to the node cache once (a cache that cannot keep it is no error: the
        next daemon counts the lines, as before)."""
        from sluice.tokenize.lineindexfile import index_key, write_index

        try:
            self._cache.put_derived(index_key(index.digest), lambda tmp: write_index(tmp, index)).close()
        except (CacheError, OSError) as exc:
            log.warning("the line index of raw object %s is not kept in the node cache (%s)", index.digest, exc)
            return
        with self._lock:
            self.stored += 1

    def load(self, obj: Any, raw_path: str) -> LineIndex | None:
        """The index of raw object `obj` (pinned at `raw_path`) from the node cache, held in memory
        from now on; None if the cache has none. A refused one is dropped and built again here."""
        from sluice.tokenize.lineindexfile import index_key, read_index

        key = index_key(obj.digest)
        try:
            pin = self._cache.get_derived(key)
        except SluiceError as exc:  # (a lock timeout): the locator counts instead
            log.warning("the line index of raw object %s could not be looked up (%s)", obj.digest, exc)
            return None
        if pin is None:
            return None
        try:
            index = read_index(pin.path, obj.digest, obj.size)
            if index.records != obj.records:  # marks for other bytes (their digest is not checked here)
                raise CacheError(f"cached line index {pin.path}: {index.records} records, but object "
                                 f"{obj.digest} has {obj.records} in the manifest")
        except (CacheError, OSError) as exc:
            refused = str(exc)
        else:
            with self._lock:
                self.loaded += 1
            self.keep(index)
            return index
        finally:
            pin.close()
        log.warning("%s: refused, dropped from the node cache and built again from %s", refused, raw_path)
        with self._lock:
            self.refused += 1
        try:
            self._cache.drop_derived(key, refused)
        except (CacheError, OSError) as exc:
            log.warning("the refused line index of raw object %s stays in the node cache (%s)", obj.digest, exc)
            return None  # a new one could not replace it: the locator counts
        rebuilt = build_from_file(raw_path, obj.digest, obj.size)
        self.keep(rebuilt)
        if rebuilt is not None:
            self.store(rebuilt)
        return rebuilt


def build_from_file(path: str, digest: str, size: int) -> LineIndex | None:
    """The line index of the (already digest-checked, pinned) raw file at `path`; None if its
    size is not `size`."""
    with open(path, "rb", buffering=0) as f:
        return _build(f, digest, size, None)


def _build(f: Any, digest: str, size: int, stop: threading.Event | None) -> LineIndex | None:
    """The line index of the open raw file `f` read from its start; None if its size is not `size`
    or `stop` was set meanwhile."""
    indexer = LineIndexer()
    offset = 0
    buf = bytearray(_READ)
    with memoryview(buf) as view:
        while (n := f.readinto(buf)):
            if stop is not None and stop.is_set():
                return None
            indexer.feed(view[:n], offset)
            offset += n
    return indexer.finish(digest, size)
