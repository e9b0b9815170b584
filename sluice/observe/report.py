"""`sluice report [LEDGER_OR_RUN] [--metrics-log FILE ...] [--checkpoints DIR] -o report.html|record.json`:
a run on one page, and its record.

LEDGER_OR_RUN (optional when metrics logs are given) is either
  * a ledger file: JSON lines of ``sluice ledger --json --every N`` (one ledger per line,
    growing ``until_step``), or
  * a run folder holding ``manifest.json`` and ``run.toml``: the ledger series is then
    computed here, offline (``--until-step K --every N``), as `sluice ledger` does.

``--metrics-log FILE`` (repeatable) adds JSON lines of either kind, told apart per line:
samples recorded by ``sluice top --record FILE`` and the daemon's own JSON logs (its
stderr). ``--checkpoints DIR`` adds a checkpoint folder's commits. From them: the tokens
the daemons served (in all, per source and replica), the steps and tokens trained, the
duration, throughput and input wait over time, time to batch, restarts, fencing events
and ETTR (figures.py). ``-o FILE.json`` writes that record as JSON, any other name the
page (self-contained: charts are embedded PNG images, no script; page.py); ``--json FILE``
writes the record besides the page. A chart whose input is missing says which option
provides it. The page needs matplotlib (``pip install 'sluice[report]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from sluice.errors import ObserveError, SpecError
from sluice.observe.record import RunRecord, compute_ledger, read_ledger, read_metrics_logs
from sluice.observe.scrape import shown

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


def _clean(v: Any) -> Any:
    """`v` with every float that is not finite (a quantile in the +Inf bucket) as null: strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def record_json(figures: dict[str, Any]) -> str:
    """The JSON record as written: strict JSON (no NaN or Infinity), keys sorted, one object."""
    return json.dumps(_clean(figures), sort_keys=True, indent=1, allow_nan=False) + "\n"


def run_report(args: argparse.Namespace) -> int:
    """Read the inputs, compute the figures, write the page or the JSON record (by -o's suffix; --json FILE
    writes the record as well), each atomically (`write_page`); prints what it wrote."""
    out = Path(args.output)
    as_json = out.suffix.lower() == ".json"
    if not as_json:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ObserveError("sluice report needs matplotlib for a page: pip install 'sluice[report]' "
                               "(or -o FILE.json for the JSON record alone)")
    rec = RunRecord()
    src = Path(args.ledger_or_run) if args.ledger_or_run else None
    if src is None and not args.metrics_log:
        raise SpecError("report: give a ledger or run folder, --metrics-log FILE, or both")
    if src is not None and src.is_dir():
        if args.until_step is None:
            raise SpecError(f"report: {shown(str(src))} is a run folder; give --until-step K to compute its ledger")
        if args.every < 1:
            raise SpecError(f"report: --every must be >= 1, got {args.every}")
        rec.ledger = compute_ledger(src, args.until_step, args.every, args.cache)
    elif src is not None:
        rec.ledger = read_ledger(src)
    read_metrics_logs(args.metrics_log or [], rec)
    from sluice.observe.figures import read_checkpoints, run_figures

    figures = run_figures(rec, read_checkpoints(args.checkpoints or []))
    written = []
    if args.json:
        write_page(Path(args.json), record_json(figures))
        written.append(args.json)
    if as_json:
        write_page(out, record_json(figures))
    else:
        from sluice.observe.page import render_html

        name = src.name if src is not None else Path(args.metrics_log[0]).name
        write_page(out, render_html(rec, figures, args.title or f"sluice report: {name}"))
    for path in [*written, str(out)]:
        print(shown(path, 4096))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger_or_run", metavar="LEDGER_OR_RUN", nargs="?", default=None,
                   help="ledger JSON lines (sluice ledger --json --every N) or a folder with manifest.json and run.toml "
                        "(optional with --metrics-log)")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="page to write (atomically); a name ending in .json writes the JSON record instead")
    p.add_argument("--json", default=None, metavar="FILE", help="write the JSON record to FILE as well")
    p.add_argument("--metrics-log", action="append", metavar="FILE",
                   help="JSON lines from `sluice top --record` or loaderd's stderr (repeatable)")
    p.add_argument("--checkpoints", action="append", metavar="DIR",
                   help="a checkpoint folder (CheckpointManager's): its commits are the steps trained (repeatable)")
    p.add_argument("--until-step", type=int, default=None, metavar="K", help="run folder: compute steps 0..K")
    p.add_argument("--every", type=int, default=10, metavar="N", help="run folder: a ledger point every N steps (default 10)")
    p.add_argument("--cache", default=None, help="run folder: node cache to read objects through (default: temporary)")
    p.add_argument("--title", default=None, help="page title")
