"""The IO thread's periodic upkeep and the reports (STATS, HELLO_OK body) of a `Server`.

`housekeeping` runs every 0.5 s on the IO thread: a producer process that
died (kill -9, OOM killer) turns its replica's next step into an INTERNAL
error naming the process, its pid, exit code and the step, which answers the
waiting GETs at once and every later one (never a hang; a RESTORE does not
revive it: the daemon's supervisor restarts the daemon, and clients RESTORE);
GETs parked longer than the request TTL are answered ERROR(EXPIRED); lapsed
HELLO `peers` claims are dropped and the release re-runs; gauges are set.
These are functions of the server (not methods) only to keep server.py to
one job: receiving and answering messages.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from sluice import wire
from sluice.errors import SluiceError
from sluice.loaderd.parking import apply_claims
from sluice.loaderd.physical.producer import terminal
from sluice.loaderd.physical.producermetrics import totals


if TYPE_CHECKING:
    from sluice.loaderd.physical.producer import Producer
    from sluice.loaderd.server import Server

log = logging.getLogger("sluice.loaderd")


def housekeeping(self: Server, now: float) -> None:
    """Every 0.5 s on the IO thread: dead producers, expired GETs, lapsed peer claims, gauges."""
    ttl = self.config.request_ttl_s
    for r, p in self.pipelines.items():
        p.tend()
        code = p.exit_code()
        if code is not None:
            _producer_died(self, r, p, code)
        expired = self.parking.expire(r, now, ttl)
        for item in expired:
            # Never silent: a live client learns it must ask again; a vanished one is gone anyway.
            self._error(item.identity, item.header, wire.E_EXPIRED,
                        f"GET of step {item.header.step} micro {item.header.micro} of replica {r} waited "
                        f"longer than the daemon's request TTL of {ttl} s; ask again")
        self.metrics.released_credits.inc(len(expired))
        apply_claims(self.claims, r, p, now)
        _gauges(self, r, p, now)
    self.metrics.docs_cache_bytes.set(self.docs.nbytes + self.producer_fold.gauge_sum("sluice_decoded_cache_bytes"))
    self.metrics.publish_states()
    try:
        self.metrics.observe_cache(self.cache.stats())
    except SluiceError:  # stats are best effort; a busy index must not stop serving
        pass


def _gauges(self: Server, r: int, p: Producer, now: float) -> None:
    g = self.metrics.replica(r)
    with p.queue.cond:
        q = p.queue
        g.queue_steps.set(len(q.entries))
        g.queue_bytes.set(q.nbytes)
        first = next(iter(q.entries.values()), None)
        g.queue_age.set(now - first.created if first else 0.0)
        g.lead.set(p.next_step - q.floor)
        floor = q.floor
    g.pending.set(self.parking.count(r))
    c = self._committed_steps.get(r)
    if c is not None:
        g.commit_lag.set(max(0, floor - 1 - c))


def _producer_died(self: Server, r: int, p: Producer, code: int) -> None:
    """A producer process exited: its replica's next step becomes an INTERNAL error (never a hang).

    Steps it produced before are still served; the error is the stream's last
    step, so GETs of that step or later fail with it (the message and the body
    fields `pid`, `exit_code` name the process).
    """
    with p.queue.cond:
        last = next(reversed(p.queue.entries.values()), None)
        if last is not None and last.error is not None:
            return
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        message = (f"step {p.next_step}: the producer process (pid {p.pid}) of replica {r} {how}; "
                   f"exit code {code}. Steps before {p.next_step} are served; restart loaderd "
                   f"to go on (a restarted daemon is RESTOREd by its clients)")
        p.queue.put(terminal(p.next_step, wire.E_INTERNAL, message, pid=p.pid, exit_code=code))
    log.error("producer process died", extra={"replica": r, "step": p.next_step, "pid": p.pid, "exit_code": code})
    self._serve_pending(r)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def hello_body(self: Server, replica: int) -> dict[str, Any]:
    """The HELLO_OK body: who this daemon is and where `replica` stands (docs/protocol.md)."""
    p = self.pipelines[replica]
    with p.queue.cond:
        floor = p.queue.floor
    committed = self.gate.fence.committed(replica)
    c = self.config
    return {
        "instance": self.instance,
        "generation": self.generation,
        "floor_step": floor,
        "next_step": p.next_step,
        "micro_per_step": p.micro_per_step,
        "lanes": p.lanes,
        "replicas": c.replicas,
        "seq_len": c.manifest.packing.seq_len,
        "micro_batch": c.spec.micro_batch,
        "global_batch": c.spec.global_batch,
        "max_steps": c.spec.max_steps,
        "lead_steps": c.lead_steps,
        "request_ttl_s": c.request_ttl_s,
        "committed_step": committed["step"] if committed else -1,
        "runspec_digest": c.spec.digest,
        "resume": c.spec.resume,
    }


def stats(self: Server) -> dict[str, Any]:
    """The STATS body: identity, generation, counters, producer metrics, RSS and per-replica queue figures.

    decoded_* and ``producer`` (the producer-side metrics, summed over labels)
    include the producer processes' last snapshots under `--producer process`;
    so does ``fast_path`` (`Metrics.fast_path`: steps per path, fall-backs per
    reason, the compiled kernel loaded).
    """
    children = self.producer_fold.stats_sum()
    out: dict[str, Any] = {
        "instance": self.instance,
        "run_id": self.run_id,
        "dataset_id": self.dataset_id,
        "replicas_total": self.config.replicas,
        "served": sorted(self.pipelines),
        "generation": self.generation,
        "requests": self.requests,
        "errors": self.metrics.error_counts(),
        "dropped_frames": self.dropped_frames,
        "undeliverable": self.undeliverable,
        "connections": self.connections.open if self.connections is not None else 0,
        "unauthorized": self.unauthorized + getattr(self._auth, "denied", 0),
        "decoded_bytes": self.docs.nbytes + children["decoded_bytes"],
        "decoded_hits": self.docs.hits + children["decoded_hits"],
        "decoded_misses": self.docs.misses + children["decoded_misses"],
        "producer": totals(self.metrics),
        "fast_path": self.metrics.fast_path(),
        "tokenizer": self.docs.tokenizer_stats(),
        "rss_bytes": _rss_bytes(),
        "memory_limit": self.memory_guard.limit if self.memory_guard is not None else None,
        "wire_resets": self.wire_resets,
        "metrics_port": self.metrics_port,
        "replicas": {},
    }
    for r, p in self.pipelines.items():
        with p.queue.cond:
            out["replicas"][str(r)] = {
                "floor_step": p.queue.floor,
                "next_step": p.next_step,
                "queued_steps": len(p.queue.entries),
                "queued_bytes": p.queue.nbytes,
                "pending": self.parking.count(r),
                "produced_steps": p.produced_steps,
                "peers": p.peers,
            }
    return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
