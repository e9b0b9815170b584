"""The bytes a DocSource serves, verified on their way out of the node cache (docs/cache.md, "Verified on the way out").

Three checks, all against the per-chunk digests the cache recorded when it
published an object (`sluice.cache.chunks`):

* when an object is first mapped (`DocSource._open_verified`, through the pin's guard);
* after each producer call, before its steps leave the producer: every object the calling
  thread read documents from (`note`, on the read path: one dict store) is checked with one
  `fstat` (`check`); a changed file is verified again, a damaged one quarantined and its
  entry dropped, and the caller makes its steps again;
* in the background, changed or not, at `scrub_rate` bytes a second (`scrub`): damage that
  leaves a file's timestamps alone.

A damaged object is named (source, location, manifest digest) in the log and in
`sluice_damaged_objects_total{source,object}`, whichever reader of the process found it: the
node cache tells `on_damaged` of every object it quarantines.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sluice.errors import CacheError, ChunkDamaged, SluiceError

log = logging.getLogger("sluice.loaderd")


class _Reads(threading.local):
    """Per reading thread (a replica's producer): the entries it read documents from since its last
    `check`, by (source, object)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int], Any] = {}


class ServedBytes:
    """Verification of what one DocSource serves. `docs` gives the entries (`mapped_entries`) and drops a
    damaged one (`drop_entry`); this class owns the reads, the scrubber thread and the damage reports."""

    def __init__(self, docs: Any, metrics: Any = None, *, scrub_rate: int = 0) -> None:
        if scrub_rate < 0:
            raise SluiceError(f"loaderd: scrub rate {scrub_rate} bytes/s must be >= 0")
        self._docs = docs
        self._manifest = docs.manifest
        self._cache = docs.cache
        self._encoder = docs.encoder
        self._metrics = metrics
        self.reads = _Reads()
        self._lock = threading.Lock()  # guards the counters and `_keys`
        self.damaged_objects = 0  # cached objects found changed after verification
        self.scrubbed_bytes = 0  # bytes of mapped objects verified again by the scrubber
        self._scrub_at = 0  # the scrubber's place among the entries (round robin)
        self._keys: dict[str, tuple[int, int]] | None = None  # cache key -> (source, object), made on first damage
        self._stop = threading.Event()
        if hasattr(self._cache, "on_damaged"):
            self._cache.on_damaged = self._cache_damaged
        self._scrubber: threading.Thread | None = None
        if scrub_rate:
            self._scrubber = threading.Thread(target=self._scrub_loop, args=(scrub_rate,), daemon=True,
                                              name="loaderd-scrub")
            self._scrubber.start()

    def stop(self, timeout_s: float | None) -> None:
        """Stop the scrubber (it stops between two objects; one object is hashed in well under a second)."""
        self._stop.set()
        if self._scrubber is not None:
            self._scrubber.join(timeout_s)

    # -- after each producer call ---------------------------------------------------
    def begin(self) -> None:
        """Forget the calling thread's reads: the next `check` covers what it reads from now on."""
        self.reads.entries.clear()

    def check(self) -> bool:
        """After the calling thread copied documents (a step or a run of steps, before they leave the producer):
        True if every cached file it read from is unchanged since its chunks were verified (one fstat each).

        False if some file changed: its chunks were verified again, and if they no longer match their digests
        the object is quarantined in the node cache, named in the log and the metrics, and its entry dropped
        (the next read fills it anew from verified bytes). Either way the caller must make its copies again:
        they may predate the change. Forgets the reads it checked.
        """
        reads = self.reads.entries
        if not reads:
            return True
        self.reads.entries = {}
        ok = True
        for key, entry in reads.items():
            for pin in (entry.pin, entry.raw):  # the mapped tokens; the raw object a fill in progress reads
                if pin is None:
                    continue
                try:
                    if pin.guard().check():
                        continue
                    # (intact, but its file changed after the copies were made: named, so that a step made
                    # again and again says which file keeps changing)
                    log.warning("cached object %s (%s, source %d object %d) changed after it was verified; "
                                "its bytes are intact, the step is made again", pin.key, pin.path, *key)
                except ChunkDamaged as exc:
                    self.damaged(key, entry, pin, exc)
                except CacheError:  # closed meanwhile (evicted, or settled)
                    if pin is not entry.pin and entry.done and entry.error is None:
                        # The raw object's pin, closed when its fill finished: the fill checked that the file
                        # was unchanged through every read before it published the tokens (tokcache.fill_tokens),
                        # so the documents made from it are good. (Counted a change, this made every step that
                        # met a settling fill again, and four in a row failed it, in CI and in full runs here.)
                        continue
                    log.debug("cached object %s (source %d object %d) was closed while a step read it; the "
                              "step is made again", pin.key, *key)
                ok = False
        return ok

    # -- in the background ----------------------------------------------------------
    def scrub(self, budget: int) -> int:
        """Verify the chunks of mapped objects again, changed or not, round robin over the entries, until about
        `budget` bytes were hashed; returns the bytes hashed. A damaged one is quarantined and dropped as
        `check` does (damage that leaves a file's timestamps alone, like bit rot surfacing when a page is
        read from disk again, is found here or by the next process that maps the object)."""
        entries = self._docs.mapped_entries()
        if not entries:
            return 0
        done = 0
        start = self._scrub_at % len(entries)
        for i in range(len(entries)):
            if done >= budget or self._stop.is_set():
                break
            key, entry = entries[(start + i) % len(entries)]
            self._scrub_at = start + i + 1
            pin = entry.pin
            if pin is None:
                continue
            try:
                done += pin.guard().verify_now()
            except ChunkDamaged as exc:
                self.damaged(key, entry, pin, exc)
            except CacheError:  # closed meanwhile (evicted): nothing left to serve from it
                continue
        with self._lock:
            self.scrubbed_bytes += done
        return done

    def _scrub_loop(self, rate: int) -> None:
        """`scrub` about `rate` bytes a second until stopped (a bounded, steady cost: hashing runs at several
        GB/s a core, so 32 MiB/s is under 1% of one)."""
        while not self._stop.wait(1.0):
            try:
                self.scrub(rate)
            except Exception:  # never let the scrubber die silently; it tries again in a second
                log.exception("loaderd: the cache scrubber failed")

    # -- damage ---------------------------------------------------------------------
    def damaged(self, key: tuple[int, int], entry: Any, pin: Any, exc: ChunkDamaged) -> None:
        """An entry's file changed after verification and no longer matches: quarantine it, drop the entry."""
        self.report(key, pin, exc)
        self._docs.drop_entry(key, entry)

    def report(self, key: tuple[int, int], pin: Any, exc: ChunkDamaged) -> None:
        """Quarantine a damaged pinned object (the next fetch fills it anew); the cache's `on_damaged` names it
        in the log and the metrics (`_cache_damaged`), or this does if the cache had replaced it already."""
        try:
            if self._cache.quarantine_damaged(pin, str(exc)):
                return
        except SluiceError as qexc:  # (the entry is dropped anyway: never served from again)
            exc = ChunkDamaged(f"{exc}; quarantining it failed: {qexc}", key=exc.key, chunk=exc.chunk)
        self._name(key, "derived" if pin.kind == "derived" else "raw", str(exc))

    def _cache_damaged(self, cache_key: str, damaged: Any) -> None:
        """The node cache quarantined a damaged object (found on its way out, by any reader of this process):
        name the manifest object it belongs to (raw, or the tokens of one) in the log and the metrics."""
        kind = damaged.rec.kind
        found = self._object_of(cache_key)
        if found is None:  # (a line index, or an object of another manifest sharing the cache)
            log.error("damaged cached object %s (%s) quarantined: %s", cache_key, kind, damaged.reason)
            return
        self._name(found, kind, damaged.reason)

    def _name(self, key: tuple[int, int], kind: str, reason: str) -> None:
        src = self._manifest.sources[key[0]]
        obj = src.objects[key[1]]
        what = "tokens of" if kind == "derived" else "raw"
        log.error("damaged cached object: %s source %r object %s (%s): %s; quarantined, filled again", what,
                  src.name, obj.location, obj.digest, reason,
                  extra={"source": src.name, "object": obj.location, "digest": obj.digest})
        with self._lock:
            self.damaged_objects += 1
        if self._metrics is not None:
            self._metrics.damaged(src.name, obj.digest)

    def _object_of(self, cache_key: str) -> tuple[int, int] | None:
        """(source, object) whose raw digest or token object key is `cache_key`. The map is made on the first
        damage (one canonical JSON and BLAKE3 per text object)."""
        from sluice.cache.hashing import derived_digest
        from sluice.tokenize.tokcache import token_key

        with self._lock:
            if self._keys is None:
                keys: dict[str, tuple[int, int]] = {}
                for s, src in enumerate(self._manifest.sources):
                    for o, obj in enumerate(src.objects):
                        keys.setdefault(obj.digest, (s, o))
                        if src.format != "tokens" and self._encoder is not None:
                            keys.setdefault(derived_digest(token_key(self._manifest, s, o, self._encoder)), (s, o))
                self._keys = keys
            return self._keys.get(cache_key)
