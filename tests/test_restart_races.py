"""Daemon restarts at awkward moments: the stream stays exact, nothing is refused spuriously.

Real loaderd processes (kill -9, restarted at the same endpoint with the same
fencing state), real clients; `fault_proxy.FaultProxy` (a real ZeroMQ relay)
places a kill at an exact point of a RESTORE.

* A client that already holds its next steps reads them through a daemon
  restart without reconnecting; it reconnects (and RESTOREs) at the first
  step it lacks. So "every rank reconnected" is no contract: a rank whose
  batches were all delivered before the kill never needs the new daemon.
* A RESTORE cut off by a kill -9 (before the daemon read it, or after it acted
  on it but before the reply) is retried on the restarted daemon and lands
  exactly once: one generation step, the stream exact.
* Replicas restoring a checkpoint under a new generation, one after the
  other: what the old generation's readers were sent never counts for the new
  one (the second RESTORE finds the generation already raised by the first).
* Two clients of one replica (tensor-parallel peers, `peers=2`), one a step
  ahead of the other when the daemon dies, RESTORE different states on the
  restarted daemon in either order: both get the same exact stream, neither is
  refused.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from fault_proxy import FaultProxy
from loaderd_support import Daemon, reference
from sluice.client import Client
from sluice.wire import protocol
from test_loaderd import check_equal, corpora, take  # noqa: F401  (corpora: a module-scoped fixture)

pytestmark = pytest.mark.slow  # each test kills and restarts daemons


def _daemon(root, endpoint, state, replicas: int = 1) -> Daemon:
    return Daemon(root, replicas=replicas, endpoint=endpoint, cache=root / "cache",
                  extra=("--state-dir", str(state))).start()


def _generation(d: Daemon) -> int:
    with d.client(0, 1) as c:
        return int(c.stats()["generation"])


def _client(d: Daemon, endpoint: str, **kw) -> Client:
    kw.setdefault("as_numpy", True)
    return Client(endpoint, kw.pop("replica", 0), kw.pop("replicas", 1), run_id=d.info["run_id"],
                  dataset_id=d.info["dataset_id"], timeout_s=1.0, reconnect_s=60.0, max_wait_s=60.0, **kw)


def test_held_steps_are_read_through_a_restart_and_the_first_missing_one_reconnects(corpora, tmp_path, caplog):
    root = corpora("jsonl.zst")
    ref = reference(root, 10, 1)
    endpoint, state = f"ipc://{tmp_path}/ld.sock", tmp_path / "state"
    d = _daemon(root, endpoint, state)
    c = _client(d, endpoint, credits=8)
    try:
        got = take(c, 3)  # steps 0..2; GETs for step 3 and 3 micro-batches of step 4 are in flight
        mps = c.info["micro_per_step"]
        assert c.credits == 2 * mps
        deadline = time.monotonic() + 30
        while c.stats()["replicas"]["0"]["floor_step"] < 4:  # all of step 3 was sent to the client
            assert time.monotonic() < deadline, "the daemon never served step 3"
            time.sleep(0.05)
        d.kill9()
        d = _daemon(root, endpoint, state)
        # A COMMIT meets the restarted daemon: advisory, not delivered (and said why), no reconnect either.
        with caplog.at_level(logging.WARNING, logger="sluice.client"):
            assert c.commit(2) is None
        assert f"COMMIT of step 2 not delivered (loaderd at {endpoint} restarted: instance" in caplog.text
        got += take(c, 1)  # step 3 came from the killed daemon's replies
        assert c.reconnects == 0
        got += take(c, 3)  # step 4 is not whole here: one reconnect, RESTORE, the same stream
        assert c.reconnects == 1
        assert [(b["step"], b["micro"]) for b in got] == [(s, m) for s in range(7) for m in range(mps)]
        check_equal(got, ref, 0, mps)
    finally:
        c.close()
        d.stop()


@pytest.mark.parametrize("cut", ["before-the-daemon-reads-it", "after-the-daemon-applied-it"])
def test_a_restore_cut_by_kill9_is_retried_and_lands_once(corpora, tmp_path, cut):
    root = corpora("parquet")
    ref = reference(root, 9, 1)
    endpoint, state = f"ipc://{tmp_path}/ld.sock", tmp_path / "state"
    d = _daemon(root, endpoint, state)
    try:
        with FaultProxy(endpoint) as proxy:
            first = _client(d, proxy.endpoint)
            take(first, 4)
            saved = first.state_dict()  # the checkpoint: the state after step 3
            first.close()
            before = _generation(d)

            trainer = _client(d, proxy.endpoint)
            trainer.resume_contract  # noqa: B018 - connect (HELLO) now, so the next exchange is the RESTORE
            if cut == "before-the-daemon-reads-it":
                proxy.hold(protocol.RESTORE)
                event = proxy.held
            else:
                proxy.drop_reply(protocol.RESTORE)
                event = proxy.dropped
            errors: list[BaseException] = []

            def restore() -> None:
                try:
                    trainer.load_state_dict(saved)  # RESTORE under the generation after the daemon's
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    errors.append(exc)

            t = threading.Thread(target=restore)
            t.start()
            assert event.wait(30), f"the RESTORE never reached the proxy ({cut})"
            d.kill9()
            if cut == "after-the-daemon-applied-it":
                assert _generation_on_disk(d, state) == before + 1  # durable before the lost reply
            d = _daemon(root, endpoint, state)
            t.join(90)
            assert not t.is_alive() and not errors, errors
            assert trainer.restore_retries >= 1
            got = take(trainer, 5)
            mps = trainer.info["micro_per_step"]
            assert [(b["step"], b["micro"]) for b in got] == [(s, m) for s in range(4, 9) for m in range(mps)]
            check_equal(got, ref, 0, mps)
            # exactly once: one generation step over the checkpoint's daemon, whichever side of the kill it landed
            assert trainer.generation == before + 1 == _generation(d)
            trainer.close()
    finally:
        d.stop()


def _generation_on_disk(d: Daemon, state) -> int:
    """The generation a restarted daemon will read from the fencing state."""
    from sluice.loaderd.fencing import FenceStore

    store = FenceStore(state, d.info["run_id"], d.info["dataset_id"])
    try:
        return store.generation()
    finally:
        store.close()


@pytest.mark.parametrize("how", ["ahead-reconnects-first", "ahead-restores-first", "behind-restores-first"])
def test_tensor_parallel_peers_one_step_apart_restore_on_a_restarted_daemon(corpora, tmp_path, how):
    root = corpora("jsonl.zst")
    total = 16  # past the daemon's prefetch lead (8 steps): a step held for a peer that never asks would stall it
    ref = reference(root, total, 1)
    endpoint, state = f"ipc://{tmp_path}/ld.sock", tmp_path / "state"
    d = _daemon(root, endpoint, state)
    # One GET in flight each, so what each client holds at the kill is known: one micro-batch past its last step.
    ahead, behind = _client(d, endpoint, peers=2, credits=1), _client(d, endpoint, peers=2, credits=1)
    try:
        got = {"ahead": take(ahead, 3), "behind": take(behind, 3)}
        got["ahead"] += take(ahead, 1)  # ahead completed step 3, behind step 2
        generation = ahead.generation
        d.kill9()
        d = _daemon(root, endpoint, state)
        order = [("behind", behind), ("ahead", ahead)] if how.startswith("behind") else [
            ("ahead", ahead), ("behind", behind)]
        for name, c in order:
            if how.endswith("reconnects-first"):  # the client's own path: silence, probe, RESTORE, then a step
                got[name] += take(c, 1)
                assert c.reconnects == 1, name
            else:  # both RESTOREs (what a reconnect sends: its own state, its generation) before any GET
                c.fence(generation)
                c.load_state_dict(c.state_dict())
        results: dict[str, list] = {}
        errors: list[BaseException] = []

        def run(name: str, c: Client) -> None:
            try:
                last = got[name][-1]["step"]
                results[name] = take(c, total - 1 - last)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=pair) for pair in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        mps = ahead.info["micro_per_step"]
        for name, c in order:
            stream = got[name] + results[name]
            assert [(b["step"], b["micro"]) for b in stream] == [(s, m) for s in range(total) for m in range(mps)], name
            check_equal(stream, ref, 0, mps)
            assert c.generation == generation  # no new generation: nobody was fenced
    finally:
        ahead.close()
        behind.close()
        d.stop()


def test_replicas_restoring_a_new_generation_one_after_the_other_count_no_old_deliveries(corpora, tmp_path):
    root = corpora("jsonl.zst")
    ref = reference(root, 6, 2)
    endpoint, state = f"ipc://{tmp_path}/ld.sock", tmp_path / "state"
    d = _daemon(root, endpoint, state, replicas=2)
    try:
        saved = []
        for r in (0, 1):  # the first trainer read steps 0..5 of each replica, checkpointed step 2
            with _client(d, endpoint, replica=r, replicas=2) as old:
                take(old, 6)
                saved.append(old.state_dict_at(2))
                generation = old.generation + 1
        for r in (0, 1):  # its successor restores the checkpoint, replica by replica, under one new generation
            with _client(d, endpoint, replica=r, replicas=2) as new:
                new.fence(generation)
                new.load_state_dict(saved[r])
                got = take(new, 3)
                mps = new.info["micro_per_step"]
                assert [(b["step"], b["micro"]) for b in got] == [(s, m) for s in range(3, 6) for m in range(mps)]
                check_equal(got, ref, r, mps)
    finally:
        d.stop()
