"""The charts of `sluice report`'s page (matplotlib, drawn with mathtext off: report.py's `figure`), and the
per-source rows its table and token chart show.

Every string from the input goes through `name` (control characters escaped,
cut). Tokens per source are horizontal bars, served (the daemons) and drawn (the
ledger) side by side for each source, so neither hides the other.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from sluice.observe.record import SHOWN_SOURCES, Ledger, RunRecord
from sluice.observe.scrape import shown
from sluice.observe.totals import rates


def source_rows(rec: RunRecord, figures: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per shown source: name, served tokens (None: not counted), and the ledger's drawn documents,
    tokens, loss tokens, target and realized share (None without a ledger); then "other (N sources)" for
    the rest and "padding" for the served tokens no source holds. Sources are the ledger's shown ones
    (largest target share first) or, without a ledger, the SHOWN_SOURCES of most served tokens."""
    served: dict[str, int] = figures["served"]["per_source"]
    led = rec.ledger
    rows: list[dict[str, Any]] = []
    if led is not None and led.last is not None:
        names = [led.names[i] for i in led.shown]
        for r, n in zip(led.last["rows"], names + [None] * (len(led.last["rows"]) - len(names))):
            rows.append({"source": r["source"], "served": served.get(n) if n is not None else None, **{
                k: r.get(k) for k in ("docs", "tokens", "loss_tokens", "epochs", "target_share", "realized_share")}})
        if led.hidden and served:
            rows[-1]["served"] = sum(v for k, v in served.items() if k not in set(names))
    else:
        ranked = sorted(served.items(), key=lambda kv: -kv[1])
        rows = [{"source": k, "served": v} for k, v in ranked[:SHOWN_SOURCES]]
        if len(ranked) > SHOWN_SOURCES:
            rows.append({"source": f"other ({len(ranked) - SHOWN_SOURCES} sources)",
                         "served": sum(v for _, v in ranked[SHOWN_SOURCES:])})
    pad = figures["served"]["padding_tokens"]
    if pad:
        rows.append({"source": "padding", "served": pad, "padding": True})
    return rows


def png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def name(text: str, limit: int = 40) -> str:
    """Text from the input as a chart shows it: control characters escaped, cut to `limit`
    (charts are drawn with parse_math off, so `$...$` is shown, not typeset)."""
    return shown(text, limit)


def _series_names(led: Ledger) -> list[str]:
    names = [name(led.names[i]) for i in led.shown]
    return names + ([f"other ({led.hidden} sources)"] if led.hidden else [])


def shares(led: Ledger) -> Any:
    import matplotlib.pyplot as plt

    assert led.last is not None  # render_html draws this chart only with a ledger
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # 13 lines: the default cycle repeats after 10
    steps = [step for step, _ in led.points]
    targets = [float(r["target_share"]) for r in led.last["rows"]]
    for k, series in enumerate(_series_names(led)):
        line, = ax.plot(steps, [real[k] for _, real in led.points], marker="o" if len(steps) < 40 else None,
                        label=f"{series} realized")
        ax.axhline(targets[k], color=line.get_color(), linestyle="--", linewidth=1, label=f"{series} target")
    ax.set_xlabel("step")
    ax.set_ylabel(f"share of {name(led.last['unit'])}")
    ax.set_title("realized vs target mixture")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def wait(last: dict[str, list[tuple[float, float]]]) -> Any:
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


def timeline(generations: dict[str, list[tuple[float, float]]], events: list[tuple[str, str, float]]) -> Any:
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
        where = name(url.removeprefix("http://").removesuffix("/metrics"), 60)
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


def tokens(rows: list[dict[str, Any]], until: Any) -> Any:
    """Tokens per source: served and drawn as side-by-side horizontal bars, each labelled with its value."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.42 * len(rows)))
    ys = range(len(rows))
    bars = [("served (daemons)", "served", "#4c72b0", -0.2), ("drawn (ledger)", "tokens", "#dd8452", 0.2)]
    for label, key, color, dy in bars:
        vals = [float(r[key]) if r.get(key) is not None else 0.0 for r in rows]
        if any(r.get(key) is not None for r in rows):
            got = ax.barh([y + dy for y in ys], vals, height=0.38, color=color, label=label)
            ax.bar_label(got, labels=[f"{v:,.0f}" if r.get(key) is not None else "" for v, r in zip(vals, rows)],
                         fontsize=7, padding=2)
    ax.set_yticks(list(ys), [name(str(r["source"])) for r in rows], fontsize=8)
    ax.invert_yaxis()  # the first source on top, as in the table
    ax.margins(x=0.18)  # room for the value labels
    ax.set_xlabel("tokens")
    ax.set_title("tokens per source" + (f" (ledger up to step {until})" if until is not None else ""))
    ax.legend(fontsize=8, loc="lower right")
    return fig


def over_time(rec: RunRecord) -> Any:
    """Tokens/s served and the mean input wait per micro-batch between samples, one line per daemon."""
    import datetime as dt

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    for k, (url, d) in enumerate(sorted(rec.daemons.items())):
        got = rates(d.points)
        if not got:
            continue
        xs = [dt.datetime.fromtimestamp(w, dt.timezone.utc).replace(tzinfo=None) for w, _, _ in got]
        where = name(url.removeprefix("http://").removesuffix("/metrics"), 60)
        label = where if k < SHOWN_SOURCES else None
        top.plot(xs, [r for _, r, _ in got], label=label, linewidth=1)
        waits = [(x, w * 1e3) for x, (_, _, w) in zip(xs, got) if w is not None]
        bottom.plot([x for x, _ in waits], [w for _, w in waits], linewidth=1)
    top.set_ylabel("tokens/s served")
    top.set_title("throughput and input wait over time")
    top.grid(alpha=0.3)
    if len(rec.daemons) <= SHOWN_SOURCES:
        top.legend(fontsize=7)
    bottom.set_ylabel("mean input wait (ms)")
    bottom.grid(alpha=0.3)
    bottom.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    bottom.set_xlabel("time (UTC)")
    fig.autofmt_xdate()
    return fig
