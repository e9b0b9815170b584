"""The IO thread's periodic upkeep and the STATS report of a daemon.

`Upkeep.housekeeping` runs every 0.5 s on the IO thread: a producer process
that died (kill -9, OOM killer) turns its replica's next step into an
INTERNAL error naming the process, its pid, exit code and the step, which
answers the waiting GETs at once and every later one (never a hang; a
RESTORE does not revive it: the daemon's supervisor restarts the daemon, and
clients RESTORE); GETs parked longer than the request TTL are answered
ERROR(EXPIRED); lapsed HELLO `peers` claims are dropped and the release
re-runs; gauges are set. It asks the daemon's parts through their methods:
`Requests` (handlers.py) for parked GETs, claims and counters, `WireIO`
(wireio.py) for the wire's, each producer's `StepQueue` for its figures.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from sluice.errors import SluiceError
from sluice.loaderd.handlers import Requests
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.physical.producer import Producer, terminal
from sluice.loaderd.physical.producermetrics import ProducerFold, totals
from sluice.loaderd.wireio import WireIO
from sluice.wire import errorcodes

__all__ = ["Upkeep"]

log = logging.getLogger("sluice.loaderd")


class Upkeep:
    """Housekeeping and STATS over a daemon's parts (given, never the server itself)."""

    def __init__(self, requests: Requests, wire_io: WireIO, data: Any, metrics: Metrics, fold: ProducerFold) -> None:
        self.requests, self.wire, self.data, self.metrics, self.fold = requests, wire_io, data, metrics, fold
        self.metrics_port: int | None = None  # set once the metrics port is bound

    def housekeeping(self, now: float) -> None:
        """Every 0.5 s on the IO thread: dead producers, expired GETs, lapsed peer claims, gauges."""
        req = self.requests
        for r, p in req.pipelines.items():
            p.tend()
            code = p.exit_code()
            if code is not None:
                self._producer_died(r, p, code)
            self.metrics.released_credits.inc(req.expire(r, now))
            req.lapse_claims(r, now)
            self._gauges(r, p, now)
        if req.rings is not None:  # the rings of clients silent as long as a claim lives (rings.py, `expire`)
            req.rings.expire(now, req.claims.ttl_s)
        docs = self.data.docs
        self.metrics.docs_cache_bytes.set(docs.nbytes + self.fold.gauge_sum("sluice_decoded_cache_bytes"))
        self.metrics.publish_states()
        try:
            self.metrics.observe_cache(self.data.cache.stats())
        except SluiceError:  # stats are best effort; a busy index must not stop serving
            pass

    def _gauges(self, r: int, p: Producer, now: float) -> None:
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

    def _producer_died(self, r: int, p: Producer, code: int) -> None:
        """A producer process exited: its replica's next step becomes an INTERNAL error (never a hang).

        Steps it produced before are still served; the error is the stream's last
        step, so GETs of that step or later fail with it (the message and the body
        fields `pid`, `exit_code` name the process).
        """
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        message = (f"step {p.next_step}: the producer process (pid {p.pid}) of replica {r} {how}; "
                   f"exit code {code}. Steps before {p.next_step} are served; restart loaderd "
                   f"to go on (a restarted daemon is RESTOREd by its clients)")
        if not p.queue.end_with(terminal(p.next_step, errorcodes.E_INTERNAL, message, pid=p.pid, exit_code=code)):
            return
        log.error("producer process died", extra={"replica": r, "step": p.next_step, "pid": p.pid, "exit_code": code})
        self.requests.serve_pending(r)

    def stats(self) -> dict[str, Any]:
        """The STATS body: identity, generation, counters, producer metrics, RSS and per-replica queue figures.

        decoded_* and ``producer`` (the producer-side metrics, summed over labels)
        include the producer processes' last snapshots under `--producer process`;
        so does ``fast_path`` (`Metrics.fast_path`: steps per path, fall-backs per
        reason, the compiled kernel loaded).
        """
        req, w, docs = self.requests, self.wire, self.data.docs
        children = self.fold.stats_sum()
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
            "decoded_bytes": docs.nbytes + children["decoded_bytes"],
            "decoded_hits": docs.hits + children["decoded_hits"],
            "decoded_misses": docs.misses + children["decoded_misses"],
            "producer": totals(self.metrics),
            "fast_path": self.metrics.fast_path(),
            "rings": req.rings.stats() if req.rings is not None else None,
            "joined": req.joined.stats(),  # ring replies sent joined (joined.py)
            "tokenizer": docs.tokenizer_stats(),
            "rss_bytes": _rss_bytes(),
            "memory_limit": w.memory_guard.limit if w.memory_guard is not None else None,
            "wire_resets": w.wire_resets,
            "metrics_port": self.metrics_port,
            "replicas": {},
        }
        for r, p in req.pipelines.items():
            f = p.queue.figures()
            out["replicas"][str(r)] = {"floor_step": f.floor, "next_step": p.next_step, "queued_steps": f.steps,
                                       "queued_bytes": f.nbytes, "pending": req.pending(r),
                                       "produced_steps": p.produced_steps, "peers": p.peers}
        return out


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
