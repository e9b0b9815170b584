"""The producer gives its CPU away within a call (sluice/loaderd/physical/giveway.py): a thread of the serving
path woken onto the producer's CPU waits for the next kernel call or entry, not for the call's end.

What is held here is where the yields happen and how often, and that the kernel a daemon loads is paced;
that nothing served changes with them is every kernel test's (they run the paced kernel: conftest's
`jit_kernel`). What they buy, a shorter time-to-batch tail, is measured in `bench/serve.py --only ttb`.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from sluice.loaderd.physical import giveway

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_yield"), reason="no os.sched_yield on this platform")


def _on_a_fresh_thread(fn):
    """`fn()`'s result, run on a thread of its own (yields are counted, and spaced, per thread)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    assert out, "the thread did not finish"
    return out[0]


def test_a_thread_yields_at_once_then_at_most_once_an_interval(monkeypatch):
    monkeypatch.setattr(giveway, "EVERY_S", 3600.0)  # (no two yields of this test fall in one interval)

    def calls():
        giveway.give_way()
        first = giveway.yields()
        for _ in range(100):
            giveway.give_way()
        return first, giveway.yields()

    assert _on_a_fresh_thread(calls) == (1, 1)


def test_a_thread_yields_again_once_the_interval_passed(monkeypatch):
    monkeypatch.setattr(giveway, "EVERY_S", 0.001)

    def calls():
        giveway.give_way()
        time.sleep(0.005)
        giveway.give_way()
        return giveway.yields()

    assert _on_a_fresh_thread(calls) == 2


def test_the_interval_is_kept_per_thread(monkeypatch):
    monkeypatch.setattr(giveway, "EVERY_S", 3600.0)
    giveway.give_way()  # (this thread's yield does not hold back another thread's first)
    assert _on_a_fresh_thread(lambda: (giveway.give_way(), giveway.yields())[1]) == 1


def test_a_paced_face_gives_way_before_each_function_and_reads_the_rest_through(monkeypatch):
    monkeypatch.setattr(giveway, "EVERY_S", 0.0)  # (every call yields)
    face = giveway.Paced(SimpleNamespace(add=lambda a, b: a + b, WALK_DONE=0))

    def calls():
        got = [face.add(1, 2), face.add(3, 4)]
        return got, giveway.yields(), face.WALK_DONE, face.add is face.add

    assert _on_a_fresh_thread(calls) == ([3, 7], 2, 0, True)
    with pytest.raises(AttributeError):
        face.missing  # noqa: B018 - a name the face lacks is the face's AttributeError


def test_the_kernel_a_daemon_loads_gives_way_within_a_producer_call(jit_kernel, monkeypatch):
    """The loaded kernel's functions are paced: a producer call of several steps on the fast path yields between
    its kernel calls and its entries, not only after the call (steploop.py)."""
    from sluice.loaderd.physical.producer import StepMaker
    from test_logical_fused import five_sources_case

    monkeypatch.setattr(giveway, "EVERY_S", 0.0)
    plan, docs = five_sources_case()
    maker = StepMaker(plan, docs, replica=0, replicas=1)
    maker.jit = SimpleNamespace(kernel=jit_kernel)

    def call():
        before, calls = giveway.yields(), jit_kernel.calls
        entries, _ = maker.produce_run(plan.initial_state(), 4)
        return len(entries), jit_kernel.calls - calls, giveway.yields() - before

    made, kernel_calls, yielded = _on_a_fresh_thread(call)
    # one call of the kernel made the 4 steps; it yielded before its walk, assembly, gathers, labels and
    # states (5 or more) and before each of its 4 entries
    assert (made, kernel_calls) == (4, 1)
    assert yielded >= 5 + 4


def test_a_calls_end_yields_whatever_the_interval(monkeypatch):
    """`yield_now` (a producer call's end, steploop.py) yields even right after `give_way` did, and restarts the
    interval: the `give_way` after it does not yield."""
    monkeypatch.setattr(giveway, "EVERY_S", 3600.0)

    def calls():
        giveway.give_way()
        giveway.yield_now()
        giveway.give_way()
        return giveway.yields()

    assert _on_a_fresh_thread(calls) == 2
