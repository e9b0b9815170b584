"""Plain metric values (sluice.loaderd.metricvalues) expose what prometheus_client's own metrics expose.

The daemon fills `Family` children and maps them to Prometheus only when scraped;
for any sequence of updates the /metrics text equals the one prometheus_client's
Counter, Gauge and Histogram give for the same updates (``_created`` times aside).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.loaderd.metricvalues import Family, collect

BUCKETS = (0.001, 0.01, 0.5, 1, 10)
_amount = st.floats(min_value=0, max_value=100, allow_nan=False)
_op = st.tuples(st.sampled_from(["c", "g", "h"]), st.sampled_from(["a", "b"]), _amount)


class _Plain:
    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self):
        return collect(self.families)


def _text(registry: CollectorRegistry) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(registry).decode())


@pytest.mark.parametrize("one_writer", [False, True])  # True: the IO thread's lock-free children (Tally)
@settings(max_examples=40, deadline=None)
@given(st.lists(_op, max_size=30))
@example([("h", "a", 0.5), ("h", "a", 1.0), ("h", "b", 100.0), ("h", "a", 0.0), ("c", "b", 0.0)])  # on bounds
def test_the_exposition_equals_prometheus_clients(one_writer, ops):
    ref = CollectorRegistry()
    theirs = {"c": Counter("x_things_total", "things", ["k"], registry=ref),
              "g": Gauge("x_level_bytes", "level", ["k"], registry=ref),
              "h": Histogram("x_wait_seconds", "wait", ["k"], registry=ref, buckets=BUCKETS)}
    ours = {"c": Family("counter", "x_things_total", "things", ["k"], one_writer=one_writer),
            "g": Family("gauge", "x_level_bytes", "level", ["k"]),
            "h": Family("histogram", "x_wait_seconds", "wait", ["k"], BUCKETS, one_writer=one_writer)}
    for kind, label, amount in ops:
        for fam in (theirs[kind], ours[kind]):
            getattr(fam.labels(label), {"c": "inc", "g": "set", "h": "observe"}[kind])(amount)
    mine = CollectorRegistry()
    mine.register(_Plain(list(ours.values())))
    assert _text(mine) == _text(ref)


@pytest.mark.parametrize("one_writer", [False, True])
def test_a_counter_refuses_to_go_down_and_labels_must_match(one_writer):
    fam = Family("counter", "x_total", "x", ["a", "b"], one_writer=one_writer)
    with pytest.raises(ValueError, match="non-negative"):
        fam.labels("1", "2").inc(-1)
    assert fam.labels("1", "2").get() == 0
    with pytest.raises(ValueError, match=r"x takes labels \['a', 'b'\], got \['1'\]"):
        fam.labels("1")
    assert fam.labels(1, 2) is fam.labels("1", "2")  # label values are strings, children made once
