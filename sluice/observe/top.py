"""`sluice top TARGET...`: a refreshing terminal view of live daemons.

TARGET is a daemon endpoint (``ipc://...``, ``tcp://...``; the daemon must run
with ``--metrics-port``) or its metrics URL (``http://127.0.0.1:PORT/metrics``).
Per daemon: tokens/s, batches/s, time to batch and client input wait (p50/p99
of the interval), cache hit rate, fill bytes, verify failures, generation;
per replica: queue depth and age, prefetch lead, commit lag, and per source
the realized vs target share and the quota debt against its bound.

``--once`` samples twice, ``--interval`` apart, prints one frame and exits
(for scripts and tests). ``--record FILE`` appends every sample as a JSON line,
which `sluice report --metrics-log FILE` turns into charts after the run. A
target that does not answer at start is an error within ``--timeout`` seconds
(at once when nothing listens there); one lost later is shown in red and
retried, and a daemon restarted at the same endpoint is found on its new
metrics port. ``--timeout`` bounds each whole exchange with a daemon (STATS,
then the metrics answer), not each read. A daemon started with
``--token-file`` is asked with its token: ``--token-file FILE`` (default:
$SLUICE_TOKEN).

What a daemon sends is shown, never obeyed: label values reach the terminal
with control characters escaped and never as rich markup; a value beyond the
float range or NaN shows as ``inf``/``nan``; at most 12 sources per replica
(largest target share first) and 16 replicas per daemon are listed, with a
line saying how many more there are. An answer that is not a Prometheus
exposition (a bucket without a numeric ``le``, more than 8 MiB or 200,000
series) is an error naming the URL (exit 2 with ``--once``, a red line when
live).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import IO, Any

from sluice.observe.scrape import Sample, View, make_view, metrics_url, scrape, shown

_SHOWN_SOURCES = 12  # per replica; a terminal shows a few lines, a run may mix thousands of sources
_SHOWN_REPLICAS = 16  # per daemon (each lists up to _SHOWN_SOURCES + 1 lines)
_LABEL_CHARS = 48  # a label value longer than this is cut (the metrics URL keeps 200)


def _fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):  # NaN gauges, and values beyond the float range ("1e400")
        return str(v)
    if unit == "s":
        if v < 1e-3:
            return f"{v * 1e6:.0f}us"
        if v < 1:
            return f"{v * 1e3:.{digits}f}ms"
        return f"{v:.{digits}f}s"
    if unit == "B":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or u == "TiB":
                return f"{v:.0f}{u}" if u == "B" else f"{v:.1f}{u}"
            v /= 1024
    if unit == "%":
        return f"{v * 100:.{digits}f}%"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.{digits}f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.{digits}f}k"
    return f"{v:.{digits}f}" if v != int(v) else f"{int(v)}"


def _label(value: str, limit: int = _LABEL_CHARS) -> Any:
    """A cell holding text from a daemon: a rich Text (never parsed as markup) with control
    characters escaped, so neither `[/bold]` nor an escape sequence reaches the terminal as such."""
    from rich.text import Text

    return Text(shown(value, limit))


def _top_sources(targets: dict[str, float], realized: dict[str, float]) -> list[str]:
    """Every source of a replica, largest target share first (then by name)."""
    return sorted(set(targets) | set(realized), key=lambda s: (-targets.get(s, 0.0), s))


def render(views: list[View]) -> Any:
    """A rich renderable: one daemon table and one replica table per view.

    Every value that came from a daemon is a `_label` cell; each replica lists
    at most _SHOWN_SOURCES sources and each daemon _SHOWN_REPLICAS replicas,
    and a line says how many were left out."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(f"sluice top  {time.strftime('%H:%M:%S')}", style="bold")]
    daemons = Table(title="daemons", title_justify="left", expand=False)
    for col in ("run", "metrics", "tokens/s", "batches/s", "ttb p50", "ttb p99", "wait p50", "wait p99",
                "cache hit", "fill", "verify fail", "gen"):
        daemons.add_column(col, justify="left" if col in ("run", "metrics") else "right")
    for v in views:
        daemons.add_row(_label(v.run_id), _label(v.url.removeprefix("http://"), 200), _fmt(v.tokens_per_s),
                        _fmt(v.batches_per_s),
                        _fmt(v.ttb_p50_s, "s"), _fmt(v.ttb_p99_s, "s"), _fmt(v.wait_p50_s, "s"),
                        _fmt(v.wait_p99_s, "s"), _fmt(v.cache_hit_rate, "%"), _fmt(v.fill_bytes, "B"),
                        _fmt(v.verify_failures, digits=0), _fmt(v.generation, digits=0))
    parts.append(daemons)
    reps = Table(title="replicas", title_justify="left", expand=False)
    for col in ("run", "replica", "queue", "age", "lead", "committed", "lag", "source", "realized", "target",
                "debt", "bound"):
        reps.add_column(col, justify="left" if col in ("run", "source") else "right")
    left_out: list[str] = []
    for v in views:
        for r in v.replicas[:_SHOWN_REPLICAS]:
            sources = _top_sources(r.target_share, r.realized_share)
            rows = sources[:_SHOWN_SOURCES] or ["-"]
            for i, s in enumerate(rows):
                head = (_label(v.run_id), _label(f"r{r.replica}"), _fmt(r.queue_steps), _fmt(r.queue_age_s, "s"),
                        _fmt(r.lead_steps), _fmt(r.committed_step, digits=0),
                        _fmt(r.commit_lag_steps)) if i == 0 else ("",) * 7
                debt = r.quota_debt.get(s)
                over = debt is not None and r.debt_bound is not None and abs(debt) > r.debt_bound
                reps.add_row(*head, _label(s), _fmt(r.realized_share.get(s), "%"), _fmt(r.target_share.get(s), "%"),
                             Text(_fmt(debt, digits=2), style="bold red" if over else ""), _fmt(r.debt_bound, digits=0))
            if len(sources) > len(rows):
                reps.add_row("", "", "", "", "", "", "", Text(f"+{len(sources) - len(rows)} more sources",
                                                              style="italic"), "", "", "", "")
        if v.replicas_total > min(len(v.replicas), _SHOWN_REPLICAS):
            left_out.append(f"{shown(v.url, 200)}: {v.replicas_total - min(len(v.replicas), _SHOWN_REPLICAS)} "
                            "more replicas not shown")
    parts.append(reps)
    parts.extend(Text(line, style="italic") for line in left_out)
    return Group(*parts)


class _Target:
    """One daemon being watched: what the user gave, where its metrics are now, the last sample.

    A daemon that restarts comes back on another metrics port, so a target
    given as an endpoint is resolved again after a failed scrape."""

    def __init__(self, spec: str, url: str, token: str | None) -> None:
        self.spec, self.url, self.token = spec, url, token
        self.prev: Sample | None = None
        self.error: str | None = None

    def poll(self, timeout_s: float, record: IO[str] | None) -> View | None:
        """A view over the interval since the last good sample; None (and `error`) if it failed.

        Resolving the endpoint again (after a restart) and scraping share one
        deadline of `timeout_s`."""
        from sluice.errors import ObserveError

        deadline = time.monotonic() + timeout_s
        try:
            if not self.url:
                self.url = metrics_url(self.spec, timeout_s, self.token)
            cur = scrape(self.url, max(0.001, deadline - time.monotonic()))
        except ObserveError as exc:
            self.error, self.prev = str(exc), None
            if not self.spec.startswith(("http://", "https://")):
                self.url = ""
            return None
        if record is not None:
            record.write(json.dumps(cur.to_obj(), separators=(",", ":")) + "\n")
            record.flush()
        view = make_view(self.prev, cur, _SHOWN_REPLICAS)
        self.prev, self.error = cur, None
        return view


def _frame(targets: list[_Target], timeout_s: float, record: IO[str] | None) -> Any:
    from rich.console import Group
    from rich.text import Text

    views = [t.poll(timeout_s, record) for t in targets]
    errors = [Text(f"{t.spec}: {shown(t.error, 500)} (retrying)", style="bold red") for t in targets if t.error]
    return Group(render([v for v in views if v is not None]), *errors)


def run_top(args: argparse.Namespace) -> int:
    """Resolve every target, then print one frame (--once) or refresh until interrupted."""
    from rich.console import Console
    from rich.live import Live

    from sluice.errors import SpecError

    for name in ("interval", "timeout"):
        value = getattr(args, name)
        if not 0 < value <= 3600:
            raise SpecError(f"top: --{name} must be in (0, 3600] seconds, got {value}")
    if args.width is not None and not 20 <= args.width <= 1000:
        raise SpecError(f"top: --width must be in [20, 1000], got {args.width}")
    from sluice.wire.runtoken import TOKEN_ENV, read_token_file

    token = read_token_file(args.token_file) if args.token_file else os.environ.get(TOKEN_ENV) or None
    # Every target must answer once: a wrong endpoint is an error now, not a red line forever.
    targets = [_Target(t, metrics_url(t, args.timeout, token), token) for t in args.targets]
    record = open(args.record, "a", encoding="utf-8") if args.record else None  # noqa: SIM115 (closed below)
    console = Console(width=args.width) if args.width else Console()
    try:
        if args.once:
            views: list[View | None] = []
            for rnd in range(2):  # two samples, --interval apart: the rates need an interval
                if rnd:
                    time.sleep(args.interval)
                views = [t.poll(args.timeout, record) for t in targets]
                failed = [t.error if t.spec in t.error else f"{t.spec}: {t.error}" for t in targets if t.error]
                if failed:
                    from sluice.errors import ObserveError

                    raise ObserveError("; ".join(failed))
            console.print(render([v for v in views if v is not None]))
            return 0
        with Live(_frame(targets, args.timeout, record), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(_frame(targets, args.timeout, record), refresh=True)
    finally:
        if record is not None:
            record.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="daemon endpoint (ipc://, tcp://; needs loaderd --metrics-port) or metrics URL (http://)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    p.add_argument("--once", action="store_true", help="print one frame (rates over one --interval) and exit")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a daemon or URL (default 3)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the run token of a daemon started with --token-file (default: $SLUICE_TOKEN)")
    p.add_argument("--record", metavar="FILE", help="append every sample as a JSON line (for sluice report)")
    p.add_argument("--width", type=int, default=None, help="terminal width (default: detected)")
