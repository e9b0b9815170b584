"""The producer's metrics wherever it runs: snapshots in the child, folded into the daemon's `Metrics`.

A thread producer records straight into the daemon's `Metrics`. A producer
process (`--producer process`) records into its own `Metrics` and sends a
snapshot of the `PRODUCER_METRICS` families (plain JSON numbers, never
pickled) on its steps channel, at most every `SNAPSHOT_EVERY_S` while it
produces and once more when it idles; the daemon folds each snapshot in:

    child: {"pid": 41, "families": {"sluice_steps_produced": [[12.0]],
            "sluice_source_documents": [["web", 30.0], ["code", 9.0]], ...}, "stats": {...}}
    daemon: counter += cumulative - last seen from that child (a new pid, or
            a smaller value, counts from 0: a counter never goes down);
            gauge = sum over children (+ the daemon's own, `gauge_sum`)

Labels in a snapshot are the family's labels after ``run_id, dataset_id``
(the daemon binds its own). What a snapshot holds is bounded by the fixed
family list and the manifest's sources.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

log = logging.getLogger("sluice.loaderd")

SNAPSHOT_EVERY_S = 0.5

# Every family the producer side records (StepMaker, DocSource, its NodeCache via observe_cache).
PRODUCER_METRICS = (
    "sluice_steps_produced_total", "sluice_object_errors_total", "sluice_source_documents_total",
    "sluice_read_bytes_total", "sluice_decode_seconds_total", "sluice_tokenize_seconds_total",
    "sluice_decoded_documents_total", "sluice_tokenized_tokens_total",
    "sluice_cache_hits_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
    "sluice_cache_verify_failures_total", "sluice_stale_fills_stopped_total",
    "sluice_demanded_documents_total", "sluice_demand_waited_documents_total", "sluice_fill_reused_documents_total",
    "sluice_decoded_cache_bytes", "sluice_decode_inflight_objects", "sluice_fused_kernel_loaded",
    "sluice_damaged_objects_total", "sluice_tokens_not_kept_total", "sluice_out_of_order_stopped_total",
    "sluice_steps_by_path_total", "sluice_fast_path_fallbacks_total",
)
# The DocSource figures STATS reports (decoded_bytes, decoded_hits, decoded_misses).
STATS_KEYS = ("decoded_bytes", "decoded_hits", "decoded_misses")


def _families(metrics: Any) -> dict[str, Any]:
    """The producer-side `Family`s of `metrics`, by their exposition name."""
    wanted = {n[: -len("_total")] if n.endswith("_total") else n for n in PRODUCER_METRICS}
    return {f.name: f for f in metrics.families() if f.name in wanted}


def snapshot(metrics: Any, docs: Any) -> dict[str, Any]:
    """Child side: the cumulative values of the producer families of `metrics` and `docs`'s STATS figures."""
    fams = {name: [[*labels[2:], child.get()] for labels, child in f.children()]
            for name, f in _families(metrics).items()}
    return {"pid": os.getpid(), "families": fams,
            "stats": {"decoded_bytes": docs.nbytes, "decoded_hits": docs.hits, "decoded_misses": docs.misses}}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


class ProducerFold:
    """Daemon side: folds the snapshots of producer processes (keyed by replica) into one `Metrics`."""

    def __init__(self, metrics: Any) -> None:
        self._metrics = metrics
        self._fams = _families(metrics)
        self._pid: dict[int, int] = {}
        self._seen: dict[tuple[int, str, tuple[str, ...]], float] = {}  # (replica, family, labels) -> cumulative
        self._gauges: dict[int, dict[tuple[str, tuple[str, ...]], float]] = {}  # replica -> latest gauge values
        self._stats: dict[int, dict[str, int]] = {}

    def fold(self, replica: int, snap: Any) -> None:
        """Apply one snapshot from `replica`'s producer process; a malformed one is logged and dropped."""
        problem = self._check(snap)
        if problem:
            log.error("bad metrics snapshot from a producer process", extra={"replica": replica, "error": problem})
            return
        if self._pid.get(replica) != snap["pid"]:  # a new child: its counters start from 0
            self._pid[replica] = snap["pid"]
            self._seen = {k: v for k, v in self._seen.items() if k[0] != replica}
        lv = self._metrics.label_values
        gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        for name, rows in snap["families"].items():
            fam = self._fams[name]
            for row in rows:
                labels, value = tuple(row[:-1]), float(row[-1])
                if fam.kind == "gauge":
                    gauges[(name, labels)] = value
                    continue
                key = (replica, name, labels)
                last = self._seen.get(key, 0.0)
                fam.labels(*lv, *labels).inc(value - last if value >= last else value)
                self._seen[key] = value
        self._gauges[replica] = gauges
        self._stats[replica] = {k: int(snap["stats"][k]) for k in STATS_KEYS}
        for name, labels in gauges:  # the daemon's own DocSource is idle under process producers
            if name != "sluice_decoded_cache_bytes":  # upkeep adds the daemon's own decoded bytes
                self._fams[name].labels(*lv, *labels).set(self.gauge_sum(name, labels))

    def _check(self, snap: Any) -> str | None:
        if not isinstance(snap, dict) or not isinstance(snap.get("pid"), int):
            return "snapshot is not an object with an integer pid"
        fams, stats = snap.get("families"), snap.get("stats")
        if not isinstance(fams, dict) or not isinstance(stats, dict):
            return "snapshot lacks families/stats objects"
        if not all(_number(stats.get(k)) for k in STATS_KEYS):
            return f"stats must hold non-negative numbers {list(STATS_KEYS)}"
        for name, rows in fams.items():
            fam = self._fams.get(name)
            if fam is None:
                return f"family {name!r} is not a producer metric"
            width = len(fam.labelnames) - 2
            for row in rows if isinstance(rows, list) else [None]:
                if (not isinstance(row, list) or len(row) != width + 1 or not _number(row[-1])
                        or not all(isinstance(x, str) for x in row[:-1])):
                    return f"family {name!r}: row {row!r} is not [{width} label strings, a non-negative number]"
        return None

    def gauge_sum(self, name: str, labels: tuple[str, ...] = ()) -> float:
        """The sum of the latest values of gauge `name` over the producer processes (0 with none)."""
        return sum(g.get((name, labels), 0.0) for g in self._gauges.values())

    def stats_sum(self) -> dict[str, int]:
        """decoded_bytes/hits/misses summed over the producer processes (zeros with none)."""
        return {k: sum(s[k] for s in self._stats.values()) for k in STATS_KEYS}


def totals(metrics: Any) -> dict[str, float]:
    """STATS's ``producer`` block: each producer family's value summed over its labels, by its full name."""
    fams = _families(metrics)
    out = {}
    for name in PRODUCER_METRICS:
        f = fams[name[: -len("_total")] if name.endswith("_total") else name]
        out[name] = sum(child.get() for _, child in f.children())
    return out
