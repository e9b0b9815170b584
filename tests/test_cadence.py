"""Cadence advisor: Young's interval and the waste curve, as math and as a command."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.trainer_hooks.cadence import CadenceError, cadence_table, waste, young_interval

positive = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False, allow_infinity=False)


def test_worked_example():
    assert young_interval(10, 86400) == pytest.approx(1314.534, abs=1e-3)
    assert waste(1314.534, 10, 86400) == pytest.approx(2 * 10 / 1314.534, rel=1e-6)
    assert waste(600, 10, 86400, restore_s=60, detect_s=30) == pytest.approx(10 / 600 + 600 / 172800 + 90 / 86400)


@given(positive, positive, st.floats(min_value=0.01, max_value=100))
def test_youngs_interval_minimises_the_waste(cost, mtbf, factor):
    best = young_interval(cost, mtbf)
    assert waste(best, cost, mtbf) <= waste(best * factor, cost, mtbf) * (1 + 1e-12)


@given(positive, positive)
def test_table_is_symmetric_in_log_interval_with_minimum_at_t_star(cost, mtbf):
    rows = cadence_table(cost, mtbf, multiples=(0.5, 1.0, 2.0))
    assert rows[1].label == "T*" and rows[1].waste <= min(rows[0].waste, rows[2].waste)
    assert math.isclose(rows[0].waste, rows[2].waste, rel_tol=1e-9)  # C/T + T/2M at T*/2 and 2T*


@pytest.mark.parametrize("cost,mtbf", [(0, 1), (1, 0), (-1, 5), (float("nan"), 5), (1, float("inf"))])
def test_bad_inputs_are_refused(cost, mtbf):
    with pytest.raises(CadenceError):
        young_interval(cost, mtbf)


def test_cadence_command(sluice_main):
    out = sluice_main("cadence", "--cost", "10", "--mtbf", "24h", "--restore", "1m", "--detect", "30", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["young_interval_s"] == pytest.approx(1314.534, abs=1e-3)
    assert [r["label"] for r in doc["table"]] == ["0.25 T*", "0.5 T*", "T*", "2 T*", "4 T*"]
    assert doc["table"][2]["waste"] == pytest.approx(2 * 10 / 1314.534 + 90 / 86400)
    text = sluice_main("cadence", "--cost", "10", "--mtbf", "86400")
    assert "T* = sqrt(2 * 10 s * 86400 s) = 1314.5 s" in text.stdout
    bad = sluice_main("cadence", "--cost", "0", "--mtbf", "1h")
    assert bad.returncode == 2 and "checkpoint cost C must be" in bad.stderr
    bad = sluice_main("cadence", "--cost", "ten", "--mtbf", "1h")
    assert bad.returncode == 2 and "'ten' is not a duration" in bad.stderr
