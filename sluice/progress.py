"""Progress on stderr for long CLI commands, one rule for all of them.

    add_progress_argument(parser)            # --progress / --no-progress
    with progress_bar(args, total=100, desc="plan", unit="step") as bar:
        bar.update(1)

The bar is shown when ``--progress`` is given, or by default when stderr is a
terminal and ``--json`` is not given (machine output stays clean); never with
``--no-progress``. It writes to stderr only, so stdout stays the command's
result. A disabled bar is a no-op object with the same methods.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--progress/--no-progress`` (default: on when stderr is a terminal, off under --json)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal, unless --json)")


def progress_wanted(args: argparse.Namespace) -> bool:
    """Whether `args` (with the flags above and maybe --json) ask for a bar: an explicit
    --progress/--no-progress decides; otherwise on when stderr is a terminal and --json is not given."""
    chosen = getattr(args, "progress", None)
    if chosen is not None:
        return bool(chosen)
    return sys.stderr.isatty() and not getattr(args, "json", False)


class _NoBar:
    """What a disabled bar is: every call does nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


@contextmanager
def progress_bar(args: argparse.Namespace | bool, *, total: float | None, desc: str,
                 unit: str = "it", unit_scale: bool = False) -> Iterator[Any]:
    """A tqdm bar on stderr if `args` ask for one (or `args` is True), else a no-op; closed on exit."""
    enabled = args if isinstance(args, bool) else progress_wanted(args)
    if not enabled:
        yield _NoBar()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, unit_divisor=1024 if unit == "B" else 1000,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5, leave=False)
    try:
        yield bar
    finally:
        bar.close()
