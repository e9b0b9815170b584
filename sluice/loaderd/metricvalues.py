"""Metric values without prometheus_client: what the daemon fills before anyone scrapes.

prometheus_client's package imports its HTTP exposition (``http.server``,
``ssl``, ``email``: about a fifth of the daemon's imports, docs/loaderd.md
"Start-up"), and a daemon without a metrics port never exports. So the hot
path fills these plain, lock-guarded values (the same semantics as
prometheus_client's children: counters only go up, histograms count into
fixed buckets), and `collect` maps them to prometheus_client's families only
when a registry is asked for (`Metrics.registry`: the HTTP exporter, a test).
The text served on /metrics is the one prometheus_client's own
Counter/Gauge/Histogram would serve, ``_created`` series included.

    fam = Family("counter", "sluice_batches_served_total", "BATCH messages sent", ["run_id"])
    fam.labels("r1").inc()          # hot path: one lock, one add
    list(collect([fam]))            # imports prometheus_client; one Metric per family
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any


class Value:
    """One counter or gauge child: a float behind a lock."""

    __slots__ = ("_lock", "_value", "_counter", "created")

    def __init__(self, counter: bool) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._counter = counter
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add `amount`; a counter refuses a negative amount (ValueError), as prometheus_client's does."""
        if self._counter and amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        with self._lock:
            self._value += amount

    def set(self, value: float) -> None:
        """Gauges only: the value is now `value`."""
        with self._lock:
            self._value = float(value)

    def get(self) -> float:
        with self._lock:
            return self._value


class Buckets:
    """One histogram child: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("_lock", "_bounds", "_counts", "_sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._counts = [0.0] * len(bounds)
        self._sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count `amount` into the first bucket whose upper bound is >= it."""
        i = bisect.bisect_left(self._bounds, amount)
        with self._lock:
            self._sum += amount
            self._counts[i] += 1

    def snapshot(self) -> tuple[list[float], float]:
        with self._lock:
            return list(self._counts), self._sum


class Tally:
    """A counter child that one thread alone adds to (the IO thread's per-GET counts): no lock.

    `value` is the count; the writer adds to it in place (``child.value += n``, or `inc`), other threads
    only read it (a scrape): a float attribute is read whole, so a reader sees it before or after an
    add, as with `Value`'s lock, which cost the IO thread about 0.2 us an add.
    """

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add `amount` (ValueError for a negative one, as prometheus_client's counters)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def get(self) -> float:
        return self.value


class TallyBuckets:
    """A histogram child that one thread alone observes into (`Tally`'s rules): per-bucket counts, the sum.

    A scrape between an observation's count and its sum sees one but not the other, as it may with
    prometheus_client's histograms, whose buckets and sum are separate values.
    """

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count `amount` into the first bucket whose upper bound is >= it."""
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def snapshot(self) -> tuple[list[float], float]:
        return list(self.counts), self.sum


class Family:
    """A named metric with label names; `labels(*values)` makes (once) and returns a child.

    `one_writer`: its children are `Tally`/`TallyBuckets` (no lock), for values one thread alone
    writes; otherwise `Value`/`Buckets`, which any thread may write.
    """

    def __init__(self, kind: str, name: str, doc: str, labelnames: list[str],
                 buckets: tuple[float, ...] = (), one_writer: bool = False) -> None:
        if kind not in ("counter", "gauge", "histogram") or (one_writer and kind == "gauge"):
            raise ValueError(f"bug in sluice.loaderd.metricvalues: metric kind {kind!r} for {name}"
                             + (" has no one-writer children" if kind == "gauge" else ""))
        self.kind, self.doc, self.labelnames = kind, doc, tuple(labelnames)
        # prometheus_client names a counter's family without its _total suffix (the sample keeps it)
        self.name = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
        bounds = tuple(float(b) for b in buckets)
        self._bounds = bounds if not bounds or bounds[-1] == float("inf") else bounds + (float("inf"),)
        self._one_writer = one_writer
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Any] = {}  # insertion order = exposition order

    def labels(self, *values: Any) -> Any:
        """The child for these label values (a `Value`, or `Buckets` for a histogram)."""
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"bug in sluice.loaderd.metricvalues: {self.name} takes labels "
                             f"{list(self.labelnames)}, got {list(key)}")
        with self._lock:
            child = self._children.get(key)
            if child is None:
                if self._one_writer:
                    child = TallyBuckets(self._bounds) if self.kind == "histogram" else Tally()
                else:
                    child = Buckets(self._bounds) if self.kind == "histogram" else Value(self.kind == "counter")
                self._children[key] = child
            return child

    def children(self) -> list[tuple[tuple[str, ...], Any]]:
        with self._lock:
            return list(self._children.items())


def collect(families: Iterable[Family]) -> Iterator[Any]:
    """prometheus_client `Metric`s of `families`, as its Counter/Gauge/Histogram would collect them."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.utils import floatToGoString

    # prometheus_client's own switch for the _created series (read when it imports; here when it collects)
    created = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")
    for fam in families:
        out = Metric(fam.name, fam.doc, fam.kind)
        for values, child in fam.children():
            labels = dict(zip(fam.labelnames, values, strict=True))
            if fam.kind == "gauge":
                out.add_sample(fam.name, labels, child.get())
                continue
            if fam.kind == "counter":
                out.add_sample(fam.name + "_total", labels, child.get())
            else:
                counts, total = child.snapshot()
                acc = 0.0
                for bound, n in zip(fam._bounds, counts, strict=True):
                    acc += n
                    out.add_sample(fam.name + "_bucket", {**labels, "le": floatToGoString(bound)}, acc)
                out.add_sample(fam.name + "_count", labels, acc)
                out.add_sample(fam.name + "_sum", labels, total)
            if created:
                out.add_sample(fam.name + "_created", labels, child.created)
        yield out
