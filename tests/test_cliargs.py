"""The shared argparse value types: a bad value names the flag, the text and the accepted range."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.cliargs import ranged, step_range


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    p.add_argument("--workers", type=ranged(int, 1, 1024, "--workers"))
    p.add_argument("--timeout", type=ranged(float, 0, 86_400, "--timeout", low_open=True))
    p.add_argument("--steps", type=step_range("--steps"))
    return p


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "0"], r"--workers '0': expected a value in \[1, 1024\]"),
    (["--workers", "1.5"], r"--workers '1.5': not an integer"),
    (["--timeout", "0"], r"--timeout '0': expected a value in \(0, 86400\]"),
    (["--timeout", "nan"], r"--timeout 'nan': expected a value in"),
    (["--timeout", "inf"], r"--timeout 'inf': expected a value in"),
    (["--timeout", "x" * 100], r"--timeout 'x{40}': not a number"),
    (["--steps", "5:5"], r"--steps '5:5': expected A:B with integers 0 <= A < B"),
    (["--steps=-1:3"], r"--steps '-1:3': expected A:B"),
    (["--steps", "3"], r"--steps '3'"),
])
def test_a_bad_value_is_refused_naming_flag_text_and_range(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(argv)


@given(lo=st.integers(-10, 10), width=st.integers(0, 10), value=st.integers(-30, 30), low_open=st.booleans())
def test_ranged_accepts_exactly_the_declared_interval(lo, width, value, low_open):
    hi = lo + width
    inside = lo < value <= hi if low_open else lo <= value <= hi
    parse = ranged(int, lo, hi, "--n", low_open)
    if inside:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="--n"):
            parse(str(value))


def test_a_step_range_is_a_pair_of_integers():
    assert step_range("--steps")("2:7") == (2, 7)
