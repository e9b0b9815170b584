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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError

_MAX_LINE = 1 << 20  # a ledger line for thousands of sources is still far below this


@dataclass
class RunRecord:
    """Everything the page draws, read from files (never from a live daemon)."""

    ledger: list[dict[str, Any]] = field(default_factory=list)  # sorted by until_step
    samples: list[dict[str, Any]] = field(default_factory=list)  # sluice.metrics-sample records
    events: list[dict[str, Any]] = field(default_factory=list)  # daemon log records


def _json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        f = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise ObserveError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    out = []
    n = 0
    with f:
        while True:
            n += 1
            try:
                line = f.readline(_MAX_LINE + 1)  # bounded: a newline-free file is not read whole
            except UnicodeDecodeError as exc:
                raise ObserveError(f"{path}, line {n}: not UTF-8 ({exc.reason})") from exc
            if not line:
                break
            if len(line) > _MAX_LINE:
                raise ObserveError(f"{path}, line {n}: longer than {_MAX_LINE} bytes")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ObserveError(f"{path}, line {n}: not JSON ({exc.msg})") from exc
            except RecursionError as exc:
                raise ObserveError(f"{path}, line {n}: JSON nested too deeply") from exc
            except ValueError as exc:  # an integer beyond Python's 4300-digit conversion limit
                raise ObserveError(f"{path}, line {n}: not usable JSON ({str(exc)[:200]})") from exc
            if not isinstance(obj, dict):
                raise ObserveError(f"{path}, line {n}: expected a JSON object")
            out.append((n, obj))
    return out


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """Ledger lines (`sluice ledger --json`), checked and sorted by step."""
    rows = []
    for n, obj in _json_lines(path):
        if not isinstance(obj.get("until_step"), int) or not isinstance(obj.get("sources"), list):
            raise ObserveError(f"{path}, line {n}: not a ledger line (expected until_step and sources, "
                               "as printed by `sluice ledger --json`)")
        rows.append(obj)
    if not rows:
        raise ObserveError(f"{path}: no ledger lines")
    return sorted(rows, key=lambda r: r["until_step"])


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


def read_metrics_logs(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(top samples, daemon log records) from JSON-lines files of either kind."""
    samples, events = [], []
    for p in paths:
        for n, obj in _json_lines(Path(p)):
            if obj.get("kind") == "sluice.metrics-sample" and isinstance(obj.get("series"), list):
                samples.append(obj)
            elif isinstance(obj.get("msg"), str) and isinstance(obj.get("ts"), str):
                events.append(obj)
            else:
                raise ObserveError(f"{p}, line {n}: neither a `sluice top --record` sample nor a loaderd log line")
    samples.sort(key=lambda s: s.get("wall", 0.0))
    events.sort(key=lambda e: e["ts"])
    return samples, events


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


def _series(sample: dict[str, Any], name: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, float(v)) for n, lab, v in sample["series"] if n == name]


def _wait(samples: list[dict[str, Any]]) -> Any:
    """Per-bucket counts of the last sample's input wait histogram (cumulative since daemon start)."""
    import matplotlib.pyplot as plt

    cum: dict[float, float] = {}
    for lab, v in _series(samples[-1], "sluice_client_input_wait_seconds_bucket"):
        le = float(lab["le"])
        cum[le] = cum.get(le, 0.0) + v
    les = sorted(cum)
    counts = [cum[le] - (cum[les[i - 1]] if i else 0.0) for i, le in enumerate(les)]
    fig, ax = plt.subplots(figsize=(8, 3))
    labels = [("<= " + (f"{le * 1e3:g}ms" if le < 1 else f"{le:g}s")) if le != float("inf") else "more" for le in les]
    ax.bar(range(len(les)), counts, color="#55a868")
    ax.set_xticks(range(len(les)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("micro-batches")
    ax.set_title("client input wait (time a rank waited for its next micro-batch)")
    return fig


def _timeline(samples: list[dict[str, Any]], events: list[dict[str, Any]]) -> Any:
    import datetime as dt

    import matplotlib.pyplot as plt

    def when(ts: str) -> dt.datetime:
        return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ")

    fig, ax = plt.subplots(figsize=(8, 3))
    if samples:
        xs = [dt.datetime.fromtimestamp(s["wall"], dt.timezone.utc).replace(tzinfo=None) for s in samples]
        gens = [sum(v for _, v in _series(s, "sluice_generation")) for s in samples]
        ax.step(xs, gens, where="post", label="generation (metrics)")
    marks = {"loaderd listening": ("daemon start", "|", "#c44e52"), "restored": ("restore", "o", "#8172b2"),
             "committed": ("commit", ".", "#937860")}
    for msg, (label, marker, color) in marks.items():
        evs = [e for e in events if e["msg"] == msg]
        if evs:
            ax.plot([when(e["ts"]) for e in evs], [e.get("generation") or 0 for e in evs], linestyle="none",
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
    has_wait = rec.samples and _series(rec.samples[-1], "sluice_client_input_wait_seconds_bucket")
    figure("Input wait", lambda: _wait(rec.samples), None if has_wait else no_samples)
    figure("Restores and generations", lambda: _timeline(rec.samples, rec.events),
           None if rec.samples or rec.events else
           "no metrics samples or daemon logs: pass --metrics-log with `sluice top --record` output or loaderd's stderr")
    summary = ""
    if last is not None:
        ended = f"<p>stream ended early: {html.escape(str(last['ended']))}</p>" if last.get("ended") else ""
        summary = (f"<p>ledger up to step {last['until_step']}, unit {html.escape(last['unit'])}, "
                   f"policy {html.escape(last['policy'])}</p>{ended}{_table(rec.ledger)}")
    restores = sum(1 for e in rec.events if e["msg"] == "restored")
    starts = sum(1 for e in rec.events if e["msg"] == "loaderd listening")
    counts = f"<p>{len(rec.samples)} metrics samples, {starts} daemon starts, {restores} restores in the logs</p>"
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
    rec.samples, rec.events = read_metrics_logs(args.metrics_log or [])
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
