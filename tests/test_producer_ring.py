"""`loaderd --producer process` across its shared-memory ring (stepring.py), end to end.

Real daemons, real producer processes, real sockets: a ring of a few steps
wraps around many times, fills up (the child waits for the daemon's release,
the queue stays within the byte bound) and is reset in the middle by a RESTORE,
and the stream still equals the plan; a step larger than the ring crosses as
frames; the ring is an anonymous memfd, so neither a killed child nor a killed
daemon leaves anything in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from test_loaderd import check_equal, take
from test_producer_death import copy, producer_child, pull_until_error

pytestmark = pytest.mark.slow  # a daemon and its producer processes each


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("ring"), "sltok", tokenizer_file)


def ring_mapped(pid: int) -> bool:
    """True if process `pid` maps the ring as an anonymous memfd (nothing in /dev/shm names it)."""
    with open(f"/proc/{pid}/maps") as f:
        return "/memfd:sluice-step-ring" in f.read()


def shm_names() -> set[str]:
    """sluice's names in /dev/shm (other programs, and multiprocessing's semaphores, come and go there)."""
    return {n for n in os.listdir("/dev/shm") if "sluice" in n} if os.path.isdir("/dev/shm") else set()


def wait_mapped(pid: int, timeout: float = 20.0) -> bool:
    """True once process `pid` maps the ring (a producer process maps it as it starts)."""
    deadline = time.monotonic() + timeout
    while not ring_mapped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_ring_of_a_few_steps_wraps_fills_and_restores_mid_ring_to_the_plan(corpus, tmp_path):
    ref = reference(corpus, 30, 1)
    with Daemon(corpus, cache=tmp_path / "cache",
                extra=("--producer", "process", "--queue-bytes", "20KiB", "--lead-steps", "8")) as d:
        c = d.client(0, 1)
        first = take(c, 20)
        mps = c.info["micro_per_step"]
        assert ring_mapped(d.pid) and ring_mapped(producer_child(d).pid)
        got = check_equal(first, ref, 0, mps)  # ~2 steps a ring: wrapped about ten times
        assert sorted(got) == list(range(20))
        time.sleep(1.0)  # the child runs ahead until the ring is full, then waits for a release
        replica = c.stats()["replicas"]["0"]
        assert replica["queued_bytes"] <= 20 * 1024 and replica["queued_steps"] < 8, replica
        c.load_state_dict(c.state_dict_at(13))  # back into steps the ring held: a RESET mid-ring
        again = take(c, 10)
        assert again[0]["step"] == 14
        assert sorted(check_equal(again, ref, 0, mps)) == list(range(14, 24))
        c.close()


def test_steps_larger_than_the_ring_cross_as_frames_to_the_same_stream(corpus, tmp_path):
    ref = reference(corpus, 8, 2)
    with Daemon(corpus, replicas=2, cache=tmp_path / "cache",
                extra=("--producer", "process", "--queue-bytes", "4KiB")) as d:
        for r in (0, 1):
            c = d.client(r, 2, samples=True)
            batches = take(c, 8)
            assert sorted(check_equal(batches, ref, r, c.info["micro_per_step"])) == list(range(8))
            first = [s for b in batches if b["step"] == 3 for s in b["samples"]]
            assert list(dict.fromkeys(first)) == ref[(3, r)][1]
            c.close()


def test_sample_ids_cross_the_ring_as_the_plan_has_them(corpus, tmp_path):
    ref = reference(corpus, 6, 1)
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--producer", "process")) as d:
        c = d.client(0, 1, samples=True)
        batches = take(c, 6)
        check_equal(batches, ref, 0, c.info["micro_per_step"])
        for step in range(6):
            ids = [s for b in batches if b["step"] == step for s in b["samples"]]
            assert list(dict.fromkeys(ids)) == ref[(step, 0)][1]
        c.close()


def test_a_child_killed_while_writing_leaves_only_whole_steps_and_no_shm(corpus, tmp_path):
    before = shm_names()
    with Daemon(corpus, cache=tmp_path / "cache",
                extra=("--producer", "process", "--queue-bytes", "20KiB", "--lead-steps", "8")) as d:
        c = d.client(0, 1)
        it = iter(c)
        got = [copy(next(it))]
        mps = c.info["micro_per_step"]
        got += [copy(next(it)) for _ in range(5 * mps - 1)]
        child = producer_child(d)
        # The child writes steps as fast as the ring frees (this client pulls on): killed mid-write or
        # mid-wait, what the daemon serves is whole steps, then the error naming the child.
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        rest, err, _ = pull_until_error(it)
        assert err.code == "INTERNAL" and f"pid {child.pid}" in str(err)
        batches = got + rest
        steps = sorted({b["step"] for b in batches})
        assert steps == list(range(len(steps)))
        ref = reference(corpus, len(steps), 1)
        for step, digest in stream_digests(batches, mps).items():
            assert digest == ref[(step, 0)][0], f"step {step} differs from the plan"
        c.close()
    assert shm_names() <= before, f"left in /dev/shm: {shm_names() - before}"


def test_a_killed_daemon_takes_its_producers_and_leaves_no_shm(corpus, tmp_path):
    before = shm_names()
    d = Daemon(corpus, replicas=2, cache=tmp_path / "cache", extra=("--producer", "process")).start()
    try:
        c = d.client(0, 2)
        take(c, 2)
        c.close()
        children = psutil.Process(d.pid).children()
        assert len(children) == 2 and all(wait_mapped(p.pid) for p in children)
        d.kill9()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"producer processes outlived the daemon: {alive}"
    finally:
        d.stop()
    assert shm_names() <= before, f"left in /dev/shm: {shm_names() - before}"


def test_a_restore_on_a_new_daemon_reaches_the_starting_child_before_any_step(corpus, tmp_path):
    """A trainer resuming on a restarted daemon RESTOREs while the producer process starts: its RESET goes
    on the child's hello, and what is served from the restored state equals the plan."""
    ref = reference(corpus, 16, 1)
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--producer", "process")) as d:
        c = d.client(0, 1)
        take(c, 10)
        saved = c.state_dict_at(8)
        c.close()
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--producer", "process")) as d:
        c = d.client(0, 1)
        c.load_state_dict(saved)  # at once: the child is still starting
        again = take(c, 6)
        assert again[0]["step"] == 9
        assert sorted(check_equal(again, ref, 0, c.info["micro_per_step"])) == list(range(9, 15))
        c.close()


@pytest.fixture()
def pipeline(corpus):
    """A ProcessReplicaPipeline whose child is not started: the test plays the child on its steps socket."""
    import zmq

    from sluice.loaderd.logical import Plan
    from sluice.loaderd.physical.procpipe import ProcessReplicaPipeline
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    plan = Plan(load_manifest(corpus / "manifest.json"), load_runspec(corpus / "run.toml"))
    ctx = zmq.Context()
    p = ProcessReplicaPipeline(ctx=ctx, plan=plan, replica=0, replicas=1, state=plan.initial_state(),
                               max_bytes=1 << 20, lead_steps=4, child_args={})
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(p.steps_socket.getsockopt_string(zmq.LAST_ENDPOINT))
    yield p, push
    push.close(0)
    p.stop()
    ctx.term()


def deliver(p, push, frames) -> bool:
    push.send_multipart(frames)
    assert p.steps_socket.poll(5000), "the notice did not arrive"
    return p.receive()


@pytest.mark.parametrize("bad, expect", [
    ("outside", "lies outside the"),
    ("step", "where step 0 comes next"),
    ("state", "state is not JSON"),
    ("state-list", "state is not a JSON object"),
])
def test_a_notice_no_producer_sends_ends_the_stream_with_internal_naming_it(pipeline, bad, expect):
    import numpy as np

    from sluice import batcharrays
    from sluice.loaderd.physical import stepring

    p, push = pipeline
    ms = [batcharrays.packer_micro(np.zeros((len(batcharrays.PLANES), 2, 16), np.int32), np.array([0, 32], np.int32))]
    batcharrays.complete(ms[0], None)
    state = {"state": b"{not json", "state-list": b"[1,2]"}.get(bad, b'{"step": 0}')
    notice = stepring.write_step(p._ring, 0, epoch=0, step=3 if bad == "step" else 0, micros=ms, samples=[b"[]"],
                                 state=state)
    if bad == "outside":
        head = list(stepring.HEAD.unpack_from(notice))
        head[4] = p._ring_size  # the slot's offset: past the ring
        notice = stepring.HEAD.pack(*head) + notice[stepring.HEAD.size:]
    assert deliver(p, push, [notice])
    (entry,) = p.queue.entries.values()
    code, message, _ = entry.error
    assert code == "INTERNAL" and entry.step == 0 and expect in message and "producer process" in message
    good = stepring.write_step(p._ring, 0, epoch=0, step=0, micros=ms, samples=[b"[]"], state=b'{"step": 0}')
    assert not deliver(p, push, [good])  # nothing after the stream's terminal step
    assert list(p.queue.entries) == [0] and p.queue.entries[0].error is not None


def test_a_valid_notice_is_served_from_views_on_the_ring(pipeline):
    import numpy as np

    from sluice import batcharrays
    from sluice.loaderd.physical import stepring

    p, push = pipeline
    planes = np.arange(32, dtype=np.int32).reshape(2, 16) + np.arange(len(batcharrays.PLANES), dtype=np.int32)[:, None, None]
    ms = [batcharrays.packer_micro(planes, np.array([0, 5, 32], np.int32))]
    batcharrays.complete(ms[0], None)
    notices = [stepring.write_step(p._ring, off, epoch=0, step=s, micros=ms, samples=[b'["a:1"]'],
                                   state=b'{"step": %d}' % s) for s, off in ((0, 0), (1, 4096))]
    assert deliver(p, push, notices)  # one message, two steps
    assert list(p.queue.entries) == [0, 1] and p.next_step == 2
    e = p.queue.entries[1]
    assert e.borrowed and e.state == {"step": 1} and e.state_json == b'{"step": 1}'
    assert e.samples_json(0) == b'["a:1"]'
    for k in ms[0]:
        assert np.array_equal(e.micros[0][k], ms[0][k])
    assert not deliver(p, push, [stepring.write_step(p._ring, 8192, epoch=7, step=2, micros=ms, samples=[b"[]"],
                                                     state=b"{}")])  # another epoch's: dropped unread
