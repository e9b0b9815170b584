"""The arena end to end: a real daemon's producer writes its blocks into shared memory and its ipc:// clients read
them there (loaderd/arena.py, client/arena.py; docs/loaderd.md, "The arena").

The stream is the plan's with the arena and without it; a trainer that writes
into its batches and keeps some still reads the plan's stream (its writes are
its own, and dropped before a slot comes back); a client killed while it holds
batches gives its slots back; a tcp client has no arena; the arena's file is
gone once the daemon is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from loaderd_support import Daemon, assert_the_plans_stream, build_corpus, take_until

from sluice.client.arena import available
from sluice.wire import ring as wire_ring

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (os.path.isdir("/dev/shm") and available() and wire_ring.own_process()),
                                 reason="needs /dev/shm and /proc/self/pagemap (Linux)")]

STEPS = 60


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("arena"), "sltok", tokenizer_file, docs=300, lanes=4,
                        global_batch=8, micro_batch=4, seq_len=64)


def arena_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sluice-ring-") and "-arena-" in n}


def test_a_client_reads_its_batches_where_the_producer_wrote_them_and_the_stream_is_the_plans(corpus, aot_kernel):
    before = arena_files()
    with Daemon(corpus, cache=corpus / "cache-arena") as d:
        assert len(arena_files() - before) == 1
        c = d.client(credits=4)
        batches = take_until(c, STEPS)
        stats = c.stats()
        c.close()
    with Daemon(corpus, cache=corpus / "cache-arena", extra=("--arena", "off")) as d:
        c = d.client(credits=4)
        plain = take_until(c, STEPS)
        off = c.stats()["arena"]
        c.close()
    arena, rings = stats["arena"], stats["rings"]
    # the first steps are Plan.step's (the kernel loads after the run's first call): their blocks are the heap's
    assert arena["enabled"] and arena["batches"] >= 2 * (STEPS - 20) and arena["heap"] == {"full": 0, "too_large": 0}
    assert arena["batches"] + rings["batches"] >= 2 * STEPS and arena["refused"] == {}, stats
    assert off == {"enabled": False, "why": "off"}
    assert_the_plans_stream(corpus, batches, 2)
    assert_the_plans_stream(corpus, plain, 2)
    assert arena_files() <= before


def test_a_trainer_that_writes_into_its_batches_and_keeps_some_reads_the_plans_stream(corpus, aot_kernel):
    """Labels masked in place, every third batch kept (a trainer's logging): each batch as received is the
    plan's; kept batches pin their slots, and a block that finds none free is made on the heap (counted)."""
    kept: list = []

    def use(mb) -> None:
        mb["labels"][:] = -100
        mb["input_ids"][0] = 0
        if len(kept) < 40 and mb["step"] % 3 == 0:
            kept.append(mb)

    with Daemon(corpus, cache=corpus / "cache-arena") as d:
        c = d.client(credits=4)
        batches = take_until(c, 2 * STEPS, then=use)
        arena = c.stats()["arena"]
        c.close()
    assert arena["batches"] >= 2 * STEPS, arena
    assert_the_plans_stream(corpus, batches, 2)
    assert all((k["labels"] == -100).all() for k in kept)  # (a kept batch keeps what its trainer wrote)


CHILD = """
import sys, time
from sluice.client import Client
c = Client(sys.argv[1], 0, 1, run_id=sys.argv[2], dataset_id=sys.argv[3], as_numpy=True, credits=4)
held = [mb for _, mb in zip(range(40), c)]
print("held", len(held), flush=True)
time.sleep(120)
"""


def test_a_client_killed_while_it_holds_batches_gives_their_slots_back(corpus, aot_kernel):
    with Daemon(corpus, cache=corpus / "cache-arena", extra=("--request-ttl", "600")) as d:
        child = subprocess.Popen([sys.executable, "-c", CHILD, d.endpoint, d.info["run_id"], d.info["dataset_id"]],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().startswith("held 40")
            probe = d.client(replica=0, credits=1, ring=False)  # (STATS only: it takes no batch)
            held = probe.stats()["arena"]
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            deadline = time.monotonic() + 15
            while (now := probe.stats()["arena"])["leases"] and time.monotonic() < deadline:
                time.sleep(0.25)
            probe.close()
        finally:
            child.kill()
            child.wait()
    assert held["leases"] >= 20, held
    assert now["leases"] == 0 and now["reaped"] == 1, now


def test_a_tcp_client_has_no_arena(corpus):
    with Daemon(corpus, cache=corpus / "cache-tcp", endpoint="tcp://127.0.0.1:0", token="arena" + "7" * 27) as d:
        c = d.client()
        take_until(c, 3)
        arena = c.stats()["arena"]
        c.close()
    assert arena == {"enabled": False, "why": "not_ipc_or_no_shm"}
