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
import html
import io
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError

_MAX_LINE = 1 << 20  # a ledger line for thousands of sources is still far below this
_MAX_POINTS = 20_000  # ledger lines per page: more would not be readable in a chart either


_MAX_DAEMONS = 1024  # metrics URLs in one report
_MAX_EVENTS = 100_000  # daemon log records kept for the timeline (starts, restores, commits)
_TIMELINE_MSGS = ("loaderd listening", "restored", "committed")


@dataclass
class RunRecord:
    """What the page draws, read from files (never from a live daemon), reduced while reading:
    a long run's metrics log is not held in memory, only the generation per sample and the
    last sample's input wait histogram."""

    ledger: list[dict[str, Any]] = field(default_factory=list)  # sorted by until_step
    # per metrics URL (one daemon each): (wall seconds, generation) of every sample, and the
    # input wait histogram (le, cumulative count) of its last sample
    generations: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    wait_last: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # daemon log records of _TIMELINE_MSGS
    samples: int = 0
    restores: int = 0
    starts: int = 0


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of a JSON-lines file; ObserveError naming file and line otherwise.

    Only regular files are read (a FIFO or a device would never end), one
    bounded line at a time."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ObserveError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ObserveError(f"{path}: not a regular file")
    try:
        f = path.open("rb")
    except OSError as exc:
        raise ObserveError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with f:
        n = 0
        while raw := f.readline(_MAX_LINE + 1):
            n += 1
            if len(raw) > _MAX_LINE:
                raise ObserveError(f"{path}, line {n}: longer than {_MAX_LINE} bytes")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ObserveError(f"{path}, line {n}: not UTF-8") from exc
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge integers, deep nesting
                raise ObserveError(f"{path}, line {n}: not JSON ({str(exc)[:120]})") from exc
            if not isinstance(obj, dict):
                raise ObserveError(f"{path}, line {n}: expected a JSON object")
            yield n, obj


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """Ledger lines (`sluice ledger --json`), checked and sorted by step; at most _MAX_POINTS of them."""
    rows = []
    names: list[str] | None = None
    for n, obj in _json_lines(path):
        where = f"{path}, line {n}"
        if not _is_ledger(obj):
            raise ObserveError(f"{where}: not a ledger line (expected until_step, unit, policy and sources with "
                               "source, docs, tokens, loss_tokens, target_share, realized_share, as printed by "
                               "`sluice ledger --json`)")
        these = [s["source"] for s in obj["sources"]]
        if names is None:
            names = these
        elif these != names:
            raise ObserveError(f"{where}: sources {these} differ from the first line's {names}; one run per file")
        if len(rows) >= _MAX_POINTS:
            raise ObserveError(f"{where}: more than {_MAX_POINTS} ledger lines; print them with a larger --every")
        rows.append(obj)
    if not rows:
        raise ObserveError(f"{path}: no ledger lines")
    return sorted(rows, key=lambda r: r["until_step"])


def _is_ledger(obj: dict[str, Any]) -> bool:
    def num(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def share(v: Any) -> bool:
        try:
            return isinstance(v, str) and 0.0 <= float(v) <= 1.0
        except ValueError:
            return False

    srcs = obj.get("sources")
    return (num(obj.get("until_step")) and isinstance(obj.get("unit"), str) and isinstance(obj.get("policy"), str)
            and isinstance(srcs, list) and bool(srcs) and all(
                isinstance(s, dict) and isinstance(s.get("source"), str)
                and all(num(s.get(k)) for k in ("docs", "tokens", "loss_tokens"))
                and share(s.get("target_share")) and share(s.get("realized_share")) for s in srcs))


def compute_ledger(run_dir: Path, until_step: int, every: int, cache: str | None) -> list[dict[str, Any]]:
    """The ledger every `every` steps up to `until_step`, from run_dir/manifest.json and run_dir/run.toml."""
    from sluice.errors import EndOfStream
    from sluice.loaderd.plan_cli import DEFAULT_CACHE_BUDGET, ledger_obj, open_plan

    for name in ("manifest.json", "run.toml"):
        if not (run_dir / name).is_file():
            raise ObserveError(f"run folder {run_dir}: no {name} (a run folder holds manifest.json and run.toml)")
    ns = argparse.Namespace(manifest=str(run_dir / "manifest.json"), run=str(run_dir / "run.toml"), cache=cache,
                            cache_budget=DEFAULT_CACHE_BUDGET)
    out = []
    with open_plan(ns) as (plan, docs):
        state = plan.initial_state()
        try:
            while state.step < until_step:
                _, state = plan.step(state, docs)
                if (state.step + 1) % every == 0 or state.step == until_step:
                    out.append(ledger_obj(plan, state))
        except EndOfStream as exc:
            out.append(ledger_obj(plan, state, str(exc)))
    return out


def read_metrics_logs(paths: list[str], rec: RunRecord) -> None:
    """Add `sluice top --record` samples and loaderd log lines from JSON-lines files to `rec`."""
    for p in paths:
        for n, obj in _json_lines(Path(p)):
            if obj.get("kind") == "sluice.metrics-sample" and isinstance(obj.get("series"), list):
                try:
                    series = [(str(name), dict(lab), float(v)) for name, lab, v in obj["series"]]
                    wall = float(obj["wall"])
                except (TypeError, ValueError, KeyError) as exc:
                    raise ObserveError(f"{p}, line {n}: a metrics sample with a malformed series ({exc})") from exc
                rec.samples += 1
                url = str(obj.get("url", ""))
                if url not in rec.generations and len(rec.generations) >= _MAX_DAEMONS:
                    raise ObserveError(f"{p}, line {n}: samples of more than {_MAX_DAEMONS} daemons")
                rec.generations.setdefault(url, []).append(
                    (wall, sum(v for name, _, v in series if name == "sluice_generation")))
                buckets = _wait_buckets(series)
                if buckets:
                    rec.wait_last[url] = buckets
            elif isinstance(obj.get("msg"), str) and isinstance(obj.get("ts"), str):
                if obj["msg"] not in _TIMELINE_MSGS:
                    continue
                rec.restores += obj["msg"] == "restored"
                rec.starts += obj["msg"] == "loaderd listening"
                if len(rec.events) < _MAX_EVENTS:
                    rec.events.append(obj)
            else:
                raise ObserveError(f"{p}, line {n}: neither a `sluice top --record` sample nor a loaderd log line")
    for points in rec.generations.values():
        points.sort()
    rec.events.sort(key=lambda e: e["ts"])


def _wait_buckets(series: list[tuple[str, dict[str, Any], float]]) -> list[tuple[float, float]]:
    cum: dict[float, float] = {}
    for name, lab, v in series:
        if name == "sluice_client_input_wait_seconds_bucket":
            try:
                le = float(lab["le"])
            except (KeyError, TypeError, ValueError):
                continue
            cum[le] = cum.get(le, 0.0) + v
    return sorted(cum.items())


# -- charts ------------------------------------------------------------------------
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _shares(ledger: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    steps = [row["until_step"] for row in ledger]
    for i, src in enumerate(ledger[-1]["sources"]):
        name = src["source"]
        real = [float(next(s["realized_share"] for s in row["sources"] if s["source"] == name)) for row in ledger]
        line, = ax.plot(steps, real, marker="o" if len(steps) < 40 else None, label=f"{name} realized")
        ax.axhline(float(src["target_share"]), color=line.get_color(), linestyle="--", linewidth=1,
                   label=f"{name} target")
    ax.set_xlabel("step")
    ax.set_ylabel(f"share of {ledger[-1]['unit']}")
    ax.set_title("realized vs target mixture")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def _tokens(ledger: list[dict[str, Any]]) -> Any:
    import matplotlib.pyplot as plt

    last = ledger[-1]["sources"]
    fig, ax = plt.subplots(figsize=(8, 3))
    names = [s["source"] for s in last]
    ax.bar(names, [s["tokens"] for s in last], color="#4c72b0", label="tokens")
    ax.bar(names, [s["loss_tokens"] for s in last], color="#dd8452", width=0.4, label="loss tokens")
    ax.set_ylabel("tokens")
    ax.set_title(f"tokens per source up to step {ledger[-1]['until_step']}")
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


def _timeline(generations: dict[str, list[tuple[float, float]]], events: list[dict[str, Any]]) -> Any:
    import datetime as dt

    import matplotlib.pyplot as plt

    def when(ts: str) -> dt.datetime | None:
        try:
            return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ")
        except ValueError:
            return None

    fig, ax = plt.subplots(figsize=(8, 3))
    for url, points in sorted(generations.items()):
        xs = [dt.datetime.fromtimestamp(w, dt.timezone.utc).replace(tzinfo=None) for w, _ in points]
        where = url.removeprefix("http://").removesuffix("/metrics")
        ax.step(xs, [g for _, g in points], where="post", label=f"generation ({where})")
    marks = {"loaderd listening": ("daemon start", "|", "#c44e52"), "restored": ("restore", "o", "#8172b2"),
             "committed": ("commit", ".", "#937860")}
    for msg, (label, marker, color) in marks.items():
        evs = [(when(e["ts"]), e.get("generation")) for e in events if e["msg"] == msg]
        evs = [(t, g if isinstance(g, (int, float)) else 0) for t, g in evs if t is not None]
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
def _table(ledger: list[dict[str, Any]]) -> str:
    head = "<tr><th>source</th><th>documents</th><th>tokens</th><th>loss tokens</th><th>epochs</th>" \
           "<th>target</th><th>realized</th></tr>"
    rows = "".join(
        f"<tr><td>{html.escape(s['source'])}</td><td>{s['docs']}</td><td>{s['tokens']}</td><td>{s['loss_tokens']}</td>"
        f"<td>{s.get('epochs', '')}</td><td>{float(s['target_share']):.4f}</td>"
        f"<td>{float(s['realized_share']):.4f}</td></tr>" for s in ledger[-1]["sources"])
    return f"<table>{head}{rows}</table>"


def render_html(rec: RunRecord, title: str) -> str:
    """The page: a summary table and one figure per chart (or a note naming the missing input)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    sections = []

    def figure(name: str, make: Any, missing: str | None) -> None:
        if missing:
            sections.append(f'<section><h2>{name}</h2><p class="missing">{html.escape(missing)}</p></section>')
        else:
            sections.append(f'<section><h2>{name}</h2><img alt="{name}" src="data:image/png;base64,{_png(make())}">'
                            "</section>")

    last = rec.ledger[-1] if rec.ledger else None
    no_ledger = "no ledger: give a ledger file or a run folder" if not rec.ledger else None
    no_samples = "no metrics samples: record them with `sluice top TARGET --record FILE` and pass --metrics-log FILE"
    figure("Mixture over steps", lambda: _shares(rec.ledger), no_ledger)
    figure("Tokens per source", lambda: _tokens(rec.ledger), no_ledger)
    figure("Input wait", lambda: _wait(rec.wait_last), None if rec.wait_last else no_samples)
    figure("Restores and generations", lambda: _timeline(rec.generations, rec.events),
           None if rec.generations or rec.events else
           "no metrics samples or daemon logs: pass --metrics-log with `sluice top --record` output or loaderd's stderr")
    summary = ""
    if last is not None:
        ended = f"<p>stream ended early: {html.escape(str(last['ended']))}</p>" if last.get("ended") else ""
        summary = (f"<p>ledger up to step {last['until_step']}, unit {html.escape(last['unit'])}, "
                   f"policy {html.escape(last['policy'])}</p>{ended}{_table(rec.ledger)}")
    counts = f"<p>{rec.samples} metrics samples, {rec.starts} daemon starts, {rec.restores} restores in the logs</p>"
    style = ("body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child{text-align:left}"
             "img{max-width:100%}.missing{color:#a33}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{summary}{counts}"
            f"{''.join(sections)}</body></html>\n")


def run_report(args: argparse.Namespace) -> int:
    """Read the inputs, render, write the page atomically; prints its path."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ObserveError("sluice report needs matplotlib: pip install 'sluice[report]'") from exc
    src = Path(args.ledger_or_run)
    rec = RunRecord()
    if src.is_dir():
        if args.until_step is None:
            raise SpecError(f"report: {src} is a run folder; give --until-step K to compute its ledger")
        if args.every < 1:
            raise SpecError(f"report: --every must be >= 1, got {args.every}")
        rec.ledger = compute_ledger(src, args.until_step, args.every, args.cache)
    else:
        rec.ledger = read_ledger(src)
    read_metrics_logs(args.metrics_log or [], rec)
    page = render_html(rec, args.title or f"sluice report: {src.name}")
    out = Path(args.output)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    print(out)
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
