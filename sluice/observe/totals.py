"""What the daemons counted over a run, from `sluice top --record` samples: tokens served (in all, per
replica and source), batches, input wait, time to batch, fenced requests and committed steps.

A counter counts from its daemon's start, so the value of a daemon's last
sample is what it counted; a value lower than the one before means the
daemon at that URL restarted (a fixed ``--metrics-port``), and what it had
counted is kept (`_Count`). Summed over daemons, this is what the run's
daemons counted up to each one's last sample: a sample taken after the
trainers' last step (`sluice top --once`) makes it the whole run. Memory stays
bounded: per daemon the running counts, each histogram's last sample, and a
time series decimated to at most `MAX_POINTS` (wall, tokens, input wait)
points (every other one dropped when full; a rate between kept points is
still the mean over the interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ObserveError
from sluice.observe.scrape import shown

MAX_POINTS = 4096  # kept time series points per daemon (a chart's width in pixels is about 800)
_MAX_KEYS = 100_000  # (replica, source) pairs of one report
_MAX_BUCKETS = 1000  # distinct le bounds of one histogram (the daemon exports 17 with +Inf)
_MAX_LABEL = 200  # characters of a label value kept
SERVED = "sluice_served_tokens_total"
PER_SOURCE = "sluice_source_served_tokens_total"
WAIT = "sluice_client_input_wait_seconds"
TTB = "sluice_time_to_batch_seconds"


def finite(v: Any, where: str, what: str, bound: float = float((1 << 63) - 1),
           expected: str = "a finite number within +-2^63") -> float:
    """`v` as a float if it is a number within +-`bound`; ObserveError naming `where`, `what` and `expected`."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        f = math.nan
    if isinstance(v, bool) or not -bound <= f <= bound:  # NaN fails both comparisons
        raise ObserveError(f"{where}: {what} is {shown(repr(v), 60)}; expected {expected}")
    return f


@dataclass
class _Count:
    """A counter of one daemon URL across its restarts: what earlier instances counted, and the last value."""

    done: float = 0.0
    last: float = 0.0

    def see(self, v: float) -> None:
        if v < self.last:  # the counter started again: a new daemon at the same URL
            self.done += self.last
        self.last = v

    @property
    def total(self) -> float:
        return self.done + self.last


@dataclass
class Daemon:
    """One metrics URL's counts (see the module docstring)."""

    first: float = math.inf  # wall seconds of its first and last sample
    last: float = -math.inf
    counts: dict[str, _Count] = field(default_factory=dict)
    per_source: dict[tuple[str, str], _Count] = field(default_factory=dict)  # (replica, source) -> tokens
    committed: dict[str, float] = field(default_factory=dict)  # replica -> highest committed step seen
    wait_buckets: list[tuple[float, float]] = field(default_factory=list)  # last sample's (le, cumulative)
    ttb_buckets: list[tuple[float, float]] = field(default_factory=list)
    points: list[tuple[float, float, float, float]] = field(default_factory=list)  # wall, tokens, wait s, waits
    spans: list[tuple[float, float]] = field(default_factory=list)  # (first, last) wall of each instance

    def total(self, name: str) -> float:
        c = self.counts.get(name)
        return c.total if c is not None else 0.0


def _buckets(series: list[tuple[str, dict[str, Any], Any]], name: str, where: str) -> list[tuple[float, float]]:
    cum: dict[float, float] = {}
    for n, lab, v in series:
        if n == name:
            le = lab.get("le")
            try:
                bound = float(le) if isinstance(le, str) else math.nan
            except ValueError:
                bound = math.nan
            if math.isnan(bound):
                raise ObserveError(f"{where}: {name} with le={shown(repr(le), 60)}; expected a number")
            cum[bound] = cum.get(bound, 0.0) + finite(v, where, f"the count of {name} le={le}")
            if len(cum) > _MAX_BUCKETS:
                raise ObserveError(f"{where}: a histogram {name} of more than {_MAX_BUCKETS} buckets")
    return sorted(cum.items())


_COUNTED = (SERVED, "sluice_batches_served_total", WAIT + "_sum", WAIT + "_count")


def add_sample(d: Daemon, wall: float, series: list[tuple[str, dict[str, Any], Any]], where: str,
               keys: list[int]) -> None:
    """Fold one checked sample (its wall time, its series) into daemon `d`; `keys` counts the run's
    (replica, source) pairs (a one-element list shared by every daemon) against _MAX_KEYS."""
    sums: dict[str, float] = dict.fromkeys(_COUNTED, 0.0)
    per: dict[tuple[str, str], float] = {}
    fenced = 0.0
    for name, lab, v in series:
        if name in sums:
            sums[name] += finite(v, where, name)
        elif name == PER_SOURCE:
            key = (shown(str(lab.get("replica", "")), _MAX_LABEL), shown(str(lab.get("source", "")), _MAX_LABEL))
            per[key] = per.get(key, 0.0) + finite(v, where, name)
        elif name == "sluice_protocol_errors_total" and lab.get("code") == "FENCED":
            fenced += finite(v, where, name)
        elif name == "sluice_committed_step":
            r = shown(str(lab.get("replica", "")), _MAX_LABEL)
            step = finite(v, where, name)
            if r not in d.committed and len(d.committed) >= _MAX_KEYS:
                raise ObserveError(f"{where}: more than {_MAX_KEYS} replicas")
            d.committed[r] = max(d.committed.get(r, -1.0), step)
    restarted = SERVED in d.counts and sums[SERVED] < d.counts[SERVED].last
    sums["fenced"] = fenced
    for name, v in sums.items():
        d.counts.setdefault(name, _Count()).see(v)
    for key, v in per.items():
        if key not in d.per_source:
            keys[0] += 1
            if keys[0] > _MAX_KEYS:
                raise ObserveError(f"{where}: more than {_MAX_KEYS} (replica, source) pairs of served tokens")
            d.per_source[key] = _Count()
        d.per_source[key].see(v)
    if restarted and d.spans:  # the instance before it ended at its last sample
        d.spans[-1] = (d.spans[-1][0], d.last)
    if restarted or not d.spans:
        d.spans.append((wall, wall))
    d.spans[-1] = (min(d.spans[-1][0], wall), max(d.spans[-1][1], wall))
    d.first, d.last = min(d.first, wall), max(d.last, wall)
    d.wait_buckets = _buckets(series, WAIT + "_bucket", where) or d.wait_buckets
    d.ttb_buckets = _buckets(series, TTB + "_bucket", where) or d.ttb_buckets
    d.points.append((wall, d.total(SERVED), d.total(WAIT + "_sum"), d.total(WAIT + "_count")))
    if len(d.points) > 2 * MAX_POINTS:  # decimate: keep the first, every other one, and the last
        d.points = d.points[:-1:2] + [d.points[-1]]


def rates(points: list[tuple[float, float, float, float]]) -> list[tuple[float, float, float | None]]:
    """(wall at the interval's end, tokens/s, mean input wait seconds or None) between consecutive points
    in time order; intervals of no time are left out."""
    pts = sorted(points)
    out = []
    for (w0, t0, s0, c0), (w1, t1, s1, c1) in zip(pts, pts[1:]):
        if w1 > w0:
            waits = c1 - c0
            out.append((w1, max(0.0, t1 - t0) / (w1 - w0), (s1 - s0) / waits if waits > 0 else None))
    return out
