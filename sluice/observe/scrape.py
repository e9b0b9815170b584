"""Read a live daemon's Prometheus metrics into one `Sample`, and two samples into a `View`.

    url = metrics_url("ipc:///tmp/sluice-loaderd-x/loaderd.sock")   # or "http://127.0.0.1:9100/metrics"
    a = scrape(url); time.sleep(1); b = scrape(url)
    view = make_view(a, b)          # rates over the interval between the two samples

A ZeroMQ endpoint is asked for its metrics port with a STATS request (the
daemon must run with ``--metrics-port``; a daemon started with ``--token-file``
needs the run token). ``timeout_s`` bounds each whole exchange, not each read:
an HTTP answer that trickles in (a byte a second) is cut off when it runs out.
What is read is bounded too: at most 8 MiB and 200,000 series per scrape.
Only the text exposition format is parsed (prometheus client's parser);
nothing read is evaluated. A histogram bucket without a numeric ``le`` is
refused; values beyond the float range read as infinities (as Prometheus reads
them). Label values are shown by `sluice top` only through `terminal_safe`.
A daemon that does not answer, or answers what cannot be shown, is an
`ObserveError` naming the endpoint or URL.
"""

from __future__ import annotations

import http.client
import io
import math
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ObserveError
from sluice.manifest.cli import terminal_safe

# (metric name, labels as a sorted tuple of pairs) -> value
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_MAX_BYTES = 8 << 20  # a daemon's exposition is a few kB (a few MB with thousands of sources); refuse absurd ones
_MAX_HEAD = 64 << 10  # status line and headers of the HTTP answer
_MAX_SERIES = 200_000  # about 40 bytes a series at least: what 8 MiB can hold, and make_view stays linear in it


def shown(text: str, limit: int = 200) -> str:
    """`text` from a daemon or a file as it may reach a terminal or an error message: control,
    bidi and zero-width characters escaped (`terminal_safe`), cut to `limit` characters."""
    text = terminal_safe(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def metrics_url(target: str, timeout_s: float = 3.0, token: str | None = None) -> str:
    """The /metrics URL of `target`: an http(s) URL as is, or a daemon endpoint resolved through STATS
    (with the run `token` for a daemon started with --token-file), all within `timeout_s`."""
    if target.startswith(("http://", "https://")):
        return target if target.rstrip("/").endswith("/metrics") else target.rstrip("/") + "/metrics"
    if not target.startswith(("ipc://", "tcp://")):
        raise ObserveError(f"{target!r} is neither a daemon endpoint (ipc://, tcp://) nor a metrics URL (http://)")
    from sluice.client.cli import daemon_stats
    from sluice.errors import DaemonUnavailable, HandshakeRefused

    try:
        stats = daemon_stats(target, timeout_s, token)
    except HandshakeRefused as exc:
        hint = "" if token else ("; a daemon started with --token-file needs its token: --token-file FILE or "
                                 "$SLUICE_TOKEN")
        raise ObserveError(f"{exc}{hint}") from exc
    except DaemonUnavailable as exc:
        raise ObserveError(str(exc)) from exc
    port = stats.get("metrics_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ObserveError(f"the loaderd at {target} names metrics port {shown(repr(port), 40)}; "
                           "expected a TCP port 1..65535")
    if port is None:
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


def _value(v: Any) -> float:
    """A sample's value as a float: an integer beyond the float range is an infinity of its sign
    (as Prometheus reads "1e400"), never an OverflowError."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def parse_exposition(text: str, where: str = "metrics exposition") -> Series:
    """Prometheus text format -> series (histograms keep their _bucket/_sum/_count samples).

    ObserveError naming `where` for text that is not the format, more than
    _MAX_SERIES series, or a `_bucket` series without a numeric, non-NaN `le`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Series = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = s.labels.get("le")
                    try:
                        bad = le is None or math.isnan(float(le))
                    except ValueError:
                        bad = True
                    if bad:
                        raise ObserveError(f"{where}: histogram bucket {shown(s.name, 100)} has le="
                                           f"{shown(repr(le), 60)}; expected a number (the bucket's upper bound)")
                out[(s.name, tuple(sorted(s.labels.items())))] = _value(s.value)
                if len(out) > _MAX_SERIES:
                    raise ObserveError(f"{where}: more than {_MAX_SERIES} series; not a loaderd exporter")
    except (ValueError, TypeError, IndexError) as exc:  # the parser's own refusals of malformed lines
        raise ObserveError(f"{where} is not in the Prometheus text format: {shown(str(exc))}") from exc
    return out


class _Replay:
    """The bytes of a whole HTTP answer, read already, handed to http.client's parser as its socket."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self._data)


def http_get(url: str, timeout_s: float) -> bytes:
    """The body of GET `url` (http or https); connecting, sending and reading all of the answer
    take at most `timeout_s` seconds together, and the answer at most _MAX_BYTES.

    One request (HTTP/1.0, `Connection: close`): the answer ends when the
    server closes, so every read has a known end. The socket's timeout is set
    to what is left of the deadline before each read, so a server that sends
    a byte a second is cut off at the deadline, not waited for. ObserveError
    naming the URL otherwise (no answer, too slow, too large, not HTTP, not 200)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ObserveError(f"{shown(url)}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ObserveError(f"{shown(url)}: not an http:// or https:// URL with a host")
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise TimeoutError("timed out")
        return rest

    data = bytearray()
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=left())
        try:
            if parts.scheme == "https":
                import ssl

                sock.settimeout(left())
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            sock.settimeout(left())
            sock.sendall(f"GET {target} HTTP/1.0\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\n"
                         "Connection: close\r\n\r\n".encode("ascii", "replace"))
            while True:
                sock.settimeout(left())
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
                if len(data) > _MAX_BYTES + _MAX_HEAD:
                    raise ObserveError(f"metrics at {shown(url)}: more than {_MAX_BYTES} bytes; "
                                       "not a loaderd exporter")
        finally:
            sock.close()
    except TimeoutError as exc:
        got = f" (got {len(data)} bytes of an answer)" if data else ""
        raise ObserveError(f"no complete answer from {shown(url)} within {timeout_s:.3g} s{got}") from exc
    except (OSError, UnicodeError) as exc:
        raise ObserveError(f"no metrics at {shown(url)} ({shown(str(exc))})") from exc
    resp = http.client.HTTPResponse(_Replay(bytes(data)))  # type: ignore[arg-type]
    try:
        resp.begin()
        body = resp.read()
    except (http.client.HTTPException, ValueError) as exc:
        raise ObserveError(f"{shown(url)} did not answer in HTTP ({type(exc).__name__}: "
                           f"{shown(str(exc), 100)})") from exc
    if resp.status != 200:
        raise ObserveError(f"{shown(url)} answered HTTP {resp.status} {shown(resp.reason, 60)}")
    if len(body) > _MAX_BYTES:
        raise ObserveError(f"metrics at {shown(url)}: more than {_MAX_BYTES} bytes; not a loaderd exporter")
    return body


def scrape(url: str, timeout_s: float = 3.0) -> Sample:
    """GET `url` and parse it; ObserveError (naming the URL) if the whole answer does not come
    within `timeout_s`, or is not a Prometheus exposition `sluice top` can show."""
    body = http_get(url, timeout_s)
    series = parse_exposition(body.decode("utf-8", "replace"), f"metrics at {shown(url)}")
    return Sample(url=url, t=time.monotonic(), wall=time.time(), series=series)


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


class _Index:
    """A sample's series grouped by metric name, built in one pass, so that a view of R
    replicas and S sources costs O(series), not O(R x series) (a hostile exporter may
    name thousands of replicas)."""

    def __init__(self, s: Sample) -> None:
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for (n, lab), v in s.series.items():
            self.by_name.setdefault(n, []).append((dict(lab), v))

    def total(self, name: str, label: str | None = None) -> dict[str | None, float]:
        """Sum of the series `name` per value of `label` (None: one sum under the key None);
        series without that label are left out."""
        out: dict[str | None, float] = {}
        for lab, v in self.by_name.get(name, ()):
            key = lab.get(label) if label is not None else None
            if label is None or key is not None:
                out[key] = out.get(key, 0.0) + v
        return out

    def per(self, name: str, label: str, other: str) -> dict[str, dict[str, float]]:
        """{value of `label`: {value of `other`: sum}} of the series `name` that carry both labels."""
        out: dict[str, dict[str, float]] = {}
        for lab, v in self.by_name.get(name, ()):
            a, b = lab.get(label), lab.get(other)
            if a is not None and b is not None:
                inner = out.setdefault(a, {})
                inner[b] = inner.get(b, 0.0) + v
        return out


def _buckets(idx: _Index, name: str) -> list[tuple[float, float]]:
    # parse_exposition admitted only buckets with a numeric le
    return sorted((float(le), c) for le, c in idx.total(name + "_bucket", "le").items() if le is not None)


def _delta_buckets(a: _Index | None, b: _Index, name: str) -> list[tuple[float, float]]:
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
    replicas_total: int = 0  # replicas the daemon names; `replicas` may hold only the first of them


def _rate(a: Sample | None, b: Sample, name: str) -> float | None:
    if a is None:
        return None
    va, vb = a.get(name), b.get(name)
    dt = b.t - a.t
    if va is None or vb is None or dt <= 0:
        return None
    return max(0.0, vb - va) / dt


def make_view(a: Sample | None, b: Sample, max_replicas: int | None = None) -> View:
    """Rates between samples `a` and `b` (None rates without `a`); quantiles of the interval's observations.

    Linear in the number of series; series that lack the label a view groups
    by (replica, source) are left out, not an error. With `max_replicas`, only
    the first that many replicas (in numeric-like order) get a ReplicaView;
    `replicas_total` counts them all."""
    ib, ia = _Index(b), (_Index(a) if a is not None else None)
    hits, misses = b.get("sluice_cache_hits_total"), b.get("sluice_cache_misses_total")
    if a is not None and hits is not None and misses is not None:
        hits -= a.get("sluice_cache_hits_total") or 0.0
        misses -= a.get("sluice_cache_misses_total") or 0.0
    ttb = _delta_buckets(ia, ib, "sluice_time_to_batch_seconds")
    wait = _delta_buckets(ia, ib, "sluice_client_input_wait_seconds")
    targets = {k: v for k, v in ib.total("sluice_source_target_share", "source").items() if k is not None}
    realized = ib.per("sluice_source_realized_units", "replica", "source")
    debts = ib.per("sluice_source_quota_debt_units", "replica", "source")
    levels = {name: ib.total(name, "replica") for name in (
        "sluice_queue_depth_steps", "sluice_queue_age_seconds", "sluice_prefetch_lead_steps",
        "sluice_commit_lag_steps", "sluice_committed_step", "sluice_quota_debt_bound_units")}
    replicas = []
    names = {r for r in levels["sluice_queue_depth_steps"] if r is not None} | set(realized)
    for r in sorted(names, key=lambda x: (len(x), x))[:max_replicas]:
        mine = realized.get(r, {})
        total = sum(mine.values())
        replicas.append(ReplicaView(
            replica=r,
            queue_steps=levels["sluice_queue_depth_steps"].get(r),
            queue_age_s=levels["sluice_queue_age_seconds"].get(r),
            lead_steps=levels["sluice_prefetch_lead_steps"].get(r),
            commit_lag_steps=levels["sluice_commit_lag_steps"].get(r),
            committed_step=levels["sluice_committed_step"].get(r),
            realized_share={k: (v / total if total else 0.0) for k, v in mine.items()},
            target_share=targets,
            quota_debt=debts.get(r, {}),
            debt_bound=levels["sluice_quota_debt_bound_units"].get(r),
        ))
    run_ids = sorted({lab.get("run_id", "") for group in ib.by_name.values() for lab, _ in group} - {""})
    more = f" +{len(run_ids) - 3} more" if len(run_ids) > 3 else ""  # one daemon serves one run
    return View(
        url=b.url,
        run_id=",".join(run_ids[:3]) + more or "?",
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
        replicas_total=len(names),
    )
