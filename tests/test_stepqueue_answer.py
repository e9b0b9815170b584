"""`StepQueue.answer`: a GET answered by the step queue itself, under its own lock (the server no longer
reaches into its lock and fields), and `undecided`, `figures`, `end_with`."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sluice.errors import WireError
from sluice.loaderd.physical.producer import terminal
from sluice.loaderd.physical.stepqueue import StepEntry, StepQueue
from sluice.wire import errorcodes


def _entry(step: int, micros: int = 2) -> StepEntry:
    arrays = [{"input_ids": np.zeros((1, 4), "<i4")} for _ in range(micros)]
    return StepEntry(step=step, micros=arrays, samples=[[] for _ in arrays], state={"step": step}, nbytes=32,
                     created=time.monotonic(), delivered=[set() for _ in arrays])


def test_a_get_is_sent_counted_and_its_step_released_once_every_micro_batch_is_received():
    q = StepQueue(1 << 20, 4)
    q.put(_entry(0))
    sent = []
    assert q.answer(0, 0, 3, ahead=6, peers=1, send=lambda e: sent.append(e.step) or b"a") is True and q.floor == 0
    # the step's last micro-batch: released
    assert q.answer(0, 1, 3, ahead=6, peers=1, send=lambda e: b"a") is True and q.floor == 1
    assert sent == [0] and q.figures().floor == 1 and q.figures().steps == 0
    with pytest.raises(WireError) as got:
        q.answer(0, 0, 3, ahead=6, peers=1, send=lambda e: b"a")
    assert got.value.code == errorcodes.E_OUT_OF_RANGE and "step 0 of replica 3" in str(got.value)


def test_an_observer_or_an_undelivered_reply_releases_nothing():
    q = StepQueue(1 << 20, 4)
    q.put(_entry(0, micros=1))
    assert q.answer(0, 0, 0, ahead=6, peers=1, send=lambda e: None) is True
    assert q.figures().steps == 1


def test_undecided_steps_wait_and_too_far_ones_are_refused():
    q = StepQueue(1 << 20, 4)
    assert q.undecided(2, 6) and q.answer(2, 0, 0, ahead=6, peers=1, send=lambda e: b"a") is False
    assert not q.undecided(6, 6)
    with pytest.raises(WireError) as got:
        q.answer(6, 0, 0, ahead=6, peers=1, send=lambda e: b"a")
    assert got.value.code == errorcodes.E_TOO_FAR_AHEAD


def test_the_terminal_entry_answers_every_later_step_and_is_put_once():
    q = StepQueue(1 << 20, 4)
    assert q.end_with(terminal(0, errorcodes.E_END, "step 0: end of stream"))
    assert not q.end_with(terminal(0, errorcodes.E_INTERNAL, "again"))
    got = []
    assert q.answer(3, 0, 0, ahead=6, peers=1, send=lambda e: got.append(e.error[0]) or None) is True
    assert got == [errorcodes.E_END] and not q.undecided(3, 6)


def test_release_notes_a_holding_and_releases_under_the_queues_own_lock():
    """What a RESTORE (parking.restore_peer) and a lapsed claim (apply_claims) ask, without the queue's lock."""
    q = StepQueue(1 << 20, 4)
    q.put(_entry(0))
    assert q.release(1) == 0  # nobody received step 0
    assert q.release(1, (b"restored", (0, 1))) == 1 and q.figures().floor == 1  # a peer that holds all of it
