"""The daemon's garbage collector: start-up heap frozen, every pause exported (sluice/loaderd/physical/gcpause.py).

Specification: a collection holds the GIL and so stops the IO thread; the
daemon freezes what its start-up allocated (`gc.freeze`) before its producers
run, and exports each collection's duration by generation as
``sluice_gc_pause_seconds`` and the frozen count as ``sluice_gc_frozen_objects``.
The hook that records pauses takes no lock and keeps a bounded number.
"""

from __future__ import annotations

import gc
import time

from loaderd_support import Daemon, build_corpus, scrape

from sluice.loaderd.physical import gcpause
from sluice.loaderd.physical.gcpause import GcPauses


def test_every_collection_is_recorded_by_generation_and_drained_into_the_histogram():
    pauses = GcPauses().start()
    try:
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.stop()
    before = pauses.recorded
    gc.collect()  # after stop: not recorded
    assert pauses.recorded == before >= 2
    seen: dict[int, list[float]] = {}

    class Hist:
        def __init__(self, g: int) -> None:
            self.g = g

        def observe(self, v: float) -> None:
            seen.setdefault(self.g, []).append(v)

    assert pauses.drain(Hist) == before
    assert 2 in seen and 1 in seen and all(v >= 0 for vs in seen.values() for v in vs)
    assert pauses.drain(Hist) == 0 and pauses.dropped == 0


def test_pauses_past_the_bound_are_dropped_oldest_first_and_counted(monkeypatch):
    monkeypatch.setattr(gcpause, "KEPT", 3)
    pauses = GcPauses()  # made after the patch: the deque takes KEPT at construction
    for i in range(5):
        pauses._hook("start", {"generation": 0})
        pauses._hook("stop", {"generation": i % 3})
    assert pauses.recorded == 5 and pauses.dropped == 2
    got: list[int] = []
    pauses.drain(lambda g: type("H", (), {"observe": lambda self, v: got.append(g)})())
    assert got == [2, 0, 1] and pauses.dropped == 2


def test_the_daemon_freezes_its_start_up_heap_and_exports_its_pauses(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file)
    with Daemon(root, cache=tmp_path / "cache", extra=("--metrics-port", "0", "--lead-steps", "3")) as d:
        c = d.client(0, 1)
        for mb in c:
            if mb["step"] == 3:
                break
        port = d.info["metrics_port"]
        deadline = time.monotonic() + 20
        while True:
            m = scrape(port)
            pauses = sum(m.get("sluice_gc_pause_seconds_count", {}).values())
            if pauses > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        c.close()
    assert sum(m["sluice_gc_frozen_objects"].values()) > 1000, m["sluice_gc_frozen_objects"]
    assert pauses > 0, "no collection recorded while the daemon produced and served 4 steps"
    assert {labels for labels in m["sluice_gc_pause_seconds_count"]} >= {(("generation", "0"),)}
