"""A replica's producer thread stopped by a bug: its stream ends there with an INTERNAL error, at once.

Every step's own failure is already that step's terminal entry (`StepMaker`).
A bug outside a step (handing the entries over, the kernel's start rule) used
to end the thread silently: the GETs for the next step waited for the client's
`max_wait_s` (15 minutes by default). Now the pipeline ends the stream at the
step after the last one made, logs the traceback, says why in STATS
(`failed`), and a RESTORE ends at once again (no thread makes steps any more).
"""

from __future__ import annotations

import logging
import time

from logical_helpers import MappedDocs, make_manifest, make_spec

from sluice.loaderd.logical import Plan
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.wire import errorcodes


def _pipeline() -> tuple[Plan, ReplicaPipeline]:
    plan = Plan(make_manifest([("a", [40, 25], "1", "repeat")], seq_len=8),
                make_spec(lanes=2, global_batch=2, micro_batch=1))
    return plan, ReplicaPipeline(plan=plan, replica=0, replicas=1, docs=MappedDocs(plan, 12),
                                 state=plan.initial_state(), max_bytes=1 << 30, lead_steps=16,
                                 notify=lambda replica: None)


def _answer(p: ReplicaPipeline, step: int, within_s: float = 10.0):
    """What the IO thread would send for (step, micro 0): the entry, once decided; AssertionError past `within_s`."""
    got: list = []
    deadline = time.monotonic() + within_s
    while not p.queue.answer(step, 0, 0, ahead=16, peers=1, send=lambda e: got.append(e) or None):
        assert time.monotonic() < deadline, f"step {step} still undecided after {within_s} s"
        time.sleep(0.005)
    return got[0]


def test_a_bug_that_stops_the_producer_ends_the_stream_with_an_internal_error_at_once(caplog):
    plan, p = _pipeline()
    calls = []
    real = p.loop._hand_over

    def hand_over(epoch, made, after):
        calls.append(len(made))
        if len(calls) == 2:
            raise RuntimeError("injected: a bug while handing a call's entries over")
        real(epoch, made, after)

    p.loop._hand_over = hand_over
    with caplog.at_level(logging.ERROR, logger="sluice.loaderd"):
        p.start()
        try:
            first = _answer(p, 0)
            assert first.error is None and first.micros  # (the first call's one step was handed over)
            started = time.monotonic()
            ended = _answer(p, 1)
            assert time.monotonic() - started < 5.0
            code, message, _ = ended.error
            assert code == errorcodes.E_INTERNAL
            assert "step 1" in message and "replica 0 stopped" in message and "RuntimeError" in message, message
            assert _answer(p, 5).error == ended.error  # (later steps share the terminal's error)
            assert p.failed is not None and "injected" in p.failed
            assert any("the producer of replica 0 stopped" in r.getMessage() and r.exc_info for r in caplog.records)
            # a RESTORE cannot bring a stopped thread back: the restored stream ends at once, at its first step
            p.reset(plan.initial_state())
            assert _answer(p, 0, within_s=1.0).error[0] == errorcodes.E_INTERNAL
        finally:
            assert p.stop(5.0)


def test_a_producer_that_runs_says_nothing_failed():
    _, p = _pipeline()
    p.start()
    try:
        assert _answer(p, 0).error is None
        assert _answer(p, 1).error is None
        assert p.failed is None
    finally:
        assert p.stop(5.0)
