"""argparse value types shared by every command line (`sluice ...` and `loaderd`).

A bad value makes argparse print ``PROG: error: argument FLAG: FLAG 'TEXT':
...`` and exit 2, naming the flag, the text and the accepted range::

    p.add_argument("--workers", type=ranged(int, 1, 1024, "--workers"), default=2)
    p.add_argument("--timeout", type=ranged(float, 0, 86_400, "--timeout", low_open=True), default=30.0)
    p.add_argument("--steps", type=step_range("--steps"), required=True, metavar="A:B")

Floats refuse NaN and infinity (a NaN compares False with every bound, an
infinite timeout would wait forever). Echoed text is cut to 40 characters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def ranged(kind: type[N], lo: float, hi: float, flag: str, low_open: bool = False) -> Callable[[str], N]:
    """argparse type: a number of `kind` in [lo, hi] ((lo, hi] if `low_open`); NaN and infinity refused."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{flag} {text[:40]!r}: not {'an integer' if kind is int else 'a number'}"
                                             ) from None
        if not (lo < value <= hi if low_open else lo <= value <= hi):  # False for NaN
            bounds = f"({lo}, {hi}]" if low_open else f"[{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{flag} {text[:40]!r}: expected a value in {bounds}")
        return value

    return parse


def step_range(flag: str) -> Callable[[str], tuple[int, int]]:
    """argparse type: "A:B", integers with 0 <= A < B (steps A inclusive to B exclusive)."""

    def parse(text: str) -> tuple[int, int]:
        a, sep, b = text.partition(":")
        try:
            start, stop = int(a), int(b)
        except ValueError:
            start = stop = -1
        if not sep or start < 0 or stop <= start:
            raise argparse.ArgumentTypeError(f"{flag} {text[:40]!r}: expected A:B with integers 0 <= A < B")
        return start, stop

    return parse
