"""Read a live daemon's Prometheus metrics into one `Sample`, and two samples into a `View`.

    url = metrics_url("ipc:///tmp/sluice-loaderd-x/loaderd.sock")   # or "http://127.0.0.1:9100/metrics"
    a = scrape(url); time.sleep(1); b = scrape(url)
    view = make_view(a, b)          # rates over the interval between the two samples

A ZeroMQ endpoint is asked for its metrics port with an anonymous STATS request
(the daemon must run with ``--metrics-port``). Every wait is bounded by
``timeout_s``; a daemon that does not answer is an `ObserveError` naming
the endpoint or URL. Only the text exposition format is parsed (prometheus
client's parser); nothing read is evaluated.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ObserveError

# (metric name, labels as a sorted tuple of pairs) -> value
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_MAX_BYTES = 8 << 20  # a daemon's exposition is a few kB; refuse anything absurd


def metrics_url(target: str, timeout_s: float = 3.0) -> str:
    """The /metrics URL of `target`: an http(s) URL as is, or a daemon endpoint resolved through STATS."""
    if target.startswith(("http://", "https://")):
        return target if target.rstrip("/").endswith("/metrics") else target.rstrip("/") + "/metrics"
    if not target.startswith(("ipc://", "tcp://")):
        raise ObserveError(f"{target!r} is neither a daemon endpoint (ipc://, tcp://) nor a metrics URL (http://)")
    from sluice.client.cli import _daemon_stats
    from sluice.client.iterator import DaemonUnavailable

    try:
        stats = _daemon_stats(target, timeout_s)
    except DaemonUnavailable as exc:
        raise ObserveError(str(exc)) from exc
    port = stats.get("metrics_port")
    if not isinstance(port, int):
        raise ObserveError(f"the loaderd at {target} serves no metrics: start it with --metrics-port N "
                                "(0 = any free port)")
    host = "127.0.0.1"  # the exporter binds loopback (loaderd --metrics-port)
    if target.startswith("tcp://"):
        host = target[len("tcp://"):].rsplit(":", 1)[0] or host
    return f"http://{host}:{port}/metrics"


@dataclass(frozen=True)
class Sample:
    """One scrape: when (monotonic and wall seconds), from where, and every series."""

    url: str
    t: float
    wall: float
    series: Series

    def get(self, name: str, **labels: str) -> float | None:
        """Sum of the series named `name` whose labels include `labels`; None if there is none."""
        found = [v for (n, lab), v in self.series.items() if n == name and _has(lab, labels)]
        return sum(found) if found else None

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({dict(lab)[label] for (n, lab) in self.series if n == name and label in dict(lab)})

    def to_obj(self) -> dict[str, Any]:
        """JSON-able record (one line of a metrics log for `sluice report`)."""
        return {"kind": "sluice.metrics-sample", "url": self.url, "wall": self.wall,
                "series": [[n, dict(lab), v] for (n, lab), v in sorted(self.series.items())]}


def _has(lab: tuple[tuple[str, str], ...], want: dict[str, str]) -> bool:
    d = dict(lab)
    return all(d.get(k) == v for k, v in want.items())


def parse_exposition(text: str) -> Series:
    """Prometheus text format -> series (histograms keep their _bucket/_sum/_count samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Series = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except ValueError as exc:
        raise ObserveError(f"metrics exposition is not in the Prometheus text format: {exc}") from exc
    return out


def scrape(url: str, timeout_s: float = 3.0) -> Sample:
    """GET `url` and parse it; ObserveError (naming the URL) if it does not answer within `timeout_s`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (http only, user-given)
            body = resp.read(_MAX_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ObserveError(f"no metrics at {url} within {timeout_s:g} s ({reason})") from exc
    if len(body) > _MAX_BYTES:
        raise ObserveError(f"metrics at {url}: more than {_MAX_BYTES} bytes; not a loaderd exporter")
    return Sample(url=url, t=time.monotonic(), wall=time.time(), series=parse_exposition(body.decode("utf-8", "replace")))


# -- derived view -------------------------------------------------------------------
def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile `q` of cumulative (upper bound, count) buckets, interpolated as PromQL does; None if empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return prev_le


def _buckets(s: Sample, name: str) -> list[tuple[float, float]]:
    out: dict[float, float] = {}
    for (n, lab), v in s.series.items():
        if n == name + "_bucket":
            le = float(dict(lab)["le"])
            out[le] = out.get(le, 0.0) + v
    return sorted(out.items())


def _delta_buckets(a: Sample | None, b: Sample, name: str) -> list[tuple[float, float]]:
    nb = _buckets(b, name)
    if a is None:
        return nb
    na = dict(_buckets(a, name))
    return [(le, max(0.0, c - na.get(le, 0.0))) for le, c in nb]


@dataclass(frozen=True)
class ReplicaView:
    replica: str
    queue_steps: float | None
    queue_age_s: float | None
    lead_steps: float | None
    commit_lag_steps: float | None
    committed_step: float | None
    realized_share: dict[str, float]
    target_share: dict[str, float]
    quota_debt: dict[str, float]
    debt_bound: float | None


@dataclass(frozen=True)
class View:
    """What `sluice top` shows for one daemon: rates over (a, b], levels at b."""

    url: str
    run_id: str
    interval_s: float
    tokens_per_s: float | None
    batches_per_s: float | None
    ttb_p50_s: float | None
    ttb_p99_s: float | None
    wait_p50_s: float | None
    wait_p99_s: float | None
    cache_hit_rate: float | None
    fill_bytes: float | None
    verify_failures: float | None
    generation: float | None
    replicas: list[ReplicaView] = field(default_factory=list)


def _rate(a: Sample | None, b: Sample, name: str) -> float | None:
    if a is None:
        return None
    va, vb = a.get(name), b.get(name)
    dt = b.t - a.t
    if va is None or vb is None or dt <= 0:
        return None
    return max(0.0, vb - va) / dt


def make_view(a: Sample | None, b: Sample) -> View:
    """Rates between samples `a` and `b` (None rates without `a`); quantiles of the interval's observations."""
    hits, misses = b.get("sluice_cache_hits_total"), b.get("sluice_cache_misses_total")
    if a is not None and hits is not None and misses is not None:
        hits -= a.get("sluice_cache_hits_total") or 0.0
        misses -= a.get("sluice_cache_misses_total") or 0.0
    ttb = _delta_buckets(a, b, "sluice_time_to_batch_seconds")
    wait = _delta_buckets(a, b, "sluice_client_input_wait_seconds")
    targets = {dict(lab)["source"]: v for (n, lab), v in b.series.items() if n == "sluice_source_target_share"}
    replicas = []
    names = set(b.label_values("sluice_queue_depth_steps", "replica")) | set(
        b.label_values("sluice_source_realized_units", "replica"))
    for r in sorted(names, key=lambda x: (len(x), x)):
        realized = {dict(lab)["source"]: v for (n, lab), v in b.series.items()
                    if n == "sluice_source_realized_units" and dict(lab).get("replica") == r}
        total = sum(realized.values())
        replicas.append(ReplicaView(
            replica=r,
            queue_steps=b.get("sluice_queue_depth_steps", replica=r),
            queue_age_s=b.get("sluice_queue_age_seconds", replica=r),
            lead_steps=b.get("sluice_prefetch_lead_steps", replica=r),
            commit_lag_steps=b.get("sluice_commit_lag_steps", replica=r),
            committed_step=b.get("sluice_committed_step", replica=r),
            realized_share={k: (v / total if total else 0.0) for k, v in realized.items()},
            target_share=targets,
            quota_debt={dict(lab)["source"]: v for (n, lab), v in b.series.items()
                        if n == "sluice_source_quota_debt_units" and dict(lab).get("replica") == r},
            debt_bound=b.get("sluice_quota_debt_bound_units", replica=r),
        ))
    run_ids = sorted({dict(lab).get("run_id", "") for (_, lab) in b.series} - {""})
    return View(
        url=b.url,
        run_id=",".join(run_ids) or "?",
        interval_s=(b.t - a.t) if a is not None else 0.0,
        tokens_per_s=_rate(a, b, "sluice_served_tokens_total"),
        batches_per_s=_rate(a, b, "sluice_batches_served_total"),
        ttb_p50_s=histogram_quantile(0.5, ttb),
        ttb_p99_s=histogram_quantile(0.99, ttb),
        wait_p50_s=histogram_quantile(0.5, wait),
        wait_p99_s=histogram_quantile(0.99, wait),
        cache_hit_rate=(hits / (hits + misses)) if hits is not None and misses is not None and hits + misses > 0 else None,
        fill_bytes=b.get("sluice_cache_fill_bytes_total"),
        verify_failures=b.get("sluice_cache_verify_failures_total"),
        generation=b.get("sluice_generation"),
        replicas=replicas,
    )
