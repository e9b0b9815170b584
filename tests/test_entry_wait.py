"""A step waiting for an object whose worker says nothing is named in the daemon's log, never silent.

A reader of an `Entry` (the producer's `docs` callback) waits on the entry's
condition, which the object's one worker notifies at every transition (a chunk
written, mapped, failed, closed). A fetch or fill that hangs notified nothing
and the step waited without a word; now a reader that hears nothing for
`SAY_AFTER_S` logs which record of which object it waits for and how far the
fill got, again each time its wait doubles, and goes on waiting: the worker's
transition still ends the wait exactly as before.
"""

from __future__ import annotations

import logging
import threading
import time

from sluice.errors import SourceReadError
from sluice.loaderd.physical import entry as entry_mod
from sluice.loaderd.physical.entry import Entry

WHERE = "source 'web' object s3://bucket/web-0003.jsonl.zst (b3:9f2c)"


def _reader(e: Entry, record: int) -> tuple[threading.Thread, list]:
    got: list = []

    def read() -> None:
        try:
            got.append(e.doc(record))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


def test_a_wait_with_no_word_from_the_worker_is_named_and_doubles(monkeypatch, caplog):
    monkeypatch.setattr(entry_mod, "SAY_AFTER_S", 0.2)
    e = Entry(where=WHERE)
    with caplog.at_level(logging.WARNING, logger="sluice.loaderd"):
        t, got = _reader(e, 7)
        time.sleep(1.0)  # (warnings at 0.2, 0.4 and 0.8 s: the wait doubles between them)
        assert t.is_alive() and not got, "the reader stopped waiting without a transition"
        e.fail(SourceReadError("the fetch gave up"))  # the worker's transition ends the wait as before
        t.join(5)
    assert not t.is_alive() and isinstance(got[0], SourceReadError)
    said = [r.getMessage() for r in caplog.records if "a step has waited" in r.getMessage()]
    assert 2 <= len(said) <= 3, said
    assert all(f"for record 7 of {WHERE}" in m and "0 records ready" in m for m in said), said
    assert [m.split("waited ")[1].split(" s")[0] for m in said] == ["0.2", "0.4", "0.8"][:len(said)], said


def test_a_worker_that_makes_progress_keeps_the_reader_quiet(monkeypatch, caplog):
    monkeypatch.setattr(entry_mod, "SAY_AFTER_S", 0.3)
    e = Entry(where=WHERE)
    with caplog.at_level(logging.WARNING, logger="sluice.loaderd"):
        t, got = _reader(e, 5)
        for ready in range(1, 4):  # a chunk every 0.1 s: each one a word from the worker, none enough yet
            time.sleep(0.1)
            e.grow(ready)
        time.sleep(0.1)
        e.fail(SourceReadError("stopped by the test"))
        t.join(5)
    assert isinstance(got[0], SourceReadError)
    assert not [r for r in caplog.records if "a step has waited" in r.getMessage()]


def test_waiting_for_the_end_of_a_fill_is_named_too(monkeypatch, caplog):
    monkeypatch.setattr(entry_mod, "SAY_AFTER_S", 0.2)
    e = Entry(where=WHERE)
    done: list = []
    with caplog.at_level(logging.WARNING, logger="sluice.loaderd"):
        t = threading.Thread(target=lambda: done.append(e.wait_final()), daemon=True)
        t.start()
        time.sleep(0.5)
        e.close()
        t.join(5)
    assert done == [False]
    assert any(f"for the end of its fill of {WHERE}" in r.getMessage() for r in caplog.records)
