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
metrics port.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import IO, Any

from sluice.observe.scrape import Sample, View, make_view, metrics_url, scrape


def _fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
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


def render(views: list[View]) -> Any:
    """A rich renderable: one daemon table and one replica table per view."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(f"sluice top  {time.strftime('%H:%M:%S')}", style="bold")]
    daemons = Table(title="daemons", title_justify="left", expand=False)
    for col in ("run", "metrics", "tokens/s", "batches/s", "ttb p50", "ttb p99", "wait p50", "wait p99",
                "cache hit", "fill", "verify fail", "gen"):
        daemons.add_column(col, justify="left" if col in ("run", "metrics") else "right")
    for v in views:
        daemons.add_row(v.run_id, v.url.removeprefix("http://"), _fmt(v.tokens_per_s), _fmt(v.batches_per_s),
                        _fmt(v.ttb_p50_s, "s"), _fmt(v.ttb_p99_s, "s"), _fmt(v.wait_p50_s, "s"),
                        _fmt(v.wait_p99_s, "s"), _fmt(v.cache_hit_rate, "%"), _fmt(v.fill_bytes, "B"),
                        _fmt(v.verify_failures, digits=0), _fmt(v.generation, digits=0))
    parts.append(daemons)
    reps = Table(title="replicas", title_justify="left", expand=False)
    for col in ("run", "replica", "queue", "age", "lead", "committed", "lag", "source", "realized", "target",
                "debt", "bound"):
        reps.add_column(col, justify="left" if col in ("run", "source") else "right")
    for v in views:
        for r in v.replicas:
            sources = sorted(set(r.target_share) | set(r.realized_share)) or ["-"]
            for i, s in enumerate(sources):
                head = (v.run_id, f"r{r.replica}", _fmt(r.queue_steps), _fmt(r.queue_age_s, "s"), _fmt(r.lead_steps),
                        _fmt(r.committed_step, digits=0), _fmt(r.commit_lag_steps)) if i == 0 else ("",) * 7
                debt = r.quota_debt.get(s)
                over = debt is not None and r.debt_bound is not None and abs(debt) > r.debt_bound
                reps.add_row(*head, s, _fmt(r.realized_share.get(s), "%"), _fmt(r.target_share.get(s), "%"),
                             Text(_fmt(debt, digits=2), style="bold red" if over else ""),
                             _fmt(r.debt_bound, digits=0) if r.debt_bound != float("inf") else "inf")
    parts.append(reps)
    return Group(*parts)


class _Target:
    """One daemon being watched: what the user gave, where its metrics are now, the last sample.

    A daemon that restarts comes back on another metrics port, so a target
    given as an endpoint is resolved again after a failed scrape."""

    def __init__(self, spec: str, url: str) -> None:
        self.spec, self.url = spec, url
        self.prev: Sample | None = None
        self.error: str | None = None

    def poll(self, timeout_s: float, record: IO[str] | None) -> View | None:
        """A view over the interval since the last good sample; None (and `error`) if it failed."""
        from sluice.errors import ObserveError

        try:
            if not self.url:
                self.url = metrics_url(self.spec, timeout_s)
            cur = scrape(self.url, timeout_s)
        except ObserveError as exc:
            self.error, self.prev = str(exc), None
            if not self.spec.startswith(("http://", "https://")):
                self.url = ""
            return None
        if record is not None:
            record.write(json.dumps(cur.to_obj(), separators=(",", ":")) + "\n")
            record.flush()
        view = make_view(self.prev, cur)
        self.prev, self.error = cur, None
        return view


def _frame(targets: list[_Target], timeout_s: float, record: IO[str] | None) -> Any:
    from rich.console import Group
    from rich.text import Text

    views = [t.poll(timeout_s, record) for t in targets]
    errors = [Text(f"{t.spec}: {t.error} (retrying)", style="bold red") for t in targets if t.error]
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
    # Every target must answer once: a wrong endpoint is an error now, not a red line forever.
    targets = [_Target(t, metrics_url(t, args.timeout)) for t in args.targets]
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
    p.add_argument("--record", metavar="FILE", help="append every sample as a JSON line (for sluice report)")
    p.add_argument("--width", type=int, default=None, help="terminal width (default: detected)")
