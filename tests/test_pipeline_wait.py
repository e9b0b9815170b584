"""`ReplicaPipeline.wait`, the producer's wait for room in its real `StepQueue` (no thread of the pipeline's own:
the test plays the producer's wait and the IO thread's releases).

A producer that found the queue at its step lead waits for room for a whole
call (half the lead, at most `STEPS_AT_ONCE` steps): a release that frees
less does not wake it, one that frees that much does at once. When no such
room came within a wait (`WAIT_S`), it makes what fits.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
from logical_helpers import MappedDocs, make_manifest, make_spec

from sluice.loaderd.logical import Plan
from sluice.loaderd.physical import pipeline, producer
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.physical.producer import STEPS_AT_ONCE
from sluice.loaderd.physical.stepqueue import StepEntry

LEAD = 16


def _full_pipeline(max_bytes: int = 1 << 30) -> ReplicaPipeline:
    """A pipeline whose queue holds steps 0 .. LEAD - 1 (16 bytes each), none received yet; its loop past step
    LEAD - 1."""
    plan = Plan(make_manifest([("a", [40, 25], "1", "repeat")], seq_len=8),
                make_spec(lanes=2, global_batch=2, micro_batch=1))
    p = ReplicaPipeline(plan=plan, replica=0, replicas=1, docs=MappedDocs(plan, 12), state=plan.initial_state(),
                        max_bytes=max_bytes, lead_steps=LEAD, notify=lambda replica: None)
    for step in range(LEAD):
        p.queue.put(StepEntry(step=step, micros=[{"input_ids": np.zeros((1, 4), "<i4")}], samples=[[]],
                              state={"step": step}, nbytes=16, created=time.monotonic(), delivered=[set()]))
    p.loop.state, p.loop.fresh = types.SimpleNamespace(step=LEAD - 1), False
    return p


def _receive(p: ReplicaPipeline, steps: range) -> None:
    """The IO thread: `steps` received by the one peer, released (waking the producer if it now has room)."""
    with p.queue.cond:
        for step in steps:
            p.queue.entries[step].delivered[0].add(b"peer")
        p.queue.release_upto(1)


def _waiting(p: ReplicaPipeline) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append((p.wait(p.loop), time.monotonic())), daemon=True)
    t.start()
    while p.queue.waiting_for is None:  # (set under the lock before its first wait)
        time.sleep(0.001)
    return t, got


def test_a_producer_at_its_lead_wakes_for_room_for_a_whole_call_not_for_one_step(monkeypatch):
    monkeypatch.setattr(pipeline, "WAIT_S", 30.0)  # (only a release can end the wait here)
    p = _full_pipeline()
    refill = min(STEPS_AT_ONCE, LEAD // 2)
    t, got = _waiting(p)
    _receive(p, range(1))
    t.join(0.3)
    assert not got, "woken by a release that made room for one step"
    _receive(p, range(1, refill))
    t.join(10)
    assert got and got[0][0][2] == refill, got  # (epoch, state, room): the room for a whole call


def test_with_room_for_part_of_a_call_only_it_makes_what_fits_after_its_wait(monkeypatch):
    monkeypatch.setattr(pipeline, "WAIT_S", 0.3)
    p = _full_pipeline()
    t, got = _waiting(p)
    start = time.monotonic()
    _receive(p, range(2))
    t.join(10)
    assert got and got[0][0][2] == 2, got
    assert got[0][1] - start >= 0.25  # (not at the release: at the end of its wait)


def test_a_call_makes_no_more_steps_than_the_byte_bound_has_room_for(monkeypatch):
    """The byte bound, not only the step lead, sizes a call: room for 2 more steps of the last one's size (16
    bytes) under it gives a call of 2, where the lead left room for a whole call; so a call of large steps passes
    `--queue-bytes` by about one step at most, not by up to STEPS_AT_ONCE - 1."""
    monkeypatch.setattr(pipeline, "WAIT_S", 30.0)
    refill = min(STEPS_AT_ONCE, LEAD // 2)
    p = _full_pipeline(max_bytes=16 * (LEAD - refill) + 40)  # (held: 16 steps, 256 bytes, over the bound)
    t, got = _waiting(p)
    _receive(p, range(refill))  # (8 steps held: 128 bytes, room for 2 more of 16 under 168)
    t.join(10)
    assert got and got[0][0][2] == 2, got
    assert p.queue.steps_in_bytes() == 2
    p.queue.entries.clear()
    assert p.queue.steps_in_bytes() > LEAD  # (an empty queue admits a call whatever its size)


def test_a_call_of_large_steps_stays_within_call_bytes_and_the_wait_is_for_that_call(monkeypatch):
    """A call's block of rows stays within `CALL_BYTES` at the last step's size: steps of a third of it make calls
    of 3 (and the producer at its lead waits for room for 3, not for half the lead), however large the lead or
    the queue's byte bound; before its first step (its size unknown) a call is of `STEPS_AT_ONCE`."""
    monkeypatch.setattr(pipeline, "WAIT_S", 30.0)
    monkeypatch.setattr(producer, "CALL_BYTES", 48)
    p = _full_pipeline()
    assert producer.steps_a_call(p.queue.step_nbytes) == 3
    t, got = _waiting(p)
    _receive(p, range(2))
    t.join(0.3)
    assert not got, "woken by a release that made room for less than a call"
    _receive(p, range(2, 3))
    t.join(10)
    assert got and got[0][0][2] == 3, got  # (epoch, state, room): the room of a call of CALL_BYTES
    _receive(p, range(3, LEAD))  # (the whole lead free: still a call of 3)
    assert p.wait(p.loop)[2] == 3
    assert producer.steps_a_call(0) == STEPS_AT_ONCE
