"""The announcements of `DocSource` (docsource.py): what each replica's producer will need next.

`prefetch` starts the objects of a window (in need order, within the
in-flight bound) and hands each object's announced records to its demand
task; announcements are kept per prefetching thread, each call replacing
its own caller's. After a RESTORE (`restored`), that thread's next prefetch
marks stale every object in progress that no window holds and no reader
waits for (`_mark_stale`); its fill stops at its next chunk (`_stop_stale`).

`Announcements` is one part of `DocSource` (a mixin: no state of its own); the
state it uses (`_lock`, `_lru`, `_running`, `_ahead`, `_windows`,
`_restoring`, `_stride`, the counters) is made by `DocSource.__init__`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from sluice.loaderd.physical.entry import Entry as _Entry


class Announcements:
    """`DocSource`'s announcements: start a window's objects, pass on their records, drop stale ones."""

    def prefetch(self, refs: Any, *, only_if_settled: bool = False) -> bool:
        """Start the objects of `refs` (in need order), within the in-flight bound, and have
        their records far beyond each object's fill tokenized out of order.

        `refs`: the producer's `Upcoming` columns (logical/upcoming.py: arrays `source`, `obj`,
        `record`, in need order), or a sequence of refs with those three attributes. No Python
        runs per document: the objects are grouped with one `np.unique`, and an object's records
        are listed only while its demand path can use them (not done, not cached).

        Announcements are kept per calling thread (a replica's producer) and
        merged: each call replaces what the same thread announced before
        (records e.g. for a position a RESTORE left, not yet started, are
        dropped), never what another replica's producer announced. When every
        object announced is done (mapped) and the thread has neither earlier
        announced records to drop nor a RESTORE's sweep pending, the call only
        refreshes those objects in the LRU and its window, and returns True
        (settled: nothing of this announcement is in progress); else False.
        `only_if_settled`: the call does that or nothing at all (False): it
        starts no object and leaves every announcement as it was.
        """
        if isinstance(getattr(refs, "record", None), np.ndarray):
            source, obj, record = refs.source, refs.obj, refs.record
        else:
            source = np.fromiter((r.source for r in refs), np.int64, len(refs))
            obj = np.fromiter((r.obj for r in refs), np.int64, len(refs))
            record = np.fromiter((r.record for r in refs), np.int64, len(refs))
        key = source * self._stride + obj
        uniq, first = np.unique(key, return_index=True)
        need = uniq[np.argsort(first, kind="stable")].tolist() if len(uniq) > 1 else uniq.tolist()
        keys = [(k // self._stride, k % self._stride) for k in need]  # objects in need order
        me = threading.get_ident()
        with self._lock:
            if me not in self._restoring and me not in self._ahead:
                lru = self._lru
                if all((e := lru.get(k)) is not None and e.done for k in keys):
                    self._windows[me] = frozenset(keys)
                    for k in keys:  # (as `_entry` does for each: the window's objects are used last)
                        lru.move_to_end(k)
                    return True
            if only_if_settled:
                return False
            self._windows[me] = frozenset(keys)
            sweep = me in self._restoring
            self._restoring.discard(me)
        if sweep:
            self._mark_stale()
        touched: set[_Entry] = set()
        for k, (s, o) in zip(need, keys):
            entry = self._entry((s, o), bounded=True)
            if entry is None:
                break
            if entry.demand is not None:
                with entry.cond:
                    if not entry.done and not entry.closed:
                        if entry.demand.announce(me, record[key == k].tolist(), entry.ready):
                            touched.add(entry)
                            self._ask(entry)
        with self._lock:
            left = self._ahead.pop(me, set()) - touched
            if touched:
                self._ahead[me] = touched
        for entry in left:
            with entry.cond:
                if entry.demand is not None:
                    entry.demand.drop_ahead(me)
        return False

    def restored(self, caller: int) -> None:
        """A RESTORE moved the producer running in thread `caller` (its `threading.get_ident()`).

        At that thread's next prefetch (the new position's window), every object
        still in progress that no prefetching thread's last window holds and no
        reader waits for is stale: its announced records are dropped and its
        in-order fill stops at its next chunk (nothing is published; a later
        need, or `sluice cache warm --tokens`, makes the token object again).
        Objects another replica's producer still announces are left alone.
        """
        with self._lock:
            self._restoring.add(caller)

    def _mark_stale(self) -> None:
        with self._lock:
            window = frozenset().union(*self._windows.values())
            entries = [e for k, e in self._lru.items() if k in self._running and k not in window]
        dropped = 0
        for entry in entries:
            with entry.cond:
                if entry.done or entry.waiting:
                    continue
                entry.stale = True
                if entry.demand is not None:  # no window holds it: nobody's announcements are live
                    dropped += entry.demand.drop_ahead()
        with self._lock:
            self.stale_records_dropped += dropped

    def _stop_stale(self, key: tuple[int, int], entry: _Entry) -> bool:
        """Asked by a fill between chunks: True if its object went stale after a RESTORE (and no reader
        came back for it since): the fill stops; the entry leaves the LRU, so the next need starts anew."""
        if not entry.stale:
            return entry.stopping
        with self._lock:
            with entry.cond:
                if not entry.stale or entry.waiting:
                    return entry.stopping
                entry.stale, entry.stopping = False, True
                if entry.demand is not None:
                    entry.demand.drop_ahead()
                if self._lru.get(key) is entry:
                    del self._lru[key]
                    self._changes += 1
                self.stale_fills_stopped += 1
        if self._metrics is not None:
            self._metrics.stale_fills_stopped.inc()
        return True
