"""`--gil-cpu auto`'s move rule (`gilcpu.decide`), from the load of one check window.

Specifications:
* the threads move when other work takes more than `BUSY_SHARE` of the
  pinned CPU and another CPU is less busy than that other work, to the least
  busy (the lowest of equals); else they stay, and with one CPU always;
* under the same load, seen from the CPU they moved to, they never move again
  (no ping-pong);
* the daemon's own threads filling the pinned CPU are no reason to move.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sluice.loaderd.gilcpu import BUSY_SHARE, decide

TICKS = 200.0  # one CPU's clock ticks in a 2 s window at 100 Hz


@given(cpus=st.integers(1, 8), data=st.data())
def test_a_move_goes_to_the_least_busy_cpu_and_never_back_under_the_same_load(cpus, data):
    busy = {c: data.draw(st.integers(0, int(TICKS))) for c in range(cpus)}
    cpu = data.draw(st.integers(0, cpus - 1))
    ours = data.draw(st.integers(0, busy[cpu]))
    best = decide(cpu, busy, ours, TICKS)
    if cpus == 1:
        assert best is None
        return
    other = busy[cpu] - ours
    least = min((c for c in busy if c != cpu), key=lambda c: (busy[c], c))
    if other > BUSY_SHARE * TICKS and busy[least] < other:
        assert best == least
        after = dict(busy)  # our threads' ticks go with them; the other work stays where it was
        after[cpu] -= ours
        after[least] += ours
        assert decide(least, after, ours, TICKS) is None
    else:
        assert best is None


def test_the_rule_at_its_edges():
    other = int(BUSY_SHARE * TICKS) + 1
    assert decide(1, {0: other - 1, 1: other + 10}, 10, TICKS) == 0  # just over a quarter, a less busy CPU
    assert decide(1, {0: other, 1: other + 10}, 10, TICKS) is None  # that CPU as busy as the other work
    assert decide(1, {0: 0, 1: int(BUSY_SHARE * TICKS) + 10}, 10, TICKS) is None  # a quarter exactly: stay
    assert decide(2, {0: 5, 1: 5, 2: 150}, 0, TICKS) == 0  # ties: the lowest CPU
    assert decide(0, {0: int(TICKS), 1: 0}, int(TICKS), TICKS) is None  # our own threads fill it: stay
