"""The arena's two ends in one process, over a real file under /dev/shm (loaderd/arena.py, client/arena.py).

A block is handed out only from a slot whose last block is gone in the daemon
and on which no client process holds a lease; a reference names where a
BATCH's frames lie and the client reads exactly those bytes; a client that
writes into its arrays changes only its own pages, and drops them before it
returns its lease, so the next block in that slot reads as the producer wrote
it; the leases of a process that is gone come back; nothing either side is
sent is taken on trust.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from sluice.client.arena import ClientArena, available
from sluice.errors import ProtocolError, WireError
from sluice.loaderd.arena import Arena, asked
from sluice.wire import ring as wire_ring

pytestmark = pytest.mark.skipif(not (os.path.isdir("/dev/shm") and os.access("/proc/self/pagemap", os.R_OK)
                                     and wire_ring.own_process()),
                                reason="needs /dev/shm and /proc/self/pagemap (Linux)")

ME = dict(zip(("pid", "start", "pidns"), wire_ring.own_process() or (0, 0, "")))
PLANE = (3, 4, 1024)  # a step's three planes of 4 rows: 48 KiB, 12 pages


@pytest.fixture
def arena():
    a = Arena(2, 2 * 3 * 4 * 1024 * 4)  # two slots of two steps
    yield a
    a.close()
    assert not os.path.exists(a.path)


def served(a: Arena, block: np.ndarray, j: int, who: bytes = b"c") -> tuple[bytes, np.ndarray]:
    """Step j's reference as the IO loop sends it: its three planes (views of the block) and a cu_seqlens."""
    cu = np.array([0, 5, 4096], dtype=np.int32)
    ref = a.ref(who, [block[j, 0], block[j, 1], block[j, 2], cu])
    assert ref is not None
    return ref, cu


def take(client: ClientArena, ref: bytes) -> list:
    got = wire_ring.parse_arena_ref(ref)
    assert got is not None and got[0] == client.id
    return client.take(got[1], got[2], got[3], ref, got[4])


def test_this_process_can_tell_the_pages_it_wrote_in_a_private_map_of_a_shared_file():
    """The client's probe (`available`): where /proc/self/pagemap is readable it says a page read from the file is
    the file's and a page written is this process's copy; else no client here would ask for the arena."""
    assert available()


def test_a_slot_is_handed_out_again_only_once_its_block_and_every_lease_on_it_are_gone(arena):
    assert arena.offer(b"c", ME) is not None
    first = arena.block((2, *PLANE), np.int32)
    second = arena.block((2, *PLANE), np.int32)
    assert first is not None and second is not None
    assert arena.block((2, *PLANE), np.int32) is None and arena.stats()["heap"]["full"] == 1
    assert arena.block((3, *PLANE), np.int32) is None and arena.stats()["heap"]["too_large"] == 1
    ref, _ = served(arena, first, 1)
    slot, turn = wire_ring.parse_arena_ref(ref)[1:3]
    del first
    gc.collect()
    assert arena.block((1, *PLANE), np.int32) is None  # the block is gone, but a lease holds its slot
    arena.release(b"c", [[slot, turn, 1]])
    again = arena.block((1, *PLANE), np.int32)
    assert again is not None and arena.stats()["leases"] == 0
    assert wire_ring.parse_arena_ref(served(arena, again, 0)[0])[1:3] == (slot, turn + 1)


def test_smaller_blocks_share_a_slot_on_whole_pages_and_it_opens_again_once_all_are_gone(arena):
    """Calls of fewer steps (a producer refilling its lead a few steps at a time) fill the open slot one after the
    other, each from a page of its own, at that slot's turn; the slot opens again only once every one is gone."""
    arena.offer(b"c", ME)
    small = (1, 3, 4, 100)  # 4,800 bytes: two pages
    a, b = arena.block(small, np.int32), arena.block(small, np.int32)
    ra, rb = served(arena, a, 0)[0], served(arena, b, 0)[0]
    (slot_a, turn_a, parts_a), (slot_b, turn_b, parts_b) = (wire_ring.parse_arena_ref(r)[1:4] for r in (ra, rb))
    assert (slot_a, turn_a) == (slot_b, turn_b) and parts_b[0][0] - parts_a[0][0] == 2 * os.sysconf("SC_PAGESIZE")
    arena.release(b"c", [[slot_a, turn_a, 2]])
    del a
    gc.collect()
    big = arena.block((2, *PLANE), np.int32)  # fills a slot: the other one (b is alive in the first)
    assert wire_ring.parse_arena_ref(served(arena, big, 0)[0])[1] != slot_a
    del b, big
    gc.collect()
    assert arena.stats()["free"] == 1  # (big's slot: one lease out)


def test_a_block_the_open_slot_cannot_hold_goes_after_the_blocks_of_another_slot_in_use(arena):
    """Calls of mixed sizes: a small block, then one that fills a slot of its own (the open slot now full), then a
    small one again: it goes after the first small block, in that slot's turn, not to the heap (every slot is in
    use); its pages follow the first block's."""
    arena.offer(b"c", ME)
    small = (1, 3, 4, 100)  # 4,800 bytes: two pages
    a = arena.block(small, np.int32)
    big = arena.block((2, *PLANE), np.int32)
    c = arena.block(small, np.int32)
    assert c is not None and arena.stats()["heap"] == {"full": 0, "too_large": 0}
    (slot_a, turn_a, parts_a), (slot_big, _, _), (slot_c, turn_c, parts_c) = (
        wire_ring.parse_arena_ref(served(arena, x, 0)[0])[1:4] for x in (a, big, c))
    assert slot_big != slot_a and (slot_c, turn_c) == (slot_a, turn_a)
    assert parts_c[0][0] - parts_a[0][0] == 2 * os.sysconf("SC_PAGESIZE")
    del a, big, c


def test_a_closed_arena_hands_out_no_more_blocks_and_its_name_is_gone():
    a = Arena(1, 1 << 16)
    alive = a.block((4, 1024), np.int32)
    a.close()
    assert not os.path.exists(a.path) and a.block((4, 1024), np.int32) is None
    alive[...] = 1  # (a block still alive stays usable: its map closes with it)
    assert int(alive.sum()) == 4096


def test_a_reference_names_where_the_frames_lie_and_the_client_reads_those_bytes(arena):
    client = ClientArena(arena.offer(b"c", ME))
    try:
        block = arena.block((2, *PLANE), np.int32)
        block[...] = np.arange(block.size, dtype=np.int32).reshape(block.shape)
        ref, cu = served(arena, block, 1)
        frames = take(client, ref)
        assert [bytes(f) for f in frames] == [block[1].tobytes(), cu.tobytes()]  # (the planes lie back to back)
        assert arena.ref(b"stranger", [block[0, 0]]) is None  # a connection never offered the arena
        assert arena.ref(b"c", [np.zeros(4, dtype=np.int32)]) is None  # nothing in the arena: sent as before
        del frames
    finally:
        client.close()


def test_a_client_that_writes_into_its_arrays_keeps_it_to_itself_and_sees_the_next_block_as_written(arena):
    """Copy on write: the daemon's block keeps the producer's bytes; once the client's arrays are gone it drops
    the pages it wrote before returning the lease, so the slot's next block is not hidden by them."""
    client = ClientArena(arena.offer(b"c", ME))
    try:
        block = arena.block((2, *PLANE), np.int32)
        block[...] = 7
        ref, _ = served(arena, block, 0)
        labels = np.frombuffer(take(client, ref)[0], dtype=np.int32)[4096:8192]  # (plane 1 of the step)
        labels[:] = -100  # a trainer masking its labels in place
        assert (block[0, 1] == 7).all()  # the daemon's bytes (and any other client's) are the producer's
        del labels
        gc.collect()
        field = client.release_field()
        assert field.startswith(b',"release_arena":[[') and client.dropped == 1
        slot, turn = wire_ring.parse_arena_ref(ref)[1:3]
        arena.release(b"c", [[slot, turn, 1]])
        del block
        gc.collect()
        nxt = arena.block((2, *PLANE), np.int32)  # the same slot (the lowest free)
        nxt[...] = 9
        ref2, _ = served(arena, nxt, 0)
        assert wire_ring.parse_arena_ref(ref2)[1] == slot
        again = np.frombuffer(take(client, ref2)[0], dtype=np.int32)[4096:8192]
        assert (again == 9).all()
        assert client.release_field() == b""  # (its arrays alive: the lease stays)
        del again
        gc.collect()
        assert client.release_field() == b',"release_arena":[[%d,%d,1]]' % (slot, turn + 1) and client.dropped == 1
    finally:
        client.close()


def test_the_leases_of_a_client_process_that_is_gone_come_back(arena):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = wire_ring.start_ticks(child.pid)
        assert arena.offer(b"k", {"pid": child.pid, "start": start, "pidns": ME["pidns"]}) is not None
        block = arena.block((2, *PLANE), np.int32)
        served(arena, block, 0, b"k")
        served(arena, block, 1, b"k")
        del block
        gc.collect()
        assert arena.reap(1e9) == 0 and arena.stats()["leases"] == 2  # alive: its leases stand
    finally:
        child.kill()
        child.wait()
    assert arena.reap(2e9) == 1 and arena.stats()["leases"] == 0 and arena.stats()["reaped"] == 1
    assert arena.block((2, *PLANE), np.int32) is not None
    assert arena.ref(b"k", [np.zeros(1, dtype=np.int32)]) is None  # its connection is forgotten


def test_an_arena_is_offered_only_to_a_running_process_of_this_pid_namespace(arena):
    assert arena.offer(b"a", {**ME, "pidns": "pid:[1]"}) is None
    assert arena.offer(b"b", {**ME, "start": ME["start"] + 1}) is None  # another process under that pid
    assert arena.stats()["refused"] == {"other_pid_namespace": 1, "no_such_process": 1}
    for bad in ({"pid": 1}, {**ME, "pid": "1"}, {**ME, "start": -1}, {**ME, "x": 1}, "me", {**ME, "pid": 0}):
        with pytest.raises(WireError, match="HELLO arena"):
            asked({"arena": bad})
    assert asked({}) is None


def test_a_reference_that_did_not_leave_gives_its_lease_back(arena):
    """A reply whose client's connection was gone (the route failed): its process will never return the lease,
    so the daemon does (`unsent`, for a reply alone or joined; ring references among them are not the arena's)."""
    arena.offer(b"c", ME)
    block = arena.block((1, *PLANE), np.int32)
    one, two = served(arena, block, 0)[0], served(arena, block, 0)[0]
    assert arena.stats()["leases"] == 2
    arena.unsent(b"c", [b"h", one])
    arena.unsent(b"c", [b"h", two, b"h", wire_ring.ref(b"ringring", 0, 8, 1)])
    assert arena.stats()["leases"] == 0 and arena.stats()["stale_releases"] == 0


def test_a_client_keeps_its_map_of_the_same_arena_across_a_reconnection_and_maps_a_new_one(arena):
    from sluice.client.arena import take_offer

    offer = arena.offer(b"c", ME)
    first = take_offer(None, offer, "ipc:///x")
    assert take_offer(first, dict(offer), "ipc:///x") is first  # (the same daemon: its arrays stay valid)
    other = Arena(1, 1 << 16)
    try:
        second = take_offer(first, other.offer(b"c", ME), "ipc:///x")
        assert second is not first and second.id == other.id
        assert take_offer(second, None, "ipc:///x") is None
    finally:
        other.close()


def test_releases_a_process_does_not_hold_are_counted_and_change_nothing(arena):
    arena.offer(b"c", ME)
    block = arena.block((1, *PLANE), np.int32)
    ref, _ = served(arena, block, 0)
    slot, turn = wire_ring.parse_arena_ref(ref)[1:3]
    arena.release(b"c", [[slot, turn + 1, 1], [slot, turn, 3]])  # another turn; more than it holds
    arena.release(b"other", [[slot, turn, 1]])
    assert arena.stats()["leases"] == 0 and arena.stats()["stale_releases"] == 4
    for bad in ("x", [[slot, turn]], [[slot, turn, "1"]], [[0, 0, 1]] * 65, [[slot, turn, 0]], [[slot, turn, -1]],
                [[slot, turn, 1 << 40]]):
        with pytest.raises(WireError, match="release_arena"):
            arena.release(b"c", bad)


def test_the_client_takes_nothing_on_trust(arena, tmp_path):
    offer = arena.offer(b"c", ME)
    for bad in ({**offer, "path": str(tmp_path / "x")}, {**offer, "path": "/dev/shm/sluice-ring-1/../x"},
                {**offer, "id": "zz" * 8}, {**offer, "slot_bytes": 100}, {**offer, "head": 0},
                {**offer, "extra": 1}, "arena"):
        with pytest.raises(ProtocolError, match="arena"):
            ClientArena(bad)
    with pytest.raises(ProtocolError, match="not an arena of this user"):
        ClientArena({**offer, "slots": offer["slots"] + 1})  # the file is smaller than that
    client = ClientArena(offer)
    try:
        block = arena.block((1, *PLANE), np.int32)
        ref, _ = served(arena, block, 0)
        _, slot, turn, parts, at = wire_ring.parse_arena_ref(ref)
        with pytest.raises(ProtocolError, match="outside slot"):
            client.take(slot, turn, [(arena.head + 2 * arena.slot_bytes - 4, 8)], ref, at)
        with pytest.raises(ProtocolError, match="outside slot"):
            client.take(slot + 5, turn, parts, ref, at)
        with pytest.raises(ProtocolError, match="holds turn"):
            client.take(slot, turn + 1, parts, ref, at)
    finally:
        client.close()


def test_an_arena_reference_is_told_apart_from_any_other_frame():
    ref = wire_ring.arena_ref(b"12345678", 1, 2, [(4096, 8), (-1, 3)], [b"abc"])
    assert wire_ring.parse_arena_ref(ref) == (b"12345678", 1, 2, [(4096, 8), (-1, 3)], len(ref) - 3)
    assert wire_ring.parse_arena_ref(ref[:-1]) is None and wire_ring.parse_arena_ref(ref + b"x") is None
    assert wire_ring.parse_arena_ref(np.arange(64, dtype=np.int32).tobytes()) is None  # token ids
    assert wire_ring.parse_ref(ref) is None
    assert wire_ring.parse_arena_ref(wire_ring.arena_ref(b"12345678", 0, 0, [(-2, 0)], [])) is None


def test_an_arena_takes_at_most_a_quarter_of_what_its_tmpfs_has_free(tmp_path, monkeypatch):
    """A real small /dev/shm (a tmpfs, root only): the arena shrinks to a quarter of its free room, and where that
    holds under three slots for one replica none is made (the ring carries the batches: STATS says why)."""
    from support import mount_tmpfs

    from sluice.loaderd import arena as daemon_arena

    small, large = tmp_path / "small", tmp_path / "large"
    if not (mount_tmpfs(small, "16m") and mount_tmpfs(large, "64m")):
        pytest.skip("needs root to mount a small tmpfs (a real, nearly full /dev/shm)")
    try:
        monkeypatch.setattr(daemon_arena, "SHM_DIR", str(small))
        assert daemon_arena.make("ipc:///x.sock", 1, 3 << 20) == (None, "no_space")
        monkeypatch.setattr(daemon_arena, "SHM_DIR", str(large))
        made, why = daemon_arena.make("ipc:///x.sock", 1, 3 << 20)
        assert why is None and made.slots == 5 and os.path.dirname(made.path) == str(large)
        made.close()
        assert daemon_arena.make("tcp://127.0.0.1:1", 1, 3 << 20) == (None, "not_ipc_or_no_shm")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
        subprocess.run(["umount", "-l", str(large)], check=False)
