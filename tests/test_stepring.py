"""The shared-memory step ring of `loaderd --producer process` (stepring.py), without a daemon.

The allocator keeps live slots disjoint and inside the ring through any
sequence of steps and releases, wraps to the ring's start, and uses the whole
ring when the steps need it; a step written by one side reads back the same on
the other (a real memfd, mapped twice); a notice that does not describe a slot
inside the ring is refused with a ProtocolError naming the step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from sluice import batcharrays
from sluice.errors import ProtocolError
from sluice.loaderd.physical import stepring


def check(ring: stepring.Ring) -> None:
    spans = sorted((lo, hi) for _, lo, hi in ring.live)
    assert all(0 <= lo < hi <= ring.size for lo, hi in spans), spans
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"slots overlap: {spans}"
    assert ring.used == sum(hi - lo for lo, hi in spans)
    assert all(lo % stepring.ALIGN == 0 for lo, _ in spans)


def test_slots_stay_disjoint_inside_the_ring_through_random_steps_and_releases():
    rnd = random.Random(7)
    ring = stepring.Ring(64 * 1024)
    step, floor, placed = 0, 0, 0
    for _ in range(20_000):
        if rnd.random() < 0.55:
            if ring.alloc(step, rnd.choice((100, 3000, 7000, 20_000))) is not None:
                step += 1
                placed += 1
        else:
            floor = min(step, floor + rnd.randint(0, 2))
            ring.free_below(floor)
        check(ring)
        assert [s for s, _, _ in ring.live] == list(range(floor, step))
    assert placed > 5000


def test_the_ring_wraps_to_its_start_and_fills_up_to_its_size():
    ring = stepring.Ring(10 * 1024)
    offs = [ring.alloc(s, 1024) for s in range(10)]
    assert offs == [s * 1024 for s in range(10)]
    assert ring.alloc(10, 1024) is None  # full: the child waits for the daemon's release
    ring.free_below(2)
    assert ring.alloc(10, 1024) == 0 and ring.alloc(11, 1024) == 1024  # wrapped into the freed start
    assert ring.alloc(12, 64) is None
    ring.free_below(10)  # all but the two wrapped slots released
    assert ring.alloc(12, 8 * 1024) == 2048  # the whole rest of the ring, when a step needs it
    assert ring.alloc(13, 1) is None
    ring.clear()  # a RESET
    assert ring.used == 0 and ring.alloc(14, 10 * 1024) == 0
    assert stepring.Ring(1024).alloc(0, 1025) is None  # larger than the ring: never placed (sent as frames)


def test_the_touched_extent_stays_near_the_live_bytes_in_a_steady_lead():
    ring = stepring.Ring(256 << 20)
    for s in range(10_000):
        assert ring.alloc(s, 200_000) is not None
        ring.free_below(s - 7)  # 8 steps ahead of the consumer
    assert max(hi for _, _, hi in ring.live) <= 10 * 200_064


def micros(rng: np.random.Generator, rows: int, seq: int, docs: list[int]) -> list[dict[str, np.ndarray]]:
    out = []
    for n in docs:  # every declared array (sluice/batcharrays.py): the packer's, then the derived ones
        m = batcharrays.packer_micro(rng.integers(0, 50_000, (len(batcharrays.PLANES), rows, seq), dtype=np.int32),
                                     np.sort(rng.integers(0, rows * seq, n, dtype=np.int32)))
        batcharrays.complete(m, None)
        out.append(m)
    return out


@pytest.fixture()
def shared():
    """The ring mapped twice, as the child and the daemon map it (one memfd)."""
    import os

    size = 1 << 20
    fd = stepring.create_memory(size + stepring.CONTROL_BYTES)
    child = stepring.map_memory(fd, size + stepring.CONTROL_BYTES)
    daemon = stepring.map_memory(fd, size + stepring.CONTROL_BYTES)
    os.close(fd)
    yield child, daemon, size


def test_a_step_written_by_the_child_reads_back_the_same_in_the_daemon(shared):
    child, daemon, size = shared
    rng = np.random.default_rng(3)
    ms = micros(rng, 4, 128, [3, 1, 7])
    samples = [b'["a:1","a:2"]', b"[]", b'["b:9"]']
    state = b'{"lanes":{"0":{"x":1}},"step":5}'
    need = stepring.slot_bytes(ms, samples, state)
    counts = [((0, 300), (1, 84)), (), ((1, 4 * 128),)]
    notice = stepring.write_step(child, 4096, epoch=2, step=5, micros=ms, samples=samples, state=state, counts=counts)
    epoch, step, nbytes, got, got_samples, got_state, got_counts = stepring.read_step(notice, daemon, size, 2)
    assert (epoch, step, nbytes, got_state, got_counts) == (2, 5, need, state, counts)
    assert [bytes(s) for s in got_samples] == samples
    for a, b in zip(ms, got, strict=True):
        assert list(b) == list(batcharrays.NAMES)
        for k in a:
            assert b[k].dtype == a[k].dtype and np.array_equal(a[k], b[k])
    assert stepring.writable(ms)
    assert not stepring.writable([{**ms[0], "labels": ms[0]["labels"].astype(np.int64)}])


def test_notices_that_do_not_describe_a_slot_in_the_ring_are_refused(shared):
    child, daemon, size = shared
    ms = micros(np.random.default_rng(4), 2, 64, [2])
    good = stepring.write_step(child, 0, epoch=0, step=9, micros=ms, samples=[b"[]"], state=b"{}")
    head = stepring.HEAD.unpack_from(good)

    def with_head(**change) -> bytes:
        fields = dict(zip(("magic", "n", "epoch", "step", "offset", "nbytes", "seq", "state_len"), head))
        fields.update(change)
        return stepring.HEAD.pack(*fields.values()) + good[stepring.HEAD.size:]

    cases = {
        "shorter than its": good[:10],
        "is malformed": good[:-1],
        "outside the": with_head(offset=size - 64),
        "misaligned": with_head(offset=8),
        "does not match its parts": with_head(nbytes=head[5] + 4),
        "runs past its": with_head(seq=10_000),
    }
    for expect, notice in cases.items():
        with pytest.raises(ProtocolError, match=expect):
            stepring.read_step(notice, daemon, size)
    with pytest.raises(ProtocolError, match="malformed"):
        stepring.read_step(with_head(n=0), daemon, size)
    # source counts: a source the manifest does not have, more tokens than the micro-batch holds
    for counts, sources in ([((2, 1),)], 2), ([((0, 2 * 64 + 1),)], 1):
        notice = stepring.write_step(child, 0, epoch=0, step=9, micros=ms, samples=[b"[]"], state=b"{}", counts=counts)
        with pytest.raises(ProtocolError, match="source counts"):
            stepring.read_step(notice, daemon, size, sources)


def test_the_floor_words_of_another_epoch_are_ignored(shared):
    child, daemon, size = shared
    words_c, words_d = stepring.control_words(child, size), stepring.control_words(daemon, size)
    words_d[stepring.FLOOR_WORD] = stepring.pack_floor(3, 123_456)
    word = int(words_c[stepring.FLOOR_WORD])
    assert stepring.unpack_floor(word, 3) == 123_456
    assert stepring.unpack_floor(word, 2) is None and stepring.unpack_floor(word, 4) is None
    assert stepring.unpack_floor(stepring.pack_floor(0x8003, 5), 3) == 5  # epochs compared modulo 2**15
