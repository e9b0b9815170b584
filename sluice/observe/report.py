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
import json
import math
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError
from sluice.observe.scrape import shown

_MAX_LINE = 16 << 20  # one ledger line: about 130 bytes a source, so 100,000 sources fit
_MAX_LEDGER_BYTES = 256 << 20  # a whole ledger file: reading it stays within seconds
_MAX_POINTS = 20_000  # ledger lines per page: more would not be readable in a chart either
_MAX_SOURCES = 100_000  # sources in one ledger line
_MAX_COUNT = (1 << 63) - 1  # documents, tokens, steps, epochs: what a run can count, and what a chart can draw
_SHOWN_SOURCES = 12  # drawn and listed one by one; the rest are summed as one "other" entry


_MAX_DAEMONS = 1024  # metrics URLs in one report
_MAX_EVENTS = 100_000  # daemon log records kept for the timeline (starts, restores, commits)
_MAX_KEPT_SAMPLES = 200_000  # (wall, generation) points kept after dropping those that change nothing
_MAX_BUCKETS = 1000  # distinct le bounds of one input wait histogram (the daemon exports 17 with +Inf)
_MAX_URL = 1000  # characters of a sample's url kept (the key of its daemon)
_MAX_WALL = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a chart's time axis can show
_TIMELINE_MSGS = ("loaderd listening", "restored", "committed")


@dataclass
class Ledger:
    """A ledger series reduced, while it is read, to what the page shows; memory does not grow
    with the number of sources times the number of lines.

    The sources are ranked once, by the first line's target shares (largest
    first, then in the ledger's order; target shares are the mixture's
    weights, the same on every line). The first _SHOWN_SOURCES are drawn and
    listed one by one; the others are summed into one "other" entry, and the
    page says so. `points` hold (until_step, realized share of each shown
    source, then of the others together); `last` is the line with the
    largest until_step, its sources reduced the same way (`rows`)."""

    names: list[str] = field(default_factory=list)  # every source, in the ledger's order
    shown: list[int] = field(default_factory=list)  # indices into names, largest target share first
    points: list[tuple[int, list[float]]] = field(default_factory=list)
    last: dict[str, Any] | None = None

    @property
    def hidden(self) -> int:
        """How many sources are summed into the "other" entry."""
        return len(self.names) - len(self.shown)

    def add(self, obj: dict[str, Any], where: str) -> None:
        """Check one ledger line (ObserveError naming `where` and the field) and fold it in."""
        _check_ledger_line(obj, where)
        srcs = obj["sources"]
        if not self.names:
            self.names = [s["source"] for s in srcs]
            ranked = sorted(range(len(srcs)), key=lambda i: -float(srcs[i]["target_share"]))
            self.shown = ranked[:_SHOWN_SOURCES]
        elif len(srcs) != len(self.names) or any(s["source"] != n for s, n in zip(srcs, self.names)):
            raise ObserveError(f"{where}: its {len(srcs)} sources differ from the first line's {len(self.names)} "
                               f"({shown(str([s['source'] for s in srcs][:5]), 200)}...); one run per file")
        if len(self.points) >= _MAX_POINTS:
            raise ObserveError(f"{where}: more than {_MAX_POINTS} ledger lines; print them with a larger --every")
        realized = [float(srcs[i]["realized_share"]) for i in self.shown]
        if self.hidden:
            realized.append(max(0.0, sum(float(s["realized_share"]) for s in srcs) - sum(realized)))
        self.points.append((obj["until_step"], realized))
        if self.last is None or obj["until_step"] >= self.last["until_step"]:
            self.last = {"until_step": obj["until_step"], "unit": obj["unit"], "policy": obj["policy"],
                         "ended": obj.get("ended"), "rows": self._rows(srcs)}

    def _rows(self, srcs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = [srcs[i] for i in self.shown]
        if self.hidden:
            picked = set(self.shown)
            rest = [s for i, s in enumerate(srcs) if i not in picked]
            rows.append({"source": f"other ({len(rest)} sources)",
                         **{k: sum(s[k] for s in rest) for k in ("docs", "tokens", "loss_tokens")},
                         "epochs": "", "target_share": str(sum(float(s["target_share"]) for s in rest)),
                         "realized_share": str(sum(float(s["realized_share"]) for s in rest))})
        return rows

    def finish(self) -> None:
        self.points.sort(key=lambda p: p[0])


@dataclass
class RunRecord:
    """What the page draws, read from files (never from a live daemon), reduced while reading:
    a long run's metrics log is not held in memory, only the generation per sample where it
    changes and the last sample's input wait histogram."""

    ledger: Ledger | None = None
    # per metrics URL (one daemon each): (wall seconds, generation) of the samples where the
    # generation changes (and the last), and the input wait histogram (le, cumulative count)
    # of its last sample
    generations: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    wait_last: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    events: list[tuple[str, str, float]] = field(default_factory=list)  # (ts, msg, generation) of _TIMELINE_MSGS
    samples: int = 0
    restores: int = 0
    starts: int = 0
    kept: int = 0  # points in `generations`


def _json_lines(path: Path, max_bytes: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of a JSON-lines file; ObserveError naming file and line otherwise.

    Only regular files are read (a FIFO or a device would never end), one
    bounded line at a time, at most `max_bytes` in all when given."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:
        raise ObserveError(f"{shown(str(path))}: cannot read ({getattr(exc, 'strerror', None) or exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ObserveError(f"{shown(str(path))}: not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ObserveError(f"{shown(str(path))}: {st.st_size} bytes, more than the {max_bytes >> 20} MiB a report "
                           "reads; print the ledger with a larger --every")
    try:
        f = path.open("rb")
    except OSError as exc:
        raise ObserveError(f"{shown(str(path))}: cannot read ({exc.strerror or exc})") from exc
    with f:
        n = 0
        while raw := f.readline(_MAX_LINE + 1):
            n += 1
            if len(raw) > _MAX_LINE:
                raise ObserveError(f"{shown(str(path))}, line {n}: longer than {_MAX_LINE} bytes")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ObserveError(f"{shown(str(path))}, line {n}: not UTF-8") from exc
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge integers, deep nesting
                raise ObserveError(f"{shown(str(path))}, line {n}: not JSON ({shown(str(exc), 120)})") from exc
            if not isinstance(obj, dict):
                raise ObserveError(f"{shown(str(path))}, line {n}: expected a JSON object")
            yield n, obj


def read_ledger(path: Path) -> Ledger:
    """Ledger lines (`sluice ledger --json`), checked and reduced (`Ledger`); at most _MAX_POINTS of them."""
    led = Ledger()
    for n, obj in _json_lines(path, _MAX_LEDGER_BYTES):
        led.add(obj, f"{shown(str(path))}, line {n}")
    if not led.points:
        raise ObserveError(f"{shown(str(path))}: no ledger lines")
    led.finish()
    return led


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_COUNT


def _is_share(v: Any) -> bool:
    try:
        return isinstance(v, str) and len(v) <= 64 and 0.0 <= float(v) <= 1.0  # NaN fails both
    except ValueError:
        return False


def _check_ledger_line(obj: dict[str, Any], where: str) -> None:
    """ObserveError naming `where` and the first field that is not what `sluice ledger --json` prints."""
    def bad(what: str, value: Any, expected: str) -> ObserveError:
        return ObserveError(f"{where}: not a ledger line: {what} is {shown(repr(value), 60)}, expected {expected} "
                            "(a line of `sluice ledger --json`: until_step, unit, policy and sources with source, "
                            "docs, tokens, loss_tokens, target_share, realized_share)")

    counted = "a count 0..2^63-1"
    if not _is_count(obj.get("until_step")):
        raise bad("until_step", obj.get("until_step"), counted)
    for key in ("unit", "policy"):
        if not isinstance(obj.get(key), str):
            raise bad(key, obj.get(key), "a string")
    if not isinstance(obj.get("ended"), (str, type(None))):
        raise bad("ended", obj.get("ended"), "a string or null")
    srcs = obj.get("sources")
    if not isinstance(srcs, list) or not srcs or len(srcs) > _MAX_SOURCES:
        raise bad("sources", type(srcs).__name__ if not isinstance(srcs, list) else f"{len(srcs)} entries",
                  f"a list of 1..{_MAX_SOURCES} sources")
    for i, s in enumerate(srcs):
        if not isinstance(s, dict) or not isinstance(s.get("source"), str):
            raise bad(f"sources[{i}]", s, "an object with a source name")
        for key in ("docs", "tokens", "loss_tokens"):
            if not _is_count(s.get(key)):
                raise bad(f"sources[{i}].{key}", s.get(key), counted)
        if "epochs" in s and s["epochs"] is not None and not _is_count(s["epochs"]):
            raise bad(f"sources[{i}].epochs", s["epochs"], counted)
        for key in ("target_share", "realized_share"):
            if not _is_share(s.get(key)):
                raise bad(f"sources[{i}].{key}", s.get(key), "a decimal string 0..1")


def compute_ledger(run_dir: Path, until_step: int, every: int, cache: str | None) -> Ledger:
    """The ledger every `every` steps up to `until_step`, from run_dir/manifest.json and run_dir/run.toml,
    reduced as it is computed (`Ledger`); at most _MAX_POINTS points, refused before any step otherwise."""
    from sluice.errors import EndOfStream
    from sluice.loaderd.plan_cli import DEFAULT_CACHE_BUDGET, ledger_obj, open_plan

    if not 0 <= until_step <= _MAX_COUNT:
        raise SpecError(f"report: --until-step must be in [0, 2^63-1], got {until_step}")
    if until_step // every + 1 > _MAX_POINTS:
        raise SpecError(f"report: --until-step {until_step} --every {every} makes {until_step // every + 1} ledger "
                        f"points, more than {_MAX_POINTS}; give a larger --every")
    for name in ("manifest.json", "run.toml"):
        if not (run_dir / name).is_file():
            raise ObserveError(f"run folder {shown(str(run_dir))}: no {name} (a run folder holds manifest.json and "
                               "run.toml)")
    ns = argparse.Namespace(manifest=str(run_dir / "manifest.json"), run=str(run_dir / "run.toml"), cache=cache,
                            cache_budget=DEFAULT_CACHE_BUDGET)
    led = Ledger()
    with open_plan(ns) as (plan, docs):
        state = plan.initial_state()
        try:
            while state.step < until_step:
                _, state = plan.step(state, docs)
                if (state.step + 1) % every == 0 or state.step == until_step:
                    led.add(ledger_obj(plan, state), f"run folder {shown(str(run_dir))}, step {state.step}")
        except EndOfStream as exc:
            led.add(ledger_obj(plan, state, str(exc)), f"run folder {shown(str(run_dir))}, step {state.step}")
    led.finish()
    return led


def _finite(v: Any, where: str, what: str, bound: float = float(_MAX_COUNT),
            expected: str = "a finite number within +-2^63") -> float:
    """`v` as a float if it is a number within +-`bound`; ObserveError naming `where`, `what` and `expected`."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        f = math.nan
    if isinstance(v, bool) or not -bound <= f <= bound:  # NaN fails both comparisons
        raise ObserveError(f"{where}: {what} is {shown(repr(v), 60)}; expected {expected}")
    return f


def read_metrics_logs(paths: list[str], rec: RunRecord) -> None:
    """Add `sluice top --record` samples and loaderd log lines from JSON-lines files to `rec`.

    What a chart draws is checked (ObserveError naming file and line): a
    sample's `wall` is a time within years 1970..9999, the generation and
    the input wait histogram are finite numbers, each bucket has a numeric
    `le`; a log line's generation is a number."""
    for p in paths:
        for n, obj in _json_lines(Path(p)):
            where = f"{shown(p)}, line {n}"
            if obj.get("kind") == "sluice.metrics-sample" and isinstance(obj.get("series"), list):
                try:
                    series = [(str(name), dict(lab), v) for name, lab, v in obj["series"]]
                except (TypeError, ValueError) as exc:
                    raise ObserveError(f"{where}: a metrics sample with a malformed series "
                                       f"({shown(str(exc))})") from exc
                wall = _finite(obj.get("wall"), where, "the sample's wall time", _MAX_WALL,
                               "seconds since 1970 up to the year 9999")
                if wall < 0:
                    raise ObserveError(f"{where}: the sample's wall time {wall:g} is before 1970")
                rec.samples += 1
                url = str(obj.get("url", ""))[:_MAX_URL]
                if url not in rec.generations and len(rec.generations) >= _MAX_DAEMONS:
                    raise ObserveError(f"{where}: samples of more than {_MAX_DAEMONS} daemons")
                gen = sum(_finite(v, where, "sluice_generation")
                          for name, _, v in series if name == "sluice_generation")
                _keep_generation(rec, url, wall, gen, where)
                buckets = _wait_buckets(series, where)
                if buckets:
                    rec.wait_last[url] = buckets
            elif isinstance(obj.get("msg"), str) and isinstance(obj.get("ts"), str):
                if obj["msg"] not in _TIMELINE_MSGS:
                    continue
                rec.restores += obj["msg"] == "restored"
                rec.starts += obj["msg"] == "loaderd listening"
                g = obj.get("generation")
                gen = _finite(g, where, "generation") if g is not None else 0.0
                if len(rec.events) < _MAX_EVENTS:
                    rec.events.append((obj["ts"][:64], obj["msg"], gen))  # only what the timeline draws
            else:
                raise ObserveError(f"{where}: neither a `sluice top --record` sample nor a loaderd log line")
    for url, points in rec.generations.items():
        points.sort()
        rec.generations[url] = _changes(points)
    rec.events.sort()


def _keep_generation(rec: RunRecord, url: str, wall: float, gen: float, where: str) -> None:
    """Append (wall, gen), dropping the previous point when it changed nothing (same generation
    on both sides, in time order): a long run's samples cost memory per restart, not per sample."""
    points = rec.generations.setdefault(url, [])
    if len(points) >= 2 and points[-2][1] == points[-1][1] == gen and points[-2][0] <= points[-1][0] <= wall:
        points[-1] = (wall, gen)
        return
    if rec.kept >= _MAX_KEPT_SAMPLES:
        raise ObserveError(f"{where}: more than {_MAX_KEPT_SAMPLES} samples that change the generation or are "
                           "out of time order; pass fewer or shorter --metrics-log files")
    points.append((wall, gen))
    rec.kept += 1


def _changes(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted (wall, generation) points without those whose neighbours on both sides have the same generation."""
    return [p for i, p in enumerate(points)
            if i in (0, len(points) - 1) or not points[i - 1][1] == p[1] == points[i + 1][1]]


def _wait_buckets(series: list[tuple[str, dict[str, Any], Any]], where: str) -> list[tuple[float, float]]:
    cum: dict[float, float] = {}
    for name, lab, v in series:
        if name == "sluice_client_input_wait_seconds_bucket":
            le = lab.get("le")
            try:
                bound = float(le) if isinstance(le, str) else math.nan
            except ValueError:
                bound = math.nan
            if math.isnan(bound):
                raise ObserveError(f"{where}: input wait bucket with le={shown(repr(le), 60)}; expected a number")
            cum[bound] = cum.get(bound, 0.0) + _finite(v, where, f"the count of input wait bucket le={le}")
            if len(cum) > _MAX_BUCKETS:
                raise ObserveError(f"{where}: an input wait histogram of more than {_MAX_BUCKETS} buckets")
    return sorted(cum.items())


# -- charts ------------------------------------------------------------------------
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
        # one legend entry per daemon up to _SHOWN_SOURCES, then one for the rest (a legend of
        # a thousand entries is what made big reports slow)
        label = (f"generation ({where})" if k < _SHOWN_SOURCES else
                 f"generation ({len(generations) - _SHOWN_SOURCES} more daemons)" if k == _SHOWN_SOURCES else None)
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
