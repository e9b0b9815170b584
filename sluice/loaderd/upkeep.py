"""The IO thread's periodic upkeep and the STATS report of a daemon.

`Upkeep.housekeeping` runs every 0.5 s on the IO thread: GETs parked longer
than the request TTL are answered ERROR(EXPIRED); lapsed HELLO `peers` claims
are dropped and the release re-runs; gauges are set. It asks the daemon's
parts through their methods: `Requests` (handlers.py) for parked GETs, claims
and counters, `WireIO` (wireio.py) for the wire's, each producer's `StepQueue`
for its figures.
"""

from __future__ import annotations

import os
from typing import Any

from sluice.errors import SluiceError
from sluice.loaderd.handlers import Requests
from sluice.loaderd.gilcpu import GilCpu
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.wireio import WireIO

__all__ = ["Upkeep"]

# Every family the producer side records (StepMaker, DocSource, its NodeCache via observe_cache): STATS's
# ``producer`` block sums each over its labels.
PRODUCER_METRICS = (
    "sluice_steps_produced_total", "sluice_object_errors_total", "sluice_source_documents_total",
    "sluice_read_bytes_total", "sluice_decode_seconds_total", "sluice_tokenize_seconds_total",
    "sluice_decoded_documents_total", "sluice_tokenized_tokens_total",
    "sluice_cache_hits_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
    "sluice_cache_verify_failures_total", "sluice_stale_fills_stopped_total",
    "sluice_demanded_documents_total", "sluice_demand_waited_documents_total", "sluice_fill_reused_documents_total",
    "sluice_decoded_cache_bytes", "sluice_decode_inflight_objects", "sluice_fused_kernel_loaded",
    "sluice_fused_kernel_ahead_of_time",
    "sluice_damaged_objects_total", "sluice_tokens_not_kept_total", "sluice_out_of_order_stopped_total",
    "sluice_steps_by_path_total", "sluice_fast_path_fallbacks_total",
)


class Upkeep:
    """Housekeeping and STATS over a daemon's parts (given, never the server itself)."""

    def __init__(self, requests: Requests, wire_io: WireIO, data: Any, metrics: Metrics, gil: GilCpu) -> None:
        self.requests, self.wire, self.data, self.metrics, self.gil = requests, wire_io, data, metrics, gil
        self.metrics_port: int | None = None  # set once the metrics port is bound

    def housekeeping(self, now: float) -> None:
        """Every 0.5 s on the IO thread: expired GETs, lapsed peer claims, the GIL's CPU (gilcpu.py), gauges."""
        req = self.requests
        for r, p in req.pipelines.items():
            self.metrics.released_credits.inc(req.expire(r, now))
            req.lapse_claims(r, now)
            self._gauges(r, p, now)
        if req.rings is not None:  # the rings of clients silent as long as a claim lives (rings.py, `expire`)
            req.rings.expire(now, req.claims.ttl_s)
        if req.arena is not None:  # the leases of client processes that are gone (arena.py, `reap`)
            req.arena.reap(now)
        moves = self.gil.moves
        self.gil.tick(now)  # (threads that inherited its CPU spread; a move off a busy CPU)
        self.metrics.gil_cpu.set(-1 if self.gil.cpu is None else self.gil.cpu)
        self.metrics.gil_cpu_moves.inc(self.gil.moves - moves)
        self.metrics.docs_cache_bytes.set(self.data.docs.nbytes)
        self.metrics.publish_states()
        try:
            self.metrics.observe_cache(self.data.cache.stats())
        except SluiceError:  # stats are best effort; a busy index must not stop serving
            pass

    def _gauges(self, r: int, p: ReplicaPipeline, now: float) -> None:
        g = self.metrics.replica(r)
        f = p.queue.figures()
        g.queue_steps.set(f.steps)
        g.queue_bytes.set(f.nbytes)
        g.queue_age.set(now - f.oldest_created if f.oldest_created is not None else 0.0)
        g.lead.set(p.next_step - f.floor)
        g.pending.set(self.requests.pending(r))
        c = self.requests.committed(r)
        if c is not None:
            g.commit_lag.set(max(0, f.floor - 1 - c))

    def stats(self) -> dict[str, Any]:
        """The STATS body: identity, generation, counters, producer metrics, RSS and per-replica queue figures.

        ``producer`` holds the producer-side metrics, each summed over its labels;
        ``fast_path`` is `Metrics.fast_path` (steps per path, fall-backs per
        reason, the compiled kernel loaded).
        """
        req, w, docs = self.requests, self.wire, self.data.docs
        out: dict[str, Any] = {
            "instance": req.instance,
            "run_id": req.run_id,
            "dataset_id": req.dataset_id,
            "replicas_total": req.config.replicas,
            "served": sorted(req.pipelines),
            "generation": req.generation,
            "requests": req.requests,
            "errors": self.metrics.error_counts(),
            "dropped_frames": req.dropped_frames,
            "undeliverable": w.undeliverable,
            "connections": w.connections.open if w.connections is not None else 0,
            "unauthorized": req.unauthorized + getattr(w.auth, "denied", 0),
            "decoded_bytes": docs.nbytes,
            "decoded_hits": docs.hits,
            "decoded_misses": docs.misses,
            "producer": _totals(self.metrics),
            "fast_path": self.metrics.fast_path(),
            "rings": req.rings.stats() if req.rings is not None else None,
            "arena": req.arena.stats() if req.arena is not None else {"enabled": False, "why": req.arena_refused},
            "joined": req.joined.stats(),  # ring replies sent joined (joined.py)
            "tokenizer": docs.tokenizer_stats(),
            "rss_bytes": _rss_bytes(),
            "memory_limit": w.memory_guard.limit if w.memory_guard is not None else None,
            "wire_resets": w.wire_resets,
            "metrics_port": self.metrics_port,
            "gil_cpu": self.gil.stats(),  # the CPU the GIL's threads share, its moves (gilcpu.py)
            "replicas": {},
        }
        for r, p in req.pipelines.items():
            f = p.queue.figures()
            out["replicas"][str(r)] = {"floor_step": f.floor, "next_step": p.next_step, "queued_steps": f.steps,
                                       "queued_bytes": f.nbytes, "pending": req.pending(r),
                                       "produced_steps": p.produced_steps, "peers": p.peers,
                                       "failed": p.failed}  # (why its producer thread stopped: None, it runs)
        return out


def _totals(metrics: Metrics) -> dict[str, float]:
    """STATS's ``producer`` block: each of `PRODUCER_METRICS` summed over its labels, by its full name."""
    fams = {f.name: f for f in metrics.families()}
    return {name: sum(child.get() for _, child in fams[name.removesuffix("_total")].children())
            for name in PRODUCER_METRICS}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
