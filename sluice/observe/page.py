"""The HTML page of `sluice report`: the run's key figures first, then tables and charts.

Hardened for input nobody checked: every string from the input is
HTML-escaped with control characters shown as escapes (`_h`); the charts are
drawn with mathtext off; the page is one file with no script, and its Content
Security Policy allows nothing but its own inline style and ``data:`` images,
so a browser fetches nothing and runs nothing. Each key figure carries a
``data-figure`` attribute (a stable name for tests and scrapers).
"""

from __future__ import annotations

import html
import math
from typing import Any

from sluice.observe import charts
from sluice.observe.record import RunRecord
from sluice.observe.scrape import shown

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:62em;padding:0 1em;color:#222}"
    "h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}"
    ".ids{color:#555;font-size:.9em}.ids code{background:#f4f4f4;padding:0 .3em;word-break:break-all}"
    ".figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(11em,1fr));gap:.6em;margin:1em 0}"
    ".figures div{border:1px solid #ddd;border-radius:6px;padding:.5em .7em}"
    ".figures dt{font-size:.8em;color:#555}.figures dd{margin:0;font-size:1.35em;font-weight:600}"
    ".figures small{display:block;color:#777;font-size:.75em}"
    "table{border-collapse:collapse;margin:.6em 0;font-size:.9em}"
    "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child,th:first-child{text-align:left}"
    "tr.pad td{color:#777;font-style:italic}img{max-width:100%}.missing{color:#a33}.note{color:#555;font-size:.9em}"
)


def _h(value: Any, limit: int = 200) -> str:
    """Any value from the input as HTML text: control characters escaped, cut, then HTML-escaped."""
    return html.escape(shown(str(value), limit))


def _int(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else "n/a"


def _num(v: Any, unit: str = "", digits: int = 3) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "n/a"
    return f"{v:,.{digits}g}{unit}" if abs(v) < 1000 else f"{v:,.0f}{unit}"


def _ms(v: Any) -> str:
    return _num(v * 1e3, " ms") if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _duration(s: Any) -> str:
    if not isinstance(s, (int, float)) or not math.isfinite(s):
        return "n/a"
    if s < 1:
        return _ms(s)
    if s < 120:
        return f"{s:.1f} s"
    h, rest = divmod(int(s), 3600)
    return f"{h} h {rest // 60:02d} min" if h else f"{rest // 60} min {rest % 60:02d} s"


def _figures(f: dict[str, Any]) -> str:
    served, trained, ettr = f["served"], f["trained"], f["ettr"]
    wait, ttb = f["input_wait"], f["time_to_batch"]
    cards = [
        ("served-tokens", "tokens served", _int(served["tokens"]),
         f"{_int(served['batches'])} micro-batches" + (f", {_int(served['padding_tokens'])} padding"
                                                       if served["padding_tokens"] else "")),
        ("trained-steps", "steps trained", _int(trained["steps"]), trained["steps_from"]),
        ("trained-tokens", "tokens trained", _int(trained["tokens"]),
         f"{_int(trained['tokens_per_step'])} a step" if trained["tokens_per_step"] else "tokens per step unknown"),
        ("duration", "duration", _duration(f["duration_s"]), f"{f['start']} to {f['end']}"),
        ("served-tokens-per-s", "tokens/s served", _num(served["tokens_per_s"]), "over the duration"),
        ("effective-tokens-per-s", "effective tokens/s", _num(trained["effective_tokens_per_s"]),
         "tokens trained / duration"),
        ("ettr", "ETTR", f"{ettr['value']:.1%}" if ettr["value"] is not None else "n/a",
         (f"down {_duration(ettr['down_s'])}, stalled {_duration(ettr['stall_s'])}, "
          f"replayed {_duration(ettr['replay_s'])}") if ettr["value"] is not None else ettr.get("why_not", "")),
        ("input-wait", "input wait", _duration(wait["seconds"]),
         f"p50 {_ms(wait['p50_s'])}, p99 {_ms(wait['p99_s'])}"),
        ("time-to-batch", "time to batch p50", _ms(ttb["p50_s"]), f"p99 {_ms(ttb['p99_s'])}"),
        ("restarts", "daemon restarts", _int(f["restarts"]), f"{_int(f['restores'])} restores"),
        ("fencing", "fencing events", _int(f["fencing"]["generation_changes"]),
         f"{_int(f['fencing']['fenced_requests'])} requests fenced"),
    ]
    return '<dl class="figures">' + "".join(
        f'<div data-figure="{key}"><dt>{label}</dt><dd>{value}</dd><small>{_h(note, 300)}</small></div>'
        for key, label, value, note in cards) + "</dl>"


def _ids(f: dict[str, Any]) -> str:
    parts = []
    for key, label in (("dataset_id", "dataset"), ("runspec_digest", "run spec"), ("run_id", "run")):
        v = f.get(key)
        if v is None:
            continue
        shown_v = " / ".join(_h(x, 100) for x in v) + " (they differ)" if isinstance(v, list) else _h(v, 100)
        parts.append(f"{label} <code>{shown_v}</code>")
    return f'<p class="ids">{" &middot; ".join(parts)}</p>' if parts else ""


def _source_table(rows: list[dict[str, Any]]) -> str:
    ledger = any("target_share" in r for r in rows)
    head = "<tr><th>source</th><th>tokens served</th>" + (
        "<th>documents drawn</th><th>tokens drawn</th><th>loss tokens drawn</th><th>epochs</th><th>target</th>"
        "<th>realized</th>" if ledger else "") + "</tr>"
    body = []
    for r in rows:
        cells = [_h(r["source"]), _int(r.get("served"))]
        if ledger:
            share = (lambda k: f"{float(r[k]):.4f}" if r.get(k) not in (None, "") else "")
            cells += [_int(r.get("docs")), _int(r.get("tokens")), _int(r.get("loss_tokens")), _h(r.get("epochs", "")),
                      share("target_share"), share("realized_share")]
        cls = ' class="pad"' if r.get("padding") else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"


def _replica_table(f: dict[str, Any]) -> str:
    served, commits = f["served"]["per_replica"], f["trained"]["committed_per_replica"]
    keys = sorted(set(served) | set(commits), key=lambda k: (len(k), k))[:64]
    if not keys:
        return '<p class="missing">no per-replica counts: record samples with `sluice top --record` and pass ' \
               "the daemons' logs</p>"
    rows = "".join(f"<tr><td>{_h(k)}</td><td>{_int(served.get(k))}</td><td>{_int(commits.get(k))}</td></tr>"
                   for k in keys)
    more = f'<p class="note">{len(set(served) | set(commits)) - 64} more replicas in the JSON record</p>' \
        if len(set(served) | set(commits)) > 64 else ""
    return f"<table><tr><th>replica</th><th>tokens served</th><th>last committed step</th></tr>{rows}</table>{more}"


def _checkpoints(f: dict[str, Any]) -> str:
    ck = f["checkpoints"]
    if not ck:
        return '<p class="note">no checkpoints given (--checkpoints DIR)</p>'
    rows = "".join(f"<tr><td>{_h(c['name'])}</td><td>{_int(c['step'])}</td><td>{_int(c['generation'])}</td>"
                   f"<td>{_int(c['data_step'])}</td></tr>" for c in ck[-20:])
    return (f"<p>{len(ck)} committed checkpoints (the last {min(20, len(ck))} below)</p><table><tr><th>checkpoint"
            f"</th><th>step</th><th>generation</th><th>data step</th></tr>{rows}</table>")


def render_html(rec: RunRecord, figures: dict[str, Any], title: str) -> str:
    """The page: key figures, identity, per source and per replica tables, then one figure per chart (or a
    note naming the missing input). See the module docstring for what is escaped and allowed."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    sections: list[str] = []

    def figure(heading: str, make: Any, missing: str | None, before: str = "") -> None:
        if missing:
            sections.append(f'<section><h2>{heading}</h2>{before}<p class="missing">{html.escape(missing)}</p>'
                            "</section>")
            return
        # A source named "$\frac{$" must be shown, not typeset (and not fail to typeset).
        with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
            png = charts.png(make())
        sections.append(f'<section><h2>{heading}</h2>{before}<img alt="{heading}" '
                        f'src="data:image/png;base64,{png}"></section>')

    led = rec.ledger
    rows = charts.source_rows(rec, figures)
    no_ledger = "no ledger: give a ledger file or a run folder" if led is None else None
    no_samples = "no metrics samples: record them with `sluice top TARGET --record FILE` and pass --metrics-log FILE"
    until = led.last["until_step"] if led is not None and led.last is not None else None
    note = ""
    if led is not None and led.last is not None:
        last = led.last
        note = (f'<p class="note">served: what the daemons sent (sluice_source_served_tokens_total); drawn: the '
                f"ledger up to step {last['until_step']} (unit {_h(last['unit'])}, policy {_h(last['policy'])}), "
                "whole documents as drawn, some never sent</p>")
        if last.get("ended"):
            note += f"<p>stream ended early: {_h(last['ended'], 2000)}</p>"
        if led.hidden:
            note += (f"<p>{len(led.names)} sources: the {len(led.shown)} of largest target share are shown one by "
                     f"one; the other {led.hidden} are summed as one entry in the table and the charts</p>")
    if figures["served"]["tokens"] and not figures["served"]["per_source"]:
        note += ('<p class="note">the daemons did not count tokens per source (a daemon before '
                 "sluice_source_served_tokens_total, or one whose producers ran as processes): the total only</p>")
    table = _source_table(rows) if rows else ""
    figure("Tokens per source", lambda: charts.tokens(rows, until), None if rows else
           "no tokens per source: pass --metrics-log with `sluice top --record` samples or give a ledger",
           note + table)
    sections.append(f"<section><h2>Per replica</h2>{_replica_table(figures)}</section>")
    figure("Throughput and input wait over time", lambda: charts.over_time(rec),
           None if any(len(d.points) > 1 for d in rec.daemons.values()) else no_samples)
    figure("Mixture over steps", lambda: charts.shares(led), no_ledger)
    figure("Input wait", lambda: charts.wait(rec.wait_last), None if rec.wait_last else no_samples)
    figure("Restores and generations", lambda: charts.timeline(rec.generations, rec.events),
           None if rec.generations or rec.events else
           "no metrics samples or daemon logs: pass --metrics-log with `sluice top --record` output or loaderd's stderr")
    sections.append(f"<section><h2>Checkpoints</h2>{_checkpoints(figures)}</section>")
    counts = (f'<p class="note">{rec.samples} metrics samples of {len(rec.daemons)} daemons, {rec.starts} daemon '
              f"starts, {rec.restores} restores in the logs</p>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_h(title)}</title><style>{_STYLE}</style></head><body><h1>{_h(title)}</h1>{_ids(figures)}"
            f"{_figures(figures)}{counts}{''.join(sections)}</body></html>\n")
