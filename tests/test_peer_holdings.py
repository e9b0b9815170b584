"""StepQueue holdings: a micro-batch counts as received by a peer that was sent it or already holds it."""

from __future__ import annotations

from sluice.loaderd.physical.stepqueue import StepEntry, StepQueue


def _queue(steps: range, micros: int = 2) -> StepQueue:
    q = StepQueue(max_bytes=1 << 20, max_steps=16)
    q.floor = steps.start
    for s in steps:
        q.put(StepEntry(step=s, micros=[{}] * micros, samples=[], state=None, nbytes=1, created=0.0,
                        delivered=[set() for _ in range(micros)]))
    return q


def test_a_step_waits_for_every_peer_and_a_holding_stands_in_for_a_delivery():
    q = _queue(range(3, 6))
    q.cond.acquire()  # the queue's methods run under its condition
    for m in range(2):
        q.entries[3].delivered[m].add(b"behind")
    assert q.release_upto(2) == 0 and q.floor == 3  # one of two peers got step 3
    q.hold(b"ahead", (3, 1))  # the other restored the state after step 3: it holds all of step 3
    assert q.release_upto(2) == 1 and q.floor == 4
    q.entries[4].delivered[0].add(b"behind")
    q.hold(b"ahead", (4, 0))  # a holding of micro 0 only does not complete step 4
    assert q.release_upto(2) == 0 and q.floor == 4
    q.hold(b"ahead", (2, 1))  # holdings never go back
    assert q.holders[b"ahead"] == (4, 0)


def test_before_a_reset_what_was_sent_becomes_holdings_within_one_generation_only():
    q = _queue(range(4, 6))
    q.entries[4].delivered[0].add(b"ahead")
    q.entries[4].delivered[1].add(b"ahead")
    q.entries[5].delivered[0].add(b"ahead")
    q.keep_holdings(3)  # the first RESTORE of generation 3: nothing sent before it counts
    assert q.holders == {}
    q.hold(b"behind", (2, 1))
    q.keep_holdings(3)  # a second RESTORE of generation 3 resets the replica: what was sent is kept
    assert q.holders == {b"behind": (2, 1), b"ahead": (5, 0)}
    q.keep_holdings(4)  # a new generation: its clients hold nothing of the old one's stream
    assert q.holders == {}


def test_a_terminal_error_is_never_released():
    q = _queue(range(0, 1))
    q.entries[0].error = ("OBJECT", "corrupt", {})
    q.hold(b"a", (0, 1))
    q.hold(b"b", (0, 1))
    assert q.release_upto(2) == 0
