"""A run's record for `sluice report`: its ledger series and its daemons' metrics, read, checked and bounded.

`read_ledger` (a ledger file: JSON lines of `sluice ledger --json --every N`) or
`compute_ledger` (a run folder, computed offline) give a `Ledger`;
`read_metrics_logs` adds `sluice top --record` samples (each daemon's counts:
totals.py) and the daemons' JSON logs (starts with what they name, restores,
commits, the log's time span) to a `RunRecord`. Nothing read is trusted: every field is checked (counts
are integers below 2^63, shares finite, times within years 1970-9999), every
size is bounded (the `_MAX_*` limits below), and a bad line is an
`ObserveError` naming the file, the line and the field (exit 2). Many sources
are reduced while reading to the `SHOWN_SOURCES` of largest target share and
one "other" entry. report.py draws the page from the record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError
from sluice.observe.scrape import shown
from sluice.observe.totals import Daemon, add_sample, finite as _finite

_MAX_LINE = 16 << 20  # one ledger line: about 130 bytes a source, so 100,000 sources fit
_MAX_LEDGER_BYTES = 256 << 20  # a whole ledger file: reading it stays within seconds
_MAX_POINTS = 20_000  # ledger lines per page: more would not be readable in a chart either
_MAX_SOURCES = 100_000  # sources in one ledger line
_MAX_COUNT = (1 << 63) - 1  # documents, tokens, steps, epochs: what a run can count, and what a chart can draw
SHOWN_SOURCES = 12  # drawn and listed one by one; the rest are summed as one "other" entry


_MAX_DAEMONS = 1024  # metrics URLs in one report
_MAX_EVENTS = 100_000  # daemon log records kept for the timeline (starts, restores, commits)
_MAX_KEPT_SAMPLES = 200_000  # (wall, generation) points kept after dropping those that change nothing
_MAX_URL = 1000  # characters of a sample's url kept (the key of its daemon)
_MAX_WALL = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a chart's time axis can show
_TIMELINE_MSGS = ("loaderd listening", "restored", "committed")


@dataclass
class Ledger:
    """A ledger series reduced, while it is read, to what the page shows; memory does not grow
    with the number of sources times the number of lines.

    The sources are ranked once, by the first line's target shares (largest
    first, then in the ledger's order; target shares are the mixture's
    weights, the same on every line). The first SHOWN_SOURCES are drawn and
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
            self.shown = ranked[:SHOWN_SOURCES]
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
    """What the page and the JSON record show, read from files (never from a live daemon), reduced
    while reading: a long run's metrics log is not held in memory, only the generation per sample
    where it changes and each daemon's counts (totals.py)."""

    ledger: Ledger | None = None
    # per metrics URL (one daemon each): (wall seconds, generation) of the samples where the
    # generation changes (and the last)
    generations: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    events: list[tuple[str, str, float]] = field(default_factory=list)  # (ts, msg, generation) of _TIMELINE_MSGS
    samples: int = 0
    restores: int = 0
    starts: int = 0
    kept: int = 0  # points in `generations`
    daemons: dict[str, Daemon] = field(default_factory=dict)  # per metrics URL: its counts (totals.py)
    keys: list[int] = field(default_factory=lambda: [0])  # (replica, source) pairs seen, against their bound
    # from the daemons' logs: what each start said (run and dataset IDs, run spec digest, tokens per step,
    # replicas), the highest committed step per replica, the wall seconds of each start and of the
    # first and last line
    started: list[dict[str, Any]] = field(default_factory=list)
    commits: dict[int, int] = field(default_factory=dict)
    start_walls: list[float] = field(default_factory=list)
    log_span: tuple[float, float] = (math.inf, -math.inf)

    @property
    def wait_last(self) -> dict[str, list[tuple[float, float]]]:
        """Per daemon, its last sample's input wait histogram (le, cumulative count), where it had one."""
        return {url: d.wait_buckets for url, d in self.daemons.items() if d.wait_buckets}


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
                add_sample(rec.daemons.setdefault(url, Daemon()), wall, series, where, rec.keys)
            elif isinstance(obj.get("msg"), str) and isinstance(obj.get("ts"), str):
                _log_line(rec, obj, where)
            else:
                raise ObserveError(f"{where}: neither a `sluice top --record` sample nor a loaderd log line")
    for url, points in rec.generations.items():
        points.sort()
        rec.generations[url] = _changes(points)
    rec.events.sort()


def log_wall(ts: str) -> float | None:
    """A daemon log line's ``ts`` (``2026-12-01T22:14:04.123Z``) as seconds since 1970; None if it is not one."""
    import datetime as dt

    try:
        return dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None


_STARTED = ("run_id", "dataset_id", "runspec_digest")  # strings a start's log line names the run by
_STARTED_COUNTS = ("tokens_per_step", "replicas", "metrics_port")


def _log_line(rec: RunRecord, obj: dict[str, Any], where: str) -> None:
    """Fold one loaderd log line in: its time into the log's span, starts, restores and commits as events,
    what a start names (`RunRecord.started`), the highest committed step per replica. Checked: a
    generation is a number, a start's counts and a commit's replica and step are counts."""
    wall = log_wall(obj["ts"])
    if wall is not None:
        rec.log_span = (min(rec.log_span[0], wall), max(rec.log_span[1], wall))
    msg = obj["msg"]
    if msg not in _TIMELINE_MSGS:
        return
    rec.restores += msg == "restored"
    g = obj.get("generation")
    gen = _finite(g, where, "generation") if g is not None else 0.0
    if len(rec.events) < _MAX_EVENTS:
        rec.events.append((obj["ts"][:64], msg, gen))  # only what the timeline draws
    if msg == "loaderd listening":
        rec.starts += 1
        if wall is not None and len(rec.start_walls) < _MAX_EVENTS:
            rec.start_walls.append(wall)
        said: dict[str, Any] = {k: shown(obj[k], 200) for k in _STARTED if isinstance(obj.get(k), str)}
        said["wall"] = wall
        for k in _STARTED_COUNTS:
            if k in obj:
                if not _is_count(obj[k]):
                    raise ObserveError(f"{where}: {k} is {shown(repr(obj[k]), 60)}; expected a count")
                said[k] = obj[k]
        if len(rec.started) < _MAX_DAEMONS:
            rec.started.append(said)
    elif msg == "committed":
        replica, step = obj.get("replica"), obj.get("step")
        if not (_is_count(replica) and _is_count(step)):
            raise ObserveError(f"{where}: a commit of replica {shown(repr(replica), 40)} at step "
                               f"{shown(repr(step), 40)}; expected counts")
        if replica in rec.commits or len(rec.commits) < _MAX_EVENTS:
            rec.commits[replica] = max(rec.commits.get(replica, -1), step)


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
