"""The producer loop (`steploop.StepLoop`) that a replica's producer thread runs.

Its rules, checked on a real `StepMaker` over synthetic mapped shards with a
recording sink (the daemon's sink is the `StepQueue`: tests/test_loaderd.py
runs it): the first call after a start or a RESTORE makes one step, later
ones up to STEPS_AT_ONCE but never past the room the sink reports; a terminal
entry parks the loop; a call whose epoch went stale (a RESTORE while it was
computed) is dropped whole, and the next call starts from the restored state,
alone.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from logical_helpers import MappedDocs, make_manifest, make_spec

from sluice.loaderd.logical import Plan
from sluice.loaderd.physical.jitload import KernelLoader
from sluice.loaderd.physical.jitstart import IDLE_START_S, START_AFTER_STEPS, StartRule
from sluice.loaderd.physical.producer import STEPS_AT_ONCE, StepMaker
from sluice.loaderd.physical.steploop import StepLoop


def _plan(**spec):
    manifest = make_manifest([("a", [40, 25], "1", "repeat"), ("b", [30], "1", "repeat")], seq_len=8)
    return Plan(manifest, make_spec(lanes=2, global_batch=2, micro_batch=1, **spec))


class Sink:
    """Records each call's steps; `room` steps of lead; stops after `calls` calls or when parked."""

    def __init__(self, room: int = 8, calls: int = 6) -> None:
        self.room, self.calls, self.got, self.parked_seen = room, calls, [], False
        self.current = True

    def wait(self, loop):
        if loop.parked:
            self.parked_seen = True
            return None
        if len(self.got) >= self.calls:
            return None
        return loop.epoch, loop.state, self.room

    def accept(self, epoch):
        self.got.append([])
        current = self.current(epoch) if callable(self.current) else self.current
        return contextlib.nullcontext(current)

    def put(self, entry):
        self.got[-1].append(entry)

    def sent(self):
        pass


def _steps(sink):
    return [[e.step for e in call] for call in sink.got]


def test_the_first_call_makes_one_step_then_steps_at_once_within_the_room():
    plan = _plan()
    sink = Sink(room=3, calls=4)
    loop = StepLoop(StepMaker(plan, MappedDocs(plan, 12), replica=0, replicas=1), sink, plan.initial_state())
    loop.run()
    per = min(STEPS_AT_ONCE, 3)
    assert _steps(sink) == [[0], list(range(1, 1 + per)), list(range(1 + per, 1 + 2 * per)),
                            list(range(1 + 2 * per, 1 + 3 * per))]
    assert loop.produced == 1 + 3 * per and loop.state.step == 3 * per


def test_a_terminal_entry_parks_the_loop():
    plan = _plan(max_steps=5)
    sink = Sink(calls=100)
    loop = StepLoop(StepMaker(plan, MappedDocs(plan, 12), replica=0, replicas=1), sink, plan.initial_state())
    loop.run()
    entries = [e for call in sink.got for e in call]
    assert sink.parked_seen and [e.step for e in entries] == list(range(6)) and entries[-1].error is not None
    assert loop.produced == 5


def test_a_restore_while_a_call_is_computed_drops_it_and_goes_on_from_the_restored_state_alone():
    plan = _plan()
    sink = Sink(calls=5)
    loop = StepLoop(StepMaker(plan, MappedDocs(plan, 12), replica=0, replicas=1), sink, plan.initial_state())
    start = plan.initial_state()

    def current(epoch):
        if len(sink.got) == 3 and loop.epoch == 0:  # a RESTORE to the start arrives while call 3 is computed
            loop.restart(start, loop.epoch + 1)
        return epoch == loop.epoch

    sink.current = current
    loop.run()
    per = min(STEPS_AT_ONCE, sink.room)
    assert _steps(sink) == [[0], list(range(1, 1 + per)), [], [0], list(range(1, 1 + per))] and loop.epoch == 1
    assert loop.produced == 2 + 2 * per


def test_a_stale_call_is_dropped():
    plan = _plan()
    sink = Sink(calls=3)
    sink.current = False  # every call's epoch went stale before its hand-over
    loop = StepLoop(StepMaker(plan, MappedDocs(plan, 12), replica=0, replicas=1), sink, plan.initial_state())
    loop.run()
    assert _steps(sink) == [[], [], []] and loop.produced == 0 and loop.fresh


# -- when the loop asks for the compiled kernel (physical/jitstart.py) -------------------------------------------

class SlowSink(Sink):
    """A consumer slower than the producer: each wait for room takes `wait_s` (its step's time)."""

    def __init__(self, wait_s: float, **kw) -> None:
        super().__init__(**kw)
        self.wait_s, self._never = wait_s, threading.Event()

    def wait(self, loop):
        self._never.wait(self.wait_s)  # (nothing sets it: the consumer's own step, not a synchronization)
        return super().wait(loop)


def _kernel_loop(sink, **spec):
    """A loop over a plan whose docs carry a kernel loader in mode "off" (its `start` does nothing: the loop's
    decision is what is checked here; tests/test_loaderd_jit.py loads a real one in a daemon), its kernel the
    source run uncompiled (so the calls make several steps, as a kernel's do)."""
    plan = _plan(**spec)
    docs = MappedDocs(plan, 12)
    kernel = docs.jit and docs.jit.kernel
    docs.jit = KernelLoader("off")
    docs.jit.kernel = kernel
    return StepLoop(StepMaker(plan, docs, replica=0, replicas=1), sink, plan.initial_state())


def test_start_rule_names_the_first_condition_met():
    rule = StartRule(0, after_steps=100, idle_s=0.5)
    assert rule.due(1, 0.0, 0) is None and rule.due(99, 0.49, 98) is None  # short so far, busy, length unknown
    assert rule.due(100, 0.0, 99) == "steps: 100 made, the run's length unknown"
    assert rule.due(5, 0.5, 4).startswith("idle: the producer waited 0.50 s")
    known = StartRule(1000, after_steps=100)
    assert known.due(1, 0.0, 0) == "max_steps: 999 steps to go"
    assert known.due(1, 0.0, 899) == "max_steps: 100 steps to go"
    assert known.due(1, 0.0, 900) is None  # fewer than `after_steps` left: the load would not pay back
    assert known.due(1, 0.0, None) is None  # the stream ended at the last step
    assert START_AFTER_STEPS == 2048 and IDLE_START_S == 0.5  # the documented values (docs/logical.md)
    ready = "ready: the kernels' compiled module is on disk"
    assert rule.due(1, 0.0, 0, ready=True) == ready and known.due(1, 0.0, 900, ready=True) == ready  # any length
    assert rule.due(1, 0.0, None, ready=True) is None  # (not on the start path: after a step was made)


def test_a_short_run_asks_for_the_kernel_after_its_first_step_where_the_module_is_built():
    loop = _kernel_loop(Sink(room=4, calls=3), max_steps=50)
    loop.maker.docs.jit._ready = True  # (what `KernelLoader.ready` answered: tests/test_jitaot.py asks a real one)
    loop.run()
    assert loop.kernel_asked == (1, "ready: the kernels' compiled module is on disk")


def test_a_run_the_spec_says_is_long_asks_for_the_kernel_after_its_first_step():
    loop = _kernel_loop(Sink(room=4, calls=3), max_steps=START_AFTER_STEPS + 10)
    loop.run()
    assert loop.kernel_asked == (1, f"max_steps: {START_AFTER_STEPS + 9} steps to go")


def test_a_short_busy_run_never_asks_and_a_long_one_asks_after_start_after_steps():
    loop = _kernel_loop(Sink(room=4, calls=6))
    loop.run()
    assert loop.kernel_asked is None and loop.produced == 1 + 5 * min(STEPS_AT_ONCE, 4)
    loop = _kernel_loop(Sink(room=4, calls=6), max_steps=START_AFTER_STEPS)  # known, but too short to pay back
    loop.run()
    assert loop.kernel_asked is None
    loop = _kernel_loop(Sink(room=4, calls=6))
    loop.kernel_rule = StartRule(0, after_steps=9)
    loop.run()
    assert loop.kernel_asked == (1 + 2 * min(STEPS_AT_ONCE, 4), "steps: 9 made, the run's length unknown")


def test_a_producer_waiting_for_a_slower_consumer_asks_for_the_kernel():
    loop = _kernel_loop(SlowSink(0.03, room=4, calls=8))
    loop.kernel_rule = StartRule(0, idle_s=0.05)
    loop.run()
    assert loop.kernel_asked is not None and loop.kernel_asked[1].startswith("idle: the producer waited")
    assert loop.kernel_asked[0] < 1 + 7 * min(STEPS_AT_ONCE, 4)  # before its last call
    assert loop.idle_s >= 0.05


def test_while_tokens_are_made_from_text_the_kernel_is_held_back_and_asked_for_once_they_are_made(monkeypatch):
    """The rule is due from the first call on (a known long run), but some object's tokens are being made until
    three steps are handed over (one a call then: `StepMaker` falls back to `Plan.step`, reason ``filling``):
    the load is held back after step 0, where it was first due, and asked for after the third call."""
    loop = _kernel_loop(Sink(room=4, calls=5), max_steps=START_AFTER_STEPS + 100)

    class Making:  # (what the producer and the loop read: `DocSource.making`)
        def __get__(self, docs, owner):
            return loop.produced < 3

    monkeypatch.setattr(type(loop.maker.docs), "making", Making(), raising=False)
    loop.run()
    assert loop.kernel_held == 0 and loop.kernel_asked == (3, f"max_steps: {START_AFTER_STEPS + 97} steps to go")


@pytest.mark.parametrize("ready", [True, False])
def test_a_call_waits_a_few_ms_for_the_module_compiled_ahead_of_time_but_not_for_numba(monkeypatch, ready):
    """Where the load in flight is the module compiled ahead of time (about 4 ms), the producer's call waits for
    it (`KernelLoader.arriving`) instead of making its step with `Plan.step`; where it is numba's (0.35 s of
    the GIL, `ready` False), the call does not wait."""
    loaded = object()

    def slow_load(self):
        time.sleep(0.02)
        self.kernel, self.state = loaded, "active"

    monkeypatch.setattr(KernelLoader, "_load", slow_load)
    monkeypatch.setattr(KernelLoader, "ready", lambda self: ready)
    loader = KernelLoader("auto")
    loader._ready = loader.ready()
    loader.start("test")
    t0 = time.monotonic()
    got = loader.arriving()
    waited = time.monotonic() - t0
    assert (got is loaded) == ready and (waited >= 0.015) == ready
    assert loader.wait(1) and loader.arriving() is loaded
