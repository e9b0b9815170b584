"""A client on the daemon's host reads BATCH arrays from shared memory, and its stream is the plan's.

On an ipc:// endpoint (the default) a client asks in HELLO for a ring of twice
its credits' slots; the daemon makes one file for the connection under
/dev/shm and answers each GET that says ``ring`` with the header and a
reference frame (sluice/wire/ring.py). The bytes must be the plan's, the
frames path must stay the same for clients that do not ask (tcp, `ring=False`),
nothing may be left in /dev/shm, and nothing the daemon sends is trusted: an
offer outside /dev/shm, a reference outside the ring and a slot written again
before it was read are errors, never other bytes. A leased slot (the client
reads its arrays in place) is written again only once the client released it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import gc
import time

import numpy as np
import pytest
import zmq
from loaderd_support import Daemon, build_corpus, reference, stream_digests

from sluice.client import ring as client_ring
from sluice.client.ring import ClientRing, ask
from sluice.errors import ProtocolError
from sluice.loaderd import rings
from sluice.wire import decoding, encoding, errorcodes, protocol
from sluice.wire import ring as wire_ring

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux) for the rings")


def ring_files() -> set[str]:
    """The rings' files under /dev/shm (not the daemons' arenas, there while a daemon runs: test_arena.py)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(rings.PREFIX) and "-arena-" not in n}


# The daemons whose BATCHes these tests read from rings write their blocks on the heap: with the arena (the
# default) a ring carries only what the arena does not (tests/test_arena.py)
NO_ARENA = ("--arena", "off")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("ring"), "sltok", tokenizer_file, docs=300, lanes=4,
                        global_batch=8, micro_batch=4, seq_len=64)


def take(client, steps: int) -> list[dict]:
    out = []
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v) for k, v in mb.items()})
        if mb["step"] + 1 >= steps and mb["micro"] + 1 == client.info["micro_per_step"]:
            break
    return out


def assert_the_plan(corpus, batches) -> None:
    got = stream_digests(batches, 2)
    ref = reference(corpus, max(got) + 1, 1)
    assert sorted(got) == list(range(min(got), max(got) + 1))
    assert all(d == ref[(s, 0)][0] for s, d in got.items()), "a step differs from the plan"


@pytest.mark.slow
def test_an_ipc_client_reads_from_its_ring_and_the_stream_is_the_plans(corpus):
    before = ring_files()
    with Daemon(corpus, cache=corpus / "cache-ring", extra=NO_ARENA) as d:
        assert d.endpoint.startswith("ipc://")
        c = d.client(credits=3)
        batches = take(c, 60)
        stats = c.stats()["rings"]
        assert ring_files() <= before  # the client removed the name once it mapped the ring
        c.close()
        off = d.client(ring=False)  # (the same replica: it goes on after the steps the first one took)
        plain = take(off, 90)
        after_off = off.stats()["rings"]
        off.close()
    assert stats["enabled"] and stats["open"] == 1 and stats["batches"] >= 120, stats
    # The frames path: none of `off`'s 90 more. The first client's GETs still in flight at its STATS (3 credits)
    # may be answered into its ring after it, once the producer makes their steps (a race, seen in a test run).
    assert stats["batches"] <= after_off["batches"] <= stats["batches"] + 3 and after_off["open"] == 1, after_off
    assert_the_plan(corpus, batches)
    assert_the_plan(corpus, plain)
    assert min(stream_digests(plain, 2)) == 60
    assert ring_files() <= before


@pytest.mark.slow
def test_a_tcp_client_reads_frames(corpus):
    with Daemon(corpus, cache=corpus / "cache-tcp", endpoint="tcp://127.0.0.1:0", token="ring-" + "5" * 28) as d:
        c = d.client()
        batches = take(c, 20)
        stats = c.stats()["rings"]
        c.close()
    assert not stats["enabled"] and stats["batches"] == 0 and stats["open"] == 0, stats
    assert_the_plan(corpus, batches)


@pytest.mark.slow
def test_a_daemon_removes_the_rings_of_daemons_killed_before_their_clients_mapped_them(corpus):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = f"/dev/shm/{rings.PREFIX}{gone.pid}-deadbeef"
    live = f"/dev/shm/{rings.PREFIX}{os.getpid()}-cafe"  # a running process's: kept
    for p in (stale, live):
        open(p, "wb").close()
    try:
        with Daemon(corpus, cache=corpus / "cache-sweep"):
            assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for p in (stale, live):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.slow
def test_a_hello_asking_for_a_ring_out_of_bounds_is_refused(corpus):
    with Daemon(corpus, cache=corpus / "cache-hello") as d:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)
        try:
            bad = ({"slots": wire_ring.MAX_SLOTS + 1}, {"slots": 1}, "yes", {"slots": 4, "x": 1}, {"slots": True})
            for i, asked in enumerate(bad):
                s.send_multipart(encoding.encode(protocol.Header(
                    kind=protocol.HELLO, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0,
                    request_id=i + 1, body={"replicas": 1, "ring": asked})))
                assert s.poll(10_000), f"no reply to a HELLO with ring {asked!r}"
                reply = decoding.decode(s.recv_multipart(), protocol.Limits.for_client())
                assert reply.kind == protocol.ERROR and reply.body["code"] == errorcodes.E_MALFORMED, reply.body
                assert "ring" in reply.body["message"]
        finally:
            s.close(0)
        c = d.client()  # and the daemon serves on
        assert take(c, 2) and c.stats()["rings"]["open"] == 1
        c.close()


@pytest.mark.slow
def test_a_get_asking_for_a_ring_it_does_not_hold_gets_frames(corpus):
    """A GET that says ``ring`` from a connection without one (it never asked, or its ring was closed to
    make room) is answered as any GET: the header and the array frames."""
    from sluice.client.requests import GetFrames

    with Daemon(corpus, cache=corpus / "cache-noring") as d:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)
        try:
            s.send_multipart(encoding.encode(protocol.Header(
                kind=protocol.HELLO, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0,
                request_id=1, body={"replicas": 1})))
            assert s.poll(10_000)
            hello = decoding.decode(s.recv_multipart(), protocol.Limits.for_client())
            assert hello.kind == protocol.HELLO_OK and "ring" not in hello.body
            gets = GetFrames(run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], generation=0, replica=0,
                             instance=hello.body["instance"], token=None, samples=False, observe=False, ring=True)
            s.send_multipart(gets.frames(step=0, micro=0, request_id=2, input_wait_s=0.0))
            assert s.poll(30_000)
            frames = s.recv_multipart()
            assert wire_ring.parse_ref(frames[-1]) is None and len(frames) >= 2
            batch = decoding.decode(frames, protocol.Limits.for_client())
            assert batch.kind == protocol.BATCH and batch.arrays["input_ids"].size > 0
        finally:
            s.close(0)


def test_the_client_takes_nothing_on_trust(tmp_path):
    slot = wire_ring.slot_bytes(2, 8)
    with pytest.raises(ProtocolError, match="ring"):  # not under /dev/shm
        ClientRing({"path": str(tmp_path / "x"), "slots": 4, "slot_bytes": slot, "id": "00" * 8}, 4)
    path = f"/dev/shm/{rings.PREFIX}{os.getpid()}-test"
    r = rings.Ring(path, 4, slot)
    offer = {"path": path, "slots": 4, "slot_bytes": slot, "id": r.id.hex()}
    try:
        for bad in ({**offer, "slots": 8}, {**offer, "id": "zz" * 8}, {**offer, "path": path + "/../x"}):
            with pytest.raises(ProtocolError, match="ring"):  # not the ring asked for
                ClientRing(bad, 4)
        c = ClientRing(offer, 4)
        assert not os.path.exists(path)  # mapped: its name removed
        a, b = np.arange(48, dtype="<i4"), np.arange(5, dtype="<i4")
        ref = r.put([a, b])
        ring_id, slot_, nbytes, turn = wire_ring.parse_ref(ref)
        assert ring_id == r.id
        (got,) = client_ring.resolve(c, [b"header", ref])
        assert got[0] == b"header" and bytes(got[1]) == a.tobytes() + b.tobytes()
        # Joined replies (docs/protocol.md): each pair resolved, in order; a stale pair dropped on its own.
        ref2 = r.put([b])
        stale = wire_ring.ref(b"other id", slot_, nbytes, turn)
        got = client_ring.resolve(c, [b"h1", ref, b"h2", ref2, b"h3", stale])
        assert [g[0] for g in got] == [b"h1", b"h2"] and bytes(got[1][1]) == b.tobytes()
        with pytest.raises(ProtocolError, match="frame 3 is no ring reference"):
            client_ring.resolve(c, [b"h1", ref, b"h2", b"not a reference"])
        with pytest.raises(ProtocolError, match="at most 16"):
            client_ring.resolve(c, [b"h", ref] * 17)
        assert client_ring.resolve(c, [b"header", b"x", b"y"]) == [[b"header", b"x", b"y"]]  # frames as sent
        assert client_ring.resolve(c, [b"header", wire_ring.ref(b"other id", slot_, nbytes, turn)]) is None
        assert client_ring.resolve(None, [b"header", ref]) is None  # (a stale reply: no ring held now)
        with pytest.raises(ProtocolError, match="outside"):
            c.take(4, nbytes, turn)
        with pytest.raises(ProtocolError, match="outside"):
            c.take(0, slot, turn)
        for _ in range(4):  # every slot written again: the first reference's turn is gone
            r.put([b])
        with pytest.raises(ProtocolError, match="written again"):
            c.take(slot_, nbytes, turn)
        c.close()
    finally:
        r.close()
    assert not os.path.exists(path)


def test_the_ring_asked_for_holds_more_slots_than_credits():
    assert ask("ipc://loaderd.sock", 8) == {"slots": 16, "lease": True}
    assert ask("ipc://loaderd.sock", 1) == {"slots": 2, "lease": True}
    # past 8 credits, 8 slots more than the credits (the batches a trainer may hold), not twice: /dev/shm
    assert ask("ipc://loaderd.sock", 16) == {"slots": 24, "lease": True}
    assert ask("ipc://loaderd.sock", 56) == {"slots": 64, "lease": True}
    assert ask("tcp://127.0.0.1:5555", 8) is None
    assert ask("ipc://loaderd.sock", 57) is None  # credits + 8 would not fit: frames
    assert wire_ring.parse_ref(wire_ring.ref(b"12345678", 3, 100, 7)) == (b"12345678", 3, 100, 7)
    assert wire_ring.parse_ref(b"\0" * wire_ring.REF_BYTES) is None
    assert wire_ring.slot_bytes(8, 2048) % 64 == 0


def test_the_daemon_holds_at_most_max_rings_and_sends_frames_where_it_holds_none():
    """The bound: the least recently used ring is closed (its file gone) to make room, and its connection's
    next BATCH goes as frames; arrays larger than a slot go as frames too."""
    held = rings.Rings("ipc://loaderd.sock", wire_ring.slot_bytes(1, 4))
    before = ring_files()
    try:
        offers = [held.offer(b"client-%d" % i, {"slots": 2}, 0.0) for i in range(rings.MAX_RINGS + 1)]
        assert all(o is not None for o in offers)
        stats = held.stats()
        assert stats["open"] == rings.MAX_RINGS and stats["evicted"] == 1 and stats["refused"] == {}
        assert not os.path.exists(offers[0]["path"]) and os.path.exists(offers[-1]["path"])
        frames = [b"header", np.arange(4, dtype="<i4")]
        assert held.frames(b"client-0", frames) is frames  # evicted: frames
        sent = held.frames(b"client-1", frames)
        assert len(sent) == 2 and wire_ring.parse_ref(sent[1])[1:3] == (0, 16)
        big = [b"header", np.zeros(wire_ring.slot_bytes(1, 4), dtype=np.uint8)]
        assert held.frames(b"client-1", big) is big  # larger than a slot
        assert held.stats()["batches"] == 1
    finally:
        held.close_all()
    assert ring_files() <= before


def test_a_ring_whose_client_fell_silent_is_closed_and_the_others_stay():
    """`expire`: a ring whose client sent nothing for longer than the bound is closed (its file gone, counted);
    a request (`seen`) keeps one open; the closed one's connection gets frames from then on."""
    held = rings.Rings("ipc://loaderd.sock", wire_ring.slot_bytes(1, 4))
    before = ring_files()
    try:
        quiet, busy = (held.offer(name, {"slots": 2}, 100.0) for name in (b"quiet", b"busy"))
        held.seen(b"busy", 150.0, {})
        held.seen(b"nobody", 150.0, {})  # (no ring: nothing to refresh)
        assert held.expire(160.0, 60.0) == 0  # (60 s of silence is not more than 60)
        assert held.expire(160.5, 60.0) == 1
        stats = held.stats()
        assert stats["open"] == 1 and stats["expired"] == 1 and stats["evicted"] == 0, stats
        assert not os.path.exists(quiet["path"]) and os.path.exists(busy["path"])
        frames = [b"header", np.arange(4, dtype="<i4")]
        assert held.frames(b"quiet", frames) is frames
        assert len(held.frames(b"busy", frames)) == 2
    finally:
        held.close_all()
    assert ring_files() <= before


def test_a_quiet_client_that_asks_again_gets_a_new_ring_and_no_other_connection_does():
    """`frames`: the connection whose ring expired gets a new one of the slots it asked for, offered first (the
    RING message) and used for the batch that asked; once only. A connection whose ring was evicted to make room,
    or that never had one, gets frames and no offer; the table of expired connections is bounded."""
    offers: list[dict] = []
    held = rings.Rings("ipc://loaderd.sock", wire_ring.slot_bytes(1, 4),
                       announce=lambda identity, request, offer: offers.append(offer))
    before = ring_files()
    frames = [b"header", np.arange(4, dtype="<i4")]
    try:
        old = held.offer(b"quiet", {"slots": 6}, 100.0)
        assert held.expire(200.0, 60.0) == 1
        assert held.frames(b"stranger", frames) is frames and offers == []
        got = held.frames(b"quiet", frames)
        assert [o["slots"] for o in offers] == [6] and offers[0]["id"] != old["id"]
        assert len(got) == 2 and got[1] == wire_ring.ref(bytes.fromhex(offers[0]["id"]), 0, 16, 0)
        assert len(held.frames(b"quiet", frames)) == 2 and len(offers) == 1  # (holds it: no offer again)
        stats = held.stats()
        assert stats["open"] == 1 and stats["expired"] == 1 and stats["revived"] == 1, stats
        for i in range(rings.MAX_RINGS + 1):  # the oldest expired connection is forgotten past MAX_RINGS
            held.offer(b"c%d" % i, {"slots": 2}, 300.0)
        assert held.stats()["evicted"] == 2  # (quiet's new ring and c0's made room)
        assert held.frames(b"quiet", frames) is frames and len(offers) == 1
        assert held.expire(400.0, 60.0) == rings.MAX_RINGS  # c1 .. c32, in that order
        held.offer(b"late", {"slots": 2}, 450.0)
        assert held.expire(520.0, 60.0) == 1  # the 33rd expired connection: c1, the oldest, is forgotten
        assert held.frames(b"c1", frames) is frames
        assert len(held.frames(b"c2", frames)) == 2 and len(offers) == 2
    finally:
        held.close_all()
    assert ring_files() <= before


@pytest.mark.slow
def test_a_client_silent_past_its_claim_loses_its_ring_and_gets_a_new_one_when_it_asks_again(corpus):
    """A trainer that stops asking (gone, or paused past twice `--request-ttl`) frees its ring at the daemon's
    next housekeeping; when it asks again it gets a new ring (a RING message before the batch), and the stream
    is still the plan's."""
    before = ring_files()
    with Daemon(corpus, cache=corpus / "cache-silent", extra=("--request-ttl", "0.5", *NO_ARENA)) as d:
        c = d.client(credits=3)
        first = take(c, 20)
        held = c.stats()["rings"]
        time.sleep(2.5)  # (silent: no request for twice the TTL, 1 s, and two housekeepings past it)
        gone = c.stats()["rings"]
        rest = take(c, 40)
        after = c.stats()["rings"]
        c.close()
    assert held["open"] == 1 and held["batches"] >= 40, held
    assert gone["open"] == 0 and gone["expired"] == 1, gone
    assert after["open"] == 1 and after["revived"] == 1 and after["batches"] >= gone["batches"] + 35, after
    assert_the_plan(corpus, first + rest)
    assert ring_files() <= before


def test_a_leased_slot_is_written_again_only_once_its_arrays_are_gone():
    """Leased: the client's arrays view their slot (no copy, writable); the slot is released when the last view is
    gone and named in the next GET's `release`; the daemon writes only released slots and sends frames while
    every slot is held; a release for another turn is counted and changes nothing."""
    held = rings.Rings("ipc://loaderd.sock", wire_ring.slot_bytes(1, 4))
    before = ring_files()
    try:
        offer = held.offer(b"c", {"slots": 2, "lease": True}, 0.0)
        assert offer["lease"] is True
        client = ClientRing(offer, 2)
        batches = [[b"header", np.arange(4, dtype="<i4") + 10 * i] for i in range(4)]
        refs = [held.frames(b"c", batch) for batch in batches[:2]]
        views = [client.take(*wire_ring.parse_ref(ref[1])[1:]) for ref in refs]
        assert [np.frombuffer(v, "<i4").tolist() for v in views] == [[0, 1, 2, 3], [10, 11, 12, 13]]
        assert held.frames(b"c", batches[2]) is batches[2] and held.stats()["full"] == 1  # (both slots held)
        arrays = np.frombuffer(views[0], "<i4")  # (a view of the view holds the slot too)
        arrays[0] = 99  # writable: the trainer's own slot
        del views[0]
        gc.collect()
        assert client.release_field() == b""  # (`arrays` still views slot 0)
        del arrays
        gc.collect()
        assert client.release_field() == b',"release":[[0,0]]' and client.release_field() == b""
        held.seen(b"c", 1.0, {"release": [[1, 0]]})  # (slot 1 is held for turn 1: stale, ignored)
        assert held.stats()["stale_releases"] == 1
        held.seen(b"c", 1.0, {"release": [[0, 0]]})
        again = held.frames(b"c", batches[3])
        assert wire_ring.parse_ref(again[1])[1:] == (0, 16, 2)  # (slot 0, the turn after the frames' refusal)
        assert np.frombuffer(client.take(0, 16, 2), "<i4").tolist() == [30, 31, 32, 33]
        assert np.frombuffer(views[0], "<i4").tolist() == [10, 11, 12, 13]  # slot 1 untouched all along
        for bad in ("x", [[0]], [[0, "1"]], [[0, 1]] * (wire_ring.MAX_SLOTS + 1), [[True, 1]]):
            with pytest.raises(rings.WireError, match="release must be"):
                held.seen(b"c", 2.0, {"release": bad})
        del views
        client.close()
    finally:
        held.close_all()
    assert ring_files() <= before


def test_a_ring_without_a_lease_is_copied_and_a_lease_the_client_did_not_ask_for_is_refused():
    """A daemon that does not offer a lease (an older one) gets the copying client; an offer of a lease other
    than true is not a ring's."""
    held = rings.Rings("ipc://loaderd.sock", wire_ring.slot_bytes(1, 4))
    try:
        plain = ClientRing(held.offer(b"old", {"slots": 2}, 0.0), 2)
        ref = held.frames(b"old", [b"h", np.arange(4, dtype="<i4")])[1]
        got = plain.take(*wire_ring.parse_ref(ref)[1:])
        assert type(got) is bytearray and not plain.lease and plain.release_field() == b""
        plain.close()
        offer = held.offer(b"odd", {"slots": 2, "lease": True}, 0.0)
        with pytest.raises(ProtocolError, match="must be the ring asked for"):
            ClientRing({**offer, "lease": 1}, 2)
        with pytest.raises(rings.WireError, match="lease"):
            rings.asked({"ring": {"slots": 2, "lease": False}})
    finally:
        held.close_all()


@pytest.mark.slow
def test_a_trainer_that_keeps_its_batches_gets_frames_once_every_slot_is_held(corpus):
    """A trainer holding every batch it got (gradient accumulation gone wrong, a list of batches) holds every
    slot: the daemon sends the further batches as frames (STATS rings.full), never into a slot it holds, and
    every batch kept is still the plan's; one that lets its batches go never runs out."""
    with Daemon(corpus, cache=corpus / "cache-lease", extra=NO_ARENA) as d:
        kept = []
        c = d.client(credits=2)
        for mb in c:
            kept.append(mb)  # (the arrays themselves: views of the slots)
            if len(kept) == 24:
                break
        full = c.stats()["rings"]
        c.close()
        c = d.client(credits=2)
        let_go = take(c, 24)  # (steps 12 to 23: the replica's stream goes on where the first client left it)
        free = c.stats()["rings"]
        c.close()
    assert full["full"] > 0 and full["stale_releases"] == 0, full
    assert_the_plan(corpus, [{k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v)
                              for k, v in mb.items()} for mb in kept])
    # The second client never ran out of slots: `full` grew at most by the first client's GETs still in flight at
    # its STATS (2 credits), answered as frames after it once the producer made their steps (a race, seen).
    assert full["full"] <= free["full"] <= full["full"] + 2 and free["batches"] >= full["batches"] + 20, free
    assert_the_plan(corpus, let_go)
