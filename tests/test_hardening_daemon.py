"""loaderd under attack: no silent wait, no stalled replica, no stranger, no state no plan makes.

Real daemon processes, real sockets, a real corpus and tokenizer. Each test
names the issue-10 item it guards; bench/results/hardening-log.md lists input,
expected and observed for each.
"""

from __future__ import annotations

import copy
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from loaderd_support import BOOT, Daemon, build_corpus, reference, stream_digests
from sluice.errors import DaemonError
from sluice.wire import decoding, encoding, errorcodes, protocol, runtoken

TOKEN = "hardening-token-" + "9" * 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("hard"), "jsonl.zst", tokenizer_file)


@pytest.fixture(scope="module")
def daemon(corpus, tmp_path_factory):
    """One daemon with a run token, a 0.5 s request TTL and a short prefetch lead."""
    d = Daemon(corpus, cache=tmp_path_factory.mktemp("hard-cache"), token=TOKEN,
               extra=("--request-ttl", "0.5", "--lead-steps", "2")).start()
    yield d
    d.stop()


def raw(d: Daemon, password: str | None = TOKEN, reconnect: bool = True) -> zmq.Socket:
    """A bare DEALER; with `password`, it passes the handshake as the client does (ZMTP PLAIN).

    reconnect=False: one connection attempt only, so one handshake (one ZAP call) per socket."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if not reconnect:
        s.setsockopt(zmq.RECONNECT_IVL, -1)
    if password is not None:
        s.plain_username = runtoken.TOKEN_USER.encode()
        s.plain_password = password.encode()
    s.connect(d.endpoint)
    return s


def ask(sock: zmq.Socket, d: Daemon, token: str | None = TOKEN, **kw) -> protocol.Message:
    base = dict(kind=protocol.GET, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0, step=0,
                micro=0, request_id=1)
    body = dict(kw.pop("body", {}))
    if token is not None:
        body["token"] = token
    base.update(kw)
    sock.send_multipart(encoding.encode(protocol.Header(**base, body=body)))
    assert sock.poll(10000), "no reply within 10 s"
    return decoding.decode(sock.recv_multipart(copy=False), protocol.Limits.for_client())


def stats(d: Daemon) -> dict:
    s = raw(d)
    try:
        return dict(ask(s, d, kind=protocol.STATS).body["stats"])
    finally:
        s.close(0)


def in_thread(fn, timeout: float):
    """Run fn() in a thread; fail (instead of hanging) if it does not return within `timeout`."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # reported below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still waiting after {timeout} s: a silent, unbounded wait"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def take_steps(client, steps: int) -> list[dict]:
    import numpy as np

    out, target = [], None
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro") else v) for k, v in mb.items()})
        target = mb["step"] + steps - 1 if target is None else target
        if mb["step"] == target and mb["micro"] + 1 == client.info["micro_per_step"]:
            return out
    return out


# -- item 9: who may take from the stream ----------------------------------------------
def test_requests_without_the_run_token_are_refused_unauthorized(daemon):
    # A stranger without the token never gets past the handshake: not one frame of
    # it is accepted (so it cannot make the daemon buffer anything), nothing answers.
    before = stats(daemon)["unauthorized"]
    for password in (None, "x" * 32, TOKEN[:-1]):
        stranger = raw(daemon, password, reconnect=False)
        try:  # non-blocking: a DEALER whose handshake was refused has no peer, and send would wait forever
            header = encoding.encode_header(protocol.Header(kind=protocol.STATS, body={"token": TOKEN}))
            stranger.send_multipart([header] + [b"\0" * (1 << 20)] * 64, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # refused before we could even queue it: nothing reached the daemon
        assert not stranger.poll(300), f"a peer with password {password!r} got an answer"
        if password is not None:
            # A wrong password reaches the ZAP handler (no password: refused before any ZAP call). Kept open
            # until it is counted: closed earlier, on a loaded machine its handshake may never reach the daemon.
            deadline = time.monotonic() + 20
            while stats(daemon)["unauthorized"] < before + 1:
                assert time.monotonic() < deadline, f"the ZAP handler did not count password {password!r}"
                time.sleep(0.1)
            before += 1
            assert not stranger.poll(0), f"a peer with password {password!r} got an answer"
        stranger.close(0)
    assert stats(daemon)["unauthorized"] == before  # one refusal per handshake, nothing else
    # Past the handshake, every request must still carry the token in its body.
    s = raw(daemon)
    try:
        before = stats(daemon)["unauthorized"]
        for kind in (protocol.HELLO, protocol.GET, protocol.STATS, protocol.RESTORE, protocol.COMMIT):
            for token in (None, "x" * 32, TOKEN[:-1], ""):
                reply = ask(s, daemon, token=token, kind=kind, body={"replicas": 1, "state": {}})
                assert reply.kind == protocol.ERROR and reply.body["code"] == errorcodes.E_UNAUTHORIZED, (kind, token)
                assert TOKEN not in reply.body["message"]  # the secret is never echoed
        assert stats(daemon)["unauthorized"] == before + 20
        # a client that lacks the token (or has another) gets a typed error at once, not silence
        for token in (None, "y" * 32):
            stranger = daemon.client(0, 1, token=token, timeout_s=30, reconnect_s=60)
            t0 = time.monotonic()
            with pytest.raises(DaemonError, match="UNAUTHORIZED") as info:
                next(stranger)
            # told by the refused handshake, long before a silent wait's 30 s probe
            assert info.value.code == errorcodes.E_UNAUTHORIZED and time.monotonic() - t0 < 20
            stranger.close()
    finally:
        s.close(0)


# -- item 7: a message is bounded before it is held ------------------------------------
def test_a_message_of_many_frames_is_released_frame_by_frame(daemon):
    s = raw(daemon)
    try:
        before = stats(daemon)["dropped_frames"]
        header = encoding.encode_header(protocol.Header(kind=protocol.STATS, body={"token": TOKEN}))
        s.send_multipart([header] + [b"\0" * (64 << 10)] * 200)
        assert s.poll(10000)
        reply = decoding.decode(s.recv_multipart(copy=False), protocol.Limits.for_client())
        assert reply.body["code"] == errorcodes.E_TOO_MANY_FRAMES
        # at most max_frames (8) were kept; everything after was released unread
        assert stats(daemon)["dropped_frames"] - before >= 201 - 8
    finally:
        s.close(0)


# -- items 14-16: RESTORE refuses states no plan makes, before the generation moves -------
def test_restore_refuses_every_field_no_plan_can_produce(daemon):
    c = daemon.client(0, 1, token=TOKEN)
    take_steps(c, 1)
    good = c.state_dict()
    c.close()
    gen = stats(daemon)["generation"]
    lane = next(iter(good["lanes"]))

    def with_(path, value):
        st = copy.deepcopy(good)
        obj = st
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
        return st

    cur = good["lanes"][lane]["packers"].get("*", {}).get("cur") or [0, 0, 0, 0, 10]
    cases = {
        "residual offset -1": with_(["lanes", lane, "packers", "*"], {"cur": [*cur[:3], -1, cur[4]]}),
        "residual offset 10^12": with_(["lanes", lane, "packers", "*"], {"cur": [*cur[:3], 10**12, 10**12 + 5]}),
        "source index 99": with_(["lanes", lane, "packers", "*"], {"cur": [99, *cur[1:]]}),
        "sample index past the source": with_(["lanes", lane, "packers", "*"], {"cur": [cur[0], cur[1], 10**9, 0, 5]}),
        "unknown packer": with_(["lanes", lane, "packers", "bogus"], {"cur": None}),
        "taken beyond the lane's share": with_(["lanes", lane, "sources"],
                                                [[0, 10**6, 1, 0, 0, 0, 0]]),
        "count beyond 2^53": with_(["lanes", lane, "draws"], 2**60),
    }
    s = raw(daemon)
    try:
        for name, state in cases.items():
            reply = ask(s, daemon, kind=protocol.RESTORE, step=state["step"], generation=gen + 1, body={"state": state})
            assert reply.body.get("code") == errorcodes.E_BAD_STATE, (name, reply.body)
        # the header step must be the state's step
        reply = ask(s, daemon, kind=protocol.RESTORE, step=good["step"] + 3, generation=gen + 1, body={"state": good})
        assert reply.body["code"] == errorcodes.E_BAD_STATE and "header step" in reply.body["message"]
        # generations: bounded, and no jump beyond the window
        for g in (2**62 - 1, 2**53, gen + (1 << 21)):
            reply = ask(s, daemon, kind=protocol.RESTORE, step=good["step"], generation=g, body={"state": good})
            assert reply.body.get("code") in (errorcodes.E_BAD_STATE, errorcodes.E_MALFORMED), (g, reply.body)
        # another run spec's state: refused, and the generation did not move (item 16)
        other = dict(good, runspec_digest="b3:" + "0" * 64)
        reply = ask(s, daemon, kind=protocol.RESTORE, step=good["step"], generation=gen + 5, body={"state": other})
        assert reply.body["code"] == errorcodes.E_BAD_STATE
        assert stats(daemon)["generation"] == gen, "a refused RESTORE moved the generation"
    finally:
        s.close(0)


@settings(max_examples=30, deadline=None)
@given(algorithm=st.sampled_from(["concat", "bestfit"]), unit=st.sampled_from(["documents", "tokens", "sequences"]),
       exhaustion=st.sampled_from(["repeat", "renormalize", "stop"]), seed=st.integers(0, 2**32 - 1),
       steps=st.integers(1, 25))
def test_every_state_a_plan_produces_passes_the_bounds(algorithm, unit, exhaustion, seed, steps):
    # the RESTORE gate must never refuse a state the plan itself made (no false BAD_STATE)
    from logical_helpers import fake_docs, make_manifest, make_spec

    from sluice.datastate import check_bounds
    from sluice.errors import EndOfStream
    from sluice.loaderd.gate import bounds_of
    from sluice.loaderd.logical import Plan

    sources = [("a", [5, 7], "2", exhaustion), ("b", [3], "1", exhaustion)]
    plan = Plan(make_manifest(sources, algorithm=algorithm, unit=unit, window=3), make_spec(seed=seed))
    bounds, docs, state = bounds_of(plan), fake_docs(), plan.initial_state()
    for _ in range(steps):
        try:
            _, state = plan.step(state, docs)
        except EndOfStream:
            break
        check_bounds(state, bounds)
        check_bounds(plan.load_state(state.state_dict()), bounds)


# -- hang 1: a parked GET is never dropped silently --------------------------------------
def test_an_expired_get_is_answered_and_the_client_asks_again(daemon, corpus):
    s = raw(daemon)
    try:
        floor = stats(daemon)["replicas"]["0"]["floor_step"]
        far = floor + 2 + 5  # beyond the prefetch lead: parked, and nothing will produce it soon
        reply = ask(s, daemon, step=far)
        assert reply.body["code"] == errorcodes.E_EXPIRED
        assert f"step {far}" in reply.body["message"] and "replica 0" in reply.body["message"]
    finally:
        s.close(0)
    # A step slower than the TTL: a tensor-parallel pair (peers=2) whose second rank
    # comes 1.5 s late. The first rank's GETs beyond the prefetch lead expire; it is
    # told so, asks again, and both ranks get exactly the planned stream (before the
    # fix the daemon dropped them silently and the first rank waited forever).
    first = daemon.client(0, 1, token=TOKEN, credits=16, peers=2, timeout_s=30)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("a", take_steps(first, 5)), daemon=True)
    t.start()
    time.sleep(1.5)
    second = daemon.client(0, 1, token=TOKEN, credits=16, peers=2, timeout_s=30)
    got_b = in_thread(lambda: take_steps(second, 5), 60)
    t.join(60)
    assert not t.is_alive(), "the first rank still waits: its expired GETs were never answered"
    assert first.resent > 0
    mps = first.info["micro_per_step"]
    first.close()
    second.close()
    ref = reference(corpus, max(b["step"] for b in got_b) + 1, 1)
    for got in (result["a"], got_b):
        digests = stream_digests(got, mps)
        assert len(digests) == 5 and all(ref[(step, 0)][0] == dg for step, dg in digests.items())


def test_a_client_never_waits_beyond_its_bound_and_says_what_it_waited_for(daemon):
    # the second rank of a peers=2 pair never comes: steps beyond the lead are never
    # produced; EXPIRED answers are re-sent, and max_wait_s ends the wait with an error
    from sluice.errors import DaemonTimeout

    # The daemon is shared: the previous test's clients closed with GETs in flight, and a step they
    # were both sent may be released only after this client's HELLO named its floor (seen once as
    # OUT_OF_RANGE at step 8). Their claims lapse after 2 TTLs: by then those GETs are answered.
    wait_peers(daemon, 1)
    lonely = daemon.client(0, 1, token=TOKEN, credits=16, peers=2, timeout_s=30, max_wait_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(DaemonTimeout) as info:
        in_thread(lambda: take_steps(lonely, 10), 30)
    waited = time.monotonic() - t0
    lonely.close()
    e = info.value
    assert e.replica == 0 and e.endpoint == daemon.endpoint and 2.0 <= e.waited_s < 10 and waited < 15
    assert f"step {e.step} micro {e.micro} of replica 0" in str(e) and daemon.endpoint in str(e)


def test_a_long_wait_is_said_while_it_lasts_not_once_a_probe(daemon, caplog):
    # the same lonely rank with a short probe interval: before its DaemonTimeout the client's log says what it
    # waits for and from whom, at timeout_s and each time the wait doubles
    from sluice.errors import DaemonTimeout

    wait_peers(daemon, 1)
    lonely = daemon.client(0, 1, token=TOKEN, credits=16, peers=2, timeout_s=0.4, max_wait_s=3.0)
    with caplog.at_level(logging.WARNING, logger="sluice.client"), pytest.raises(DaemonTimeout) as info:
        in_thread(lambda: take_steps(lonely, 10), 30)
    lonely.close()
    e = info.value
    said = [r.getMessage() for r in caplog.records
            if r.name == "sluice.client" and "sluice: waited" in r.getMessage()]
    assert said, "a 3 s wait with timeout_s 0.4 said nothing"
    for m in said:
        assert f"step {e.step} micro {e.micro} of replica 0 from loaderd at {daemon.endpoint}" in m, m
        assert "max_wait_s = 3 s" in m and ("EXPIRED" in m or "answers a probe" in m), m
    assert len(said) <= 4, said  # (at 0.4 s, then 0.8, 1.6: never once a probe)


# -- hang 2: one HELLO(peers=2) does not stall a replica for good --------------------------
def wait_peers(d: Daemon, peers: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while stats(d)["replicas"]["0"]["peers"] != peers:
        assert time.monotonic() < deadline, f"replica 0 peers did not become {peers}"
        time.sleep(0.1)


def test_a_vanished_peer_claim_lapses_and_the_release_runs_again(daemon):
    wait_peers(daemon, 1)  # claims of earlier tests' clients have lapsed
    s = raw(daemon)
    reply = ask(s, daemon, kind=protocol.HELLO, body={"replicas": 1, "peers": 2})
    assert reply.kind == protocol.HELLO_OK
    s.close(0)  # the claimant vanishes
    assert stats(daemon)["replicas"]["0"]["peers"] == 2
    c = daemon.client(0, 1, token=TOKEN, timeout_s=30)
    got = in_thread(lambda: take_steps(c, 6), 60)  # lead 2: impossible while peers stays 2
    c.close()
    assert len({b["step"] for b in got}) == 6
    wait_peers(daemon, 1)


# -- hang 3: a failed bind exits non-zero at once ------------------------------------------
def test_a_daemon_that_cannot_bind_exits_2_at_once(corpus, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    base = [sys.executable, "-c", BOOT, str(corpus / "manifest.json"), str(corpus / "run.toml"),
            "--cache", str(tmp_path / "cache"), "--log-level", "error"]
    try:
        t0 = time.monotonic()
        proc = subprocess.run(base + ["--endpoint", f"tcp://127.0.0.1:{port}", "--token-file", str(token_file)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "cannot listen on tcp://127.0.0.1:" in proc.stderr and "Traceback" not in proc.stderr
        assert time.monotonic() - t0 < 30
    finally:
        taken.close()
    # an abstract socket has no permission bits: refused without a token, exit 2
    proc = subprocess.run(base + ["--endpoint", f"ipc://@sluice-test-{time.time_ns()}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "abstract socket" in proc.stderr and "Traceback" not in proc.stderr


def test_peek_needs_the_token_and_reads_with_it(daemon, tmp_path, capsys, monkeypatch):
    from sluice.cli import main

    floor = stats(daemon)["replicas"]["0"]["floor_step"]
    steps = f"{floor}:{floor + 1}"
    monkeypatch.delenv(runtoken.TOKEN_ENV, raising=False)
    assert main(["peek", daemon.endpoint, "--steps", steps, "--observe", "--timeout", "20"]) == 2
    assert "UNAUTHORIZED" in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    assert main(["peek", daemon.endpoint, "--steps", steps, "--observe", "--json", "--token-file",
                 str(token_file)]) == 0
    assert '"step": %d' % floor in capsys.readouterr().out
    monkeypatch.setenv(runtoken.TOKEN_ENV, TOKEN)
    assert main(["peek", daemon.endpoint, "--steps", steps, "--observe", "--json"]) == 0


def wait_until(probe, d: Daemon, ok, what: str, timeout: float = 20.0) -> dict:
    """Poll STATS on `probe` (one long-lived connection) until ok(stats); fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        st = dict(ask(probe, d, kind=protocol.STATS).body["stats"])
        if ok(st):
            return st
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s (stats {st})"
        time.sleep(0.05)


def test_gets_parked_by_a_client_that_went_away_release_nothing(corpus, tmp_path):
    # A client parks GETs for every micro-batch of a future step and dies. When the
    # step is made, sending to the gone client fails: it must not count as a
    # delivery, or the step is released before the live client gets it.
    # Its own daemon, with a TTL no test outlives: the GETs stay parked until the step
    # is made (with the module's 0.5 s TTL a slow machine expired them first and the
    # test proved nothing). Every wait is for a condition the daemon reports, on one
    # STATS connection, so no other connection is open while it counts.
    d = Daemon(corpus, cache=tmp_path / "cache", token=TOKEN, extra=("--request-ttl", "600", "--lead-steps", "2"))
    d.start()
    probe = raw(d)
    try:
        wait_until(probe, d, lambda st: st["connections"] == 1, "the probe is the only connection")
        floor = wait_until(probe, d, lambda st: True, "stats")["replicas"]["0"]["floor_step"]
        mps = 4  # global_batch 8 / micro_batch 2, one replica
        far = floor + 2 + 1  # beyond the prefetch lead: parked
        gone = raw(d)
        for micro in range(mps):
            gone.send_multipart(encoding.encode(protocol.Header(
                kind=protocol.GET, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0,
                step=far, micro=micro, request_id=100 + micro, body={"token": TOKEN})))
        wait_until(probe, d, lambda st: st["replicas"]["0"]["pending"] == mps and st["connections"] == 2,
                   "the gone client's GETs are parked")
        gone.close(0)
        # The daemon has seen the disconnect (libzmq reported it): a reply to the gone client now fails.
        # A reply sent before that would leave into the socket buffer and look like any delivery.
        before = wait_until(probe, d, lambda st: st["connections"] == 1, "the daemon sees the disconnect")
        assert before["replicas"]["0"]["pending"] == mps  # still parked: the step was not made yet
        live = d.client(0, 1, token=TOKEN, timeout_s=30)
        got = in_thread(lambda: take_steps(live, 5), 60)  # before the fix: OUT_OF_RANGE at step `far`
        live.close()
        ref = reference(corpus, max(b["step"] for b in got) + 1, 1)
        digests = stream_digests(got, mps)
        assert far in digests and all(ref[(step, 0)][0] == dg for step, dg in digests.items())
        # every parked GET of the gone client was answered into the void, none as a delivery
        after = dict(ask(probe, d, kind=protocol.STATS).body["stats"])
        assert after["undeliverable"] - before["undeliverable"] >= mps
    finally:
        probe.close(0)
        d.stop()


def test_a_metrics_port_in_use_is_named_and_exits_2(corpus, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-c", BOOT, str(corpus / "manifest.json"), str(corpus / "run.toml"),
                               "--cache", str(tmp_path / "cache"), "--log-level", "error", "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert f"loaderd: error: cannot serve metrics on 127.0.0.1:{port} (--metrics-port)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_endpoint_file_in_a_missing_folder_is_refused_before_the_start(corpus, tmp_path, sluice_main):
    missing = tmp_path / "missing" / "ep"
    res = sluice_main("loaderd", corpus / "manifest.json", corpus / "run.toml", "--cache", tmp_path / "cache",
                      "--endpoint-file", missing)
    assert res.returncode == 2
    assert res.stderr.strip() == f"sluice: error: loaderd: --endpoint-file {missing}: folder {missing.parent} does not exist"
    assert not (tmp_path / "cache").exists()  # refused before anything was made


@pytest.mark.parametrize("flag", ["--cache", "--state-dir"])
def test_a_folder_flag_below_a_file_is_refused_before_the_start(corpus, tmp_path, sluice_main, flag):
    """A cache or state folder that cannot be made (a file where a parent folder should be) is named with its
    flag before anything is made, not as an inner path the daemon's start failed on."""
    (tmp_path / "afile").write_text("x")
    where = tmp_path / "afile" / "sub"
    args = {"--cache": tmp_path / "cache", flag: where}
    res = sluice_main("loaderd", corpus / "manifest.json", corpus / "run.toml", *[x for kv in args.items() for x in kv])
    assert res.returncode == 2
    assert res.stderr.strip() == (f"sluice: error: loaderd: {flag} {where}: cannot make this folder: "
                                  f"{tmp_path / 'afile'} is not a folder")
    assert not (tmp_path / "cache").exists()
