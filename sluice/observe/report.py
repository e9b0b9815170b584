"""`sluice report LEDGER_OR_RUN [--metrics-log FILE ...] -o report.html`: a run on one page.

LEDGER_OR_RUN is either
  * a ledger file: JSON lines of ``sluice ledger --json --every N`` (one ledger per line,
    growing ``until_step``), or
  * a run folder holding ``manifest.json`` and ``run.toml``: the ledger series is then
    computed here, offline (``--until-step K --every N``), as `sluice ledger` does.

``--metrics-log FILE`` (repeatable) adds JSON lines of either kind, told apart per line:
samples recorded by ``sluice top --record FILE`` and the daemon's own JSON logs (its
stderr). The page (self-contained: charts are embedded PNG images) shows the realized vs
target mixture over steps, tokens per source, the client input wait distribution, and
daemon starts, restores and generations on a timeline. A chart whose input is missing
says which option provides it. Needs matplotlib (``pip install 'sluice[report]'``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import io
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError
from sluice.observe.record import (SHOWN_SOURCES, Ledger, RunRecord, compute_ledger, read_ledger,
                                   read_metrics_logs)
from sluice.observe.scrape import shown

def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _name(text: str, limit: int = 40) -> str:
    """Text from the input as a chart shows it: control characters escaped, cut to `limit`
    (charts are drawn with parse_math off, so `$...$` is shown, not typeset)."""
    return shown(text, limit)


def _series_names(led: Ledger) -> list[str]:
    names = [_name(led.names[i]) for i in led.shown]
    return names + ([f"other ({led.hidden} sources)"] if led.hidden else [])


def _shares(led: Ledger) -> Any:
    import matplotlib.pyplot as plt

    assert led.last is not None  # render_html draws this chart only with a ledger
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # 13 lines: the default cycle repeats after 10
    steps = [step for step, _ in led.points]
    targets = [float(r["target_share"]) for r in led.last["rows"]]
    for k, name in enumerate(_series_names(led)):
        line, = ax.plot(steps, [real[k] for _, real in led.points], marker="o" if len(steps) < 40 else None,
                        label=f"{name} realized")
        ax.axhline(targets[k], color=line.get_color(), linestyle="--", linewidth=1, label=f"{name} target")
    ax.set_xlabel("step")
    ax.set_ylabel(f"share of {_name(led.last['unit'])}")
    ax.set_title("realized vs target mixture")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def _tokens(led: Ledger) -> Any:
    import matplotlib.pyplot as plt

    assert led.last is not None
    rows = led.last["rows"]
    fig, ax = plt.subplots(figsize=(8, 3))
    xs = range(len(rows))
    ax.bar(xs, [float(r["tokens"]) for r in rows], color="#4c72b0", label="tokens")
    ax.bar(xs, [float(r["loss_tokens"]) for r in rows], color="#dd8452", width=0.4, label="loss tokens")
    slanted = len(rows) > 4  # long names side by side would overlap
    ax.set_xticks(xs, _series_names(led), rotation=30 if slanted else 0, ha="right" if slanted else "center",
                  fontsize=7)
    ax.set_ylabel("tokens")
    ax.set_title(f"tokens per source up to step {led.last['until_step']}")
    ax.legend(fontsize=8)
    return fig


def _wait(last: dict[str, list[tuple[float, float]]]) -> Any:
    """Per-bucket counts of the input wait histograms, summed over daemons (each one's last sample:
    since that daemon started)."""
    import matplotlib.pyplot as plt

    total: dict[float, float] = {}
    for buckets in last.values():
        for le, c in buckets:
            total[le] = total.get(le, 0.0) + c
    buckets = sorted(total.items())
    les = [le for le, _ in buckets]
    counts = [c - (buckets[i - 1][1] if i else 0.0) for i, (_, c) in enumerate(buckets)]
    fig, ax = plt.subplots(figsize=(8, 3))
    labels = [("<= " + (f"{le * 1e3:g}ms" if le < 1 else f"{le:g}s")) if le != float("inf") else "more" for le in les]
    ax.bar(range(len(les)), counts, color="#55a868")
    ax.set_xticks(range(len(les)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("micro-batches")
    ax.set_title("client input wait (time a rank waited for its next micro-batch)")
    return fig


def _timeline(generations: dict[str, list[tuple[float, float]]], events: list[tuple[str, str, float]]) -> Any:
    import datetime as dt

    import matplotlib.pyplot as plt

    def when(ts: str) -> dt.datetime | None:
        try:
            return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ")
        except ValueError:
            return None

    fig, ax = plt.subplots(figsize=(8, 3))
    for k, (url, points) in enumerate(sorted(generations.items())):
        xs = [dt.datetime.fromtimestamp(w, dt.timezone.utc).replace(tzinfo=None) for w, _ in points]
        where = _name(url.removeprefix("http://").removesuffix("/metrics"), 60)
        # one legend entry per daemon up to SHOWN_SOURCES, then one for the rest (a legend of
        # a thousand entries is what made big reports slow)
        label = (f"generation ({where})" if k < SHOWN_SOURCES else
                 f"generation ({len(generations) - SHOWN_SOURCES} more daemons)" if k == SHOWN_SOURCES else None)
        ax.step(xs, [g for _, g in points], where="post", label=label)
    marks = {"loaderd listening": ("daemon start", "|", "#c44e52"), "restored": ("restore", "o", "#8172b2"),
             "committed": ("commit", ".", "#937860")}
    for msg, (label, marker, color) in marks.items():
        evs = [(when(ts), g) for ts, m, g in events if m == msg]
        evs = [(t, g) for t, g in evs if t is not None]
        if evs:
            ax.plot([t for t, _ in evs], [g for _, g in evs], linestyle="none",
                    marker=marker, markersize=10 if marker == "|" else 6, color=color, label=label)
    import matplotlib.dates as mdates

    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel("generation")
    ax.set_title("daemon starts, restores and generations")
    ax.legend(fontsize=8)
    fig.autofmt_xdate()
    return fig


# -- page --------------------------------------------------------------------------
def _h(value: Any, limit: int = 200) -> str:
    """Any value from the input as HTML text: control characters escaped, cut, then HTML-escaped."""
    return html.escape(shown(str(value), limit))


def _table(led: Ledger) -> str:
    assert led.last is not None
    head = "<tr><th>source</th><th>documents</th><th>tokens</th><th>loss tokens</th><th>epochs</th>" \
           "<th>target</th><th>realized</th></tr>"
    rows = "".join(
        f"<tr><td>{_h(s['source'])}</td><td>{_h(s['docs'])}</td><td>{_h(s['tokens'])}</td>"
        f"<td>{_h(s['loss_tokens'])}</td><td>{_h(s.get('epochs', ''))}</td>"
        f"<td>{float(s['target_share']):.4f}</td><td>{float(s['realized_share']):.4f}</td></tr>"
        for s in led.last["rows"])
    return f"<table>{head}{rows}</table>"


def render_html(rec: RunRecord, title: str) -> str:
    """The page: a summary table and one figure per chart (or a note naming the missing input).

    Everything that came from the input is HTML-escaped (`_h`) on the page and
    drawn without mathtext in the charts."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    sections = []

    def figure(name: str, make: Any, missing: str | None) -> None:
        if missing:
            sections.append(f'<section><h2>{name}</h2><p class="missing">{html.escape(missing)}</p></section>')
            return
        # A source named "$\frac{$" must be shown, not typeset (and not fail to typeset).
        with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
            png = _png(make())
        sections.append(f'<section><h2>{name}</h2><img alt="{name}" src="data:image/png;base64,{png}"></section>')

    led = rec.ledger
    no_ledger = "no ledger: give a ledger file or a run folder" if led is None else None
    no_samples = "no metrics samples: record them with `sluice top TARGET --record FILE` and pass --metrics-log FILE"
    figure("Mixture over steps", lambda: _shares(led), no_ledger)
    figure("Tokens per source", lambda: _tokens(led), no_ledger)
    figure("Input wait", lambda: _wait(rec.wait_last), None if rec.wait_last else no_samples)
    figure("Restores and generations", lambda: _timeline(rec.generations, rec.events),
           None if rec.generations or rec.events else
           "no metrics samples or daemon logs: pass --metrics-log with `sluice top --record` output or loaderd's stderr")
    summary = ""
    if led is not None and led.last is not None:
        last = led.last
        ended = f"<p>stream ended early: {_h(last['ended'], 2000)}</p>" if last.get("ended") else ""
        others = (f"<p>{len(led.names)} sources: the {len(led.shown)} of largest target share are shown one by one; "
                  f"the other {led.hidden} are summed as one entry in the table and the charts</p>"
                  if led.hidden else "")
        summary = (f"<p>ledger up to step {last['until_step']}, unit {_h(last['unit'])}, "
                   f"policy {_h(last['policy'])}</p>{ended}{others}{_table(led)}")
    counts = f"<p>{rec.samples} metrics samples, {rec.starts} daemon starts, {rec.restores} restores in the logs</p>"
    style = ("body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child{text-align:left}"
             "img{max-width:100%}.missing{color:#a33}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{_h(title)}</title>"
            f"<style>{style}</style></head><body><h1>{_h(title)}</h1>{summary}{counts}"
            f"{''.join(sections)}</body></html>\n")


def write_page(out: Path, page: str) -> None:
    """Write `page` to `out` as a new file, atomically: a temporary file created exclusively in
    the same folder (mode 0666 less the umask), then renamed over `out`.

    Refuses (ObserveError) when something other than a regular file is at
    `out`: a symbolic link, a folder, a device node, a FIFO or a socket is
    never replaced or written through. A regular file there is replaced as a
    whole (its other hard links keep the old bytes). Between the check and the
    rename someone who can write to the folder could put something else
    there; the rename then replaces that entry, never writes into it."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ObserveError(f"-o {shown(str(out))}: cannot check the path ({reason})") from exc
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                else "a device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a FIFO or socket")
        raise ObserveError(f"-o {shown(str(out))}: {kind} is there, not a regular file; sluice report replaces only "
                           "a regular file (remove it or choose another path)")
    data = page.encode("utf-8")
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.tmp")
    try:
        # O_EXCL | O_NOFOLLOW: a name planted in the folder is never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        raise ObserveError(f"-o {shown(str(out))}: cannot create a file in {shown(str(out.parent))} "
                           f"({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as exc:  # no temporary file is left behind, whatever stopped the write
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise ObserveError(f"-o {shown(str(out))}: cannot write ({exc.strerror or exc})") from exc
        raise


def run_report(args: argparse.Namespace) -> int:
    """Read the inputs, render, write the page atomically (`write_page`); prints its path."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ObserveError("sluice report needs matplotlib: pip install 'sluice[report]'") from exc
    src = Path(args.ledger_or_run)
    rec = RunRecord()
    if src.is_dir():
        if args.until_step is None:
            raise SpecError(f"report: {shown(str(src))} is a run folder; give --until-step K to compute its ledger")
        if args.every < 1:
            raise SpecError(f"report: --every must be >= 1, got {args.every}")
        rec.ledger = compute_ledger(src, args.until_step, args.every, args.cache)
    else:
        rec.ledger = read_ledger(src)
    read_metrics_logs(args.metrics_log or [], rec)
    page = render_html(rec, args.title or f"sluice report: {src.name}")
    out = Path(args.output)
    write_page(out, page)
    print(shown(str(out), 4096))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger_or_run", metavar="LEDGER_OR_RUN",
                   help="ledger JSON lines (sluice ledger --json --every N) or a folder with manifest.json and run.toml")
    p.add_argument("-o", "--output", required=True, metavar="HTML", help="page to write (atomically)")
    p.add_argument("--metrics-log", action="append", metavar="FILE",
                   help="JSON lines from `sluice top --record` or loaderd's stderr (repeatable)")
    p.add_argument("--until-step", type=int, default=None, metavar="K", help="run folder: compute steps 0..K")
    p.add_argument("--every", type=int, default=10, metavar="N", help="run folder: a ledger point every N steps (default 10)")
    p.add_argument("--cache", default=None, help="run folder: node cache to read objects through (default: temporary)")
    p.add_argument("--title", default=None, help="page title")
