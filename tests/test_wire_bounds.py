"""loaderd's wire and files under attack (issue 27 item 7): secrets' owners and modes, the metrics labels.

Real daemon processes, real sockets and files (refusals of arguments and files, made before any socket or
thread, through loaderd's entry point in this process; one in a real process); bench/results/hardening-log.md
("Issue 27: daemon and wire") lists input, expected and observed for each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaderd_support import BOOT, Daemon, build_corpus
from sluice.client.transport import close_dealer, dealer
from sluice.curve import generate
from sluice.errors import SpecError
from sluice.wire import decoding, encoding, protocol, runtoken

TOKEN = "wire-bounds-token-" + "5" * 16
NOBODY = 65534  # a uid that is not this process's


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("wire-bounds"), "jsonl.zst", tokenizer_file, docs=60)


def loaderd(corpus, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """A real `loaderd` that is expected to refuse its start (bounded: 60 s)."""
    return subprocess.run([sys.executable, "-c", BOOT, str(corpus / "manifest.json"), str(corpus / "run.toml"),
                           "--cache", str(tmp_path / "cache"), "--log-level", "error", *extra],
                          capture_output=True, text=True, timeout=60)


def loaderd_here(sluice_main, corpus, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """`loaderd`'s entry point in this process, for a start it refuses while reading its arguments and files
    (before any socket, signal handler or thread): the same exit code and message as `loaderd`'s process."""
    from sluice.loaderd.cli import main as loaderd_main

    return sluice_main(corpus / "manifest.json", corpus / "run.toml", "--cache", tmp_path / "cache",
                       "--log-level", "error", *extra, entry=loaderd_main)


def owned_by_another_user(path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY)


def test_a_token_file_of_another_user_is_refused_with_exit_2(corpus, tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert runtoken.read_token_file(str(f)) == TOKEN
    owned_by_another_user(f)  # mode 0600 still: only the owner check can refuse it
    with pytest.raises(SpecError, match=rf"token file {f}: owned by uid {NOBODY}, not by this user"):
        runtoken.read_token_file(str(f))
    proc = loaderd(corpus, tmp_path, "--token-file", str(f))
    assert proc.returncode == 2, proc.stderr
    assert f"loaderd: error: token file {f}: owned by uid {NOBODY}, not by this user" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before anything was made


@pytest.fixture()
def keys(tmp_path):
    server_pub, server_sec = generate(tmp_path / "own", "loaderd")
    client_pub, _ = generate(tmp_path / "own", "trainer")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(client_pub, allowed / "trainer.key")
    return {"server_pub": server_pub, "server_sec": server_sec, "allowed": allowed}


@pytest.mark.parametrize("damage", ["mode 0640", "mode 0604", "another user"])
def test_a_curve_secret_key_readable_by_others_or_of_another_user_is_refused(corpus, tmp_path, keys, damage,
                                                                             sluice_main):
    secret = keys["server_sec"]
    if damage == "another user":
        owned_by_another_user(secret)
        expected = f"loaderd curve secret {secret}: owned by uid {NOBODY}, not by this user"
    else:
        os.chmod(secret, int(damage.split()[1], 8))
        expected = f"loaderd curve secret {secret}: {damage} lets other users read it; chmod 600 it"
    proc = loaderd_here(sluice_main, corpus, tmp_path, "--endpoint", "tcp://127.0.0.1:*", "--curve-secret",
                        str(secret), "--curve-clients", str(keys["allowed"]))
    assert proc.returncode == 2, proc.stderr
    assert f"loaderd: error: {expected}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def metrics_text(d: Daemon) -> str:
    port = d.info["metrics_port"]
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_the_metrics_port_names_the_run_and_dataset_only_when_asked(corpus, tmp_path):
    for extra, shown in ((), False), (("--metrics-ids",), True):
        d = Daemon(corpus, cache=tmp_path / "cache", token=TOKEN, extra=("--metrics-port", "0", *extra)).start()
        try:
            text = metrics_text(d)
        finally:
            d.stop()
        run_id, dataset_id = d.info["run_id"], d.info["dataset_id"]
        assert "sluice_generation{" in text
        assert (f'run_id="{run_id}"' in text and f'dataset_id="{dataset_id}"' in text) is shown, extra
        if not shown:  # not even a part of the IDs: every run/dataset label says it is hidden
            assert dataset_id.removeprefix("b3:")[:8] not in text
            assert 'sluice_generation{dataset_id="hidden",run_id="hidden"}' in text


# -- idle connections: each holds a descriptor until its handshake ends ----------------------
@pytest.fixture()
def many_descriptors():
    """Let this process open 2,048 descriptors (restored after); skip where the hard limit forbids it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard descriptor limit {hard} is below 2,048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def tcp_peer(d: Daemon) -> tuple[str, int]:
    host, port = d.endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@pytest.mark.slow
def test_a_thousand_idle_connections_do_not_delay_a_real_client(corpus, tmp_path, many_descriptors):
    import resource
    import socket
    import time

    soft, hard = many_descriptors
    # the daemon starts under the common default soft limit of 1,024 descriptors (it raises it to the hard one)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        d = Daemon(corpus, cache=tmp_path / "cache", token=TOKEN, endpoint="tcp://127.0.0.1:*").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):  # a stranger's connections that never send a byte
            idle.append(socket.create_connection(tcp_peer(d), timeout=10))
        t0 = time.monotonic()
        client = d.client(timeout_s=30)
        try:
            first = next(iter(client))
        finally:
            client.close()
        waited = time.monotonic() - t0
        assert first["step"] == 0
        # before: 22.3 s (no descriptor left; the idle ones held theirs for libzmq's 30 s handshake limit)
        assert waited < 5, f"a real client waited {waited:.1f} s behind 1,000 idle connections"
    finally:
        for s in idle:
            s.close()
        d.stop()


@pytest.mark.slow
def test_a_connection_that_never_handshakes_is_dropped_within_the_handshake_limit(corpus, tmp_path):
    import socket
    import time

    from sluice.loaderd.endpoint import HANDSHAKE_S

    with Daemon(corpus, cache=tmp_path / "cache", token=TOKEN, endpoint="tcp://127.0.0.1:*") as d:
        s = socket.create_connection(tcp_peer(d), timeout=HANDSHAKE_S + 10)
        try:
            t0 = time.monotonic()
            while s.recv(4096):  # libzmq's greeting, then the end of the connection
                pass
            held = time.monotonic() - t0
        finally:
            s.close()
    # before: 30 s (libzmq's default ZMQ_HANDSHAKE_IVL); the recv timeout would have failed this test
    assert held < HANDSHAKE_S + 3, held


# -- large messages from token holders: memory bounded by --memory-limit --------------------
def vm_hwm_bytes(pid: int) -> int:
    """Peak resident memory of a process (VmHWM, /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmHWM for pid {pid}")


def daemon_stats(d: Daemon) -> dict:
    """STATS on a fresh connection (a wire reset drops every open one, a request in flight with it: asked again
    on a new connection after 5 s without a reply); bounded wait, 30 s in all."""
    import time

    import zmq

    deadline = time.monotonic() + 30
    while True:
        s = dealer(zmq.Context.instance(), d.endpoint, token=TOKEN)
        try:
            s.send_multipart(encoding.encode(protocol.Header(kind=protocol.STATS, body={"token": TOKEN})))
            if s.poll(5_000):
                return dict(decoding.decode(s.recv_multipart(copy=False), protocol.Limits.for_client()).body["stats"])
        finally:
            close_dealer(s)
        assert time.monotonic() < deadline, "no STATS reply within 30 s (asked on a new connection every 5 s)"


@pytest.mark.slow
def test_large_messages_from_token_holders_at_once_stay_within_the_memory_limit(corpus, tmp_path):
    import threading
    import time

    import zmq

    from loaderd_support import reference, stream_digests
    from sluice.loaderd.memguard import HEADROOM

    # auto limit: memory at start + 4 MiB queue + 16 MiB decoded + HEADROOM (about 600 MiB here)
    d = Daemon(corpus, cache=tmp_path / "cache", token=TOKEN,
               extra=("--queue-bytes", "4MiB", "--decoded-bytes", "16MiB", "--lead-steps", "2")).start()
    senders: list[zmq.Socket] = []
    try:
        limit = daemon_stats(d)["memory_limit"]
        assert HEADROOM < limit < HEADROOM + (256 << 20), limit
        client = d.client(timeout_s=2)
        got: list[dict] = []
        gaps: list[float] = []
        resumed = threading.Event()
        failed: list[BaseException] = []

        def read() -> None:  # the good client, reading all along; 20 steps once the attack is over
            import numpy as np

            last, after = time.monotonic(), None
            try:
                for mb in client:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    got.append({k: (np.asarray(v).copy() if k not in ("step", "micro") else v) for k, v in mb.items()})
                    if resumed.is_set():
                        after = mb["step"] + 20 if after is None else after
                        if mb["step"] >= after:
                            return
            except BaseException as exc:  # reported by the test
                failed.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # three token holders at once, each one message of 100 x 4 MiB frames (1.2 GiB in all; before:
        # libzmq held all of it, 3,061 MiB peak for 3 x 250 frames)
        header = encoding.encode_header(protocol.Header(kind=protocol.STATS, body={"token": TOKEN}))
        big = b"\1" * (4 << 20)
        for _ in range(3):
            s = dealer(zmq.Context.instance(), d.endpoint, token=TOKEN)
            s.send_multipart([header] + [big] * 100, copy=False)
            senders.append(s)
        deadline = time.monotonic() + 120
        while daemon_stats(d)["wire_resets"] < 1:
            assert time.monotonic() < deadline, "the memory guard never acted"
            assert reader.is_alive(), failed
            time.sleep(0.2)
        resumed.set()
        reader.join(120)
        assert not reader.is_alive(), "the good client did not read 20 steps within 120 s of the reset"
        assert not failed, failed
        client.close()
        peak = vm_hwm_bytes(d.pid)
        print(f"large messages: limit {limit >> 20} MiB, daemon peak {peak >> 20} MiB, good client's longest "
              f"wait {max(gaps):.2f} s")  # the figures of bench/results/hardening-log.md (-s shows them)
        # bound: the limit plus what arrives within one 10 ms sample and the reset (measured: 1,088 MiB
        # against an auto limit of about 1,085 MiB with the default queue and decoded bytes)
        assert peak < limit + (128 << 20), (peak >> 20, limit >> 20)
        # the good client: stalled at most its timeout_s (2 s) and a RESTORE, and got exactly the plan
        assert max(gaps) < 2 + 8, max(gaps)
        ref = reference(corpus, max(mb["step"] for mb in got) + 1, 1)
        digests = stream_digests(got, client.info["micro_per_step"])
        assert len(digests) >= 20 and all(ref[(step, 0)][0] == dg for step, dg in digests.items())
    finally:
        for s in senders:
            close_dealer(s)
        d.stop()


def test_memory_above_the_limit_that_a_reset_does_not_free_disarms_the_guard_until_it_is_below():
    import zmq

    from sluice.loaderd.memguard import AnonMemory, MemoryGuard

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://memguard-test")
    guard = MemoryGuard(1, ctx, "inproc://memguard-test")  # every process is over a 1-byte limit
    guard.start()
    try:
        assert pull.poll(5000) and pull.recv() == MemoryGuard.WAKE and guard.tripped
        read = AnonMemory()
        assert guard.handled(read()) is False  # still over the limit: not the wire's memory
        read.close()
        assert guard.over_limit_not_wire == 1 and not guard.tripped
        assert not pull.poll(300)  # disarmed: no reset after reset while the memory stays above the limit
        assert guard.trips == 1 and guard.peak > 1
    finally:
        guard.stop()
        pull.close(0)
        ctx.term()


@given(used=st.integers(0, 1 << 40), grew=st.integers(-(1 << 32), 1 << 32), limit=st.integers(1, 1 << 40))
def test_the_guard_samples_calmly_only_far_under_the_limit_and_without_growth(used, grew, limit):
    from sluice.loaderd.memguard import CALM_INTERVAL_S, CALM_MARGIN, INTERVAL_S, RISE, period_after

    calm = used + CALM_MARGIN < limit and grew < RISE
    assert period_after(used, used - grew, limit) == (CALM_INTERVAL_S if calm else INTERVAL_S)


def test_an_idle_guard_samples_at_the_calm_period_and_one_near_its_limit_at_the_short_one():
    import time

    import zmq

    from sluice.loaderd.memguard import CALM_INTERVAL_S, CALM_MARGIN, AnonMemory, MemoryGuard

    def samples_in_a_second(limit_above: int) -> int:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://memguard-calm")
        read = AnonMemory()
        guard = MemoryGuard(read() + limit_above, ctx, "inproc://memguard-calm")
        guard.start()
        try:
            time.sleep(0.3)
            n0 = guard.samples
            time.sleep(1.0)
            assert not guard.tripped
            return guard.samples - n0
        finally:
            guard.stop()
            read.close()
            pull.close(0)
            ctx.term()

    calm = samples_in_a_second(4 << 30)  # far under the limit, not growing: every 50 ms
    near = samples_in_a_second(CALM_MARGIN // 2)  # within the margin: every 10 ms (about 100)
    assert calm <= 1.0 / CALM_INTERVAL_S + 2 and near > 2 * calm, (calm, near)


def test_a_memory_limit_that_is_not_a_size_is_refused(corpus, tmp_path, sluice_main):
    proc = loaderd_here(sluice_main, corpus, tmp_path, "--memory-limit", "lots")
    assert proc.returncode == 2 and "size 'lots' is not a number of bytes" in proc.stderr, proc.stderr
