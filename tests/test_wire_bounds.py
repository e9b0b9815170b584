"""loaderd's wire and files under attack (issue 27 item 7): secrets' owners and modes, the metrics labels.

Real daemon processes, real sockets and files; docs/hardening.md ("Issue 27:
daemon and wire") lists input, expected and observed for each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

from loaderd_support import BOOT, Daemon, build_corpus
from sluice import wire
from sluice.curve import generate
from sluice.errors import SpecError

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


def owned_by_another_user(path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY)


def test_a_token_file_of_another_user_is_refused_with_exit_2(corpus, tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert wire.read_token_file(str(f)) == TOKEN
    owned_by_another_user(f)  # mode 0600 still: only the owner check can refuse it
    with pytest.raises(SpecError, match=rf"token file {f}: owned by uid {NOBODY}, not by this user"):
        wire.read_token_file(str(f))
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
def test_a_curve_secret_key_readable_by_others_or_of_another_user_is_refused(corpus, tmp_path, keys, damage):
    secret = keys["server_sec"]
    if damage == "another user":
        owned_by_another_user(secret)
        expected = f"loaderd curve secret {secret}: owned by uid {NOBODY}, not by this user"
    else:
        os.chmod(secret, int(damage.split()[1], 8))
        expected = f"loaderd curve secret {secret}: {damage} lets other users read it; chmod 600 it"
    proc = loaderd(corpus, tmp_path, "--endpoint", "tcp://127.0.0.1:*", "--curve-secret", str(secret),
                   "--curve-clients", str(keys["allowed"]))
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
