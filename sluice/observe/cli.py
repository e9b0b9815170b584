"""`sluice top` and `sluice report`: registration only; the work is in top.py and report.py."""

from __future__ import annotations

import argparse
from typing import Any


def _top(args: argparse.Namespace) -> int:
    from sluice.observe.top import run_top

    try:
        return run_top(args)
    except KeyboardInterrupt:  # the normal way to leave a live view
        return 0


def _report(args: argparse.Namespace) -> int:
    from sluice.observe.report import run_report

    return run_report(args)


def register(subparsers: Any) -> None:
    from sluice.observe import report, top

    p = subparsers.add_parser("top", help="live terminal view of daemons: throughput, waits, queues, mixture",
                              description=top.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_arguments(p)
    p.set_defaults(func=_top)
    r = subparsers.add_parser("report", help="a run after the fact: tokens served and trained, ETTR, charts "
                              "(an HTML page or a JSON record)",
                              description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_arguments(r)
    r.set_defaults(func=_report)
