"""`--engine ray --address`: a cluster that cannot be used is named, with the cause, within the bound.

Real peers on 127.0.0.1, no mocks. The fast tier drives `check_cluster` (no Ray
import on these paths) with a short bound: nobody listening, a port that accepts
TCP and says nothing, one that closes at once, one that answers as something
else. The slow tier starts a real Ray head with token authentication (one
process, about 8 s on a loaded 2-core machine) and runs the CLI against it with
a stale token file, a RAY_AUTH_TOKEN_PATH naming a missing file (Ray's own
loader aborts the process on it), token mode off, and the right token; and the
CLI against a silent port with the documented 10 s bound.

Before (main): a stale token failed after 21 s (Ray's 20 GCS retries) with
"Failed to connect to Ray cluster at 192.0.2.2:P" for --address 127.0.0.1:P
and no cause; a silent port hung for minutes. Bounds are asserted as a generous
multiple of the configured one, never as an absolute time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.engines.ray_connect import CONNECT_TIMEOUT_S, check_cluster, split_address
from sluice.errors import EngineError

SLACK = 5  # a generous multiple of a bound: the machine is shared and loaded


@pytest.fixture
def peer() -> Iterator[Callable[[Callable[[socket.socket], None]], int]]:
    """A TCP listener on 127.0.0.1 whose accepted connections are given to `behave`; returns its port."""
    listeners: list[socket.socket] = []
    accepted: list[socket.socket] = []

    def start(behave: Callable[[socket.socket], None]) -> int:
        srv = socket.create_server(("127.0.0.1", 0))
        listeners.append(srv)

        def loop() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return  # closed by the fixture
                accepted.append(conn)
                behave(conn)

        threading.Thread(target=loop, daemon=True).start()
        return srv.getsockname()[1]

    yield start
    for s in listeners + accepted:
        s.close()


def failure(address: str, timeout_s: float) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        check_cluster(address, timeout_s=timeout_s)
    return str(err.value), time.monotonic() - t0


def test_nobody_listening_is_named_as_refused():
    port = socket.create_server(("127.0.0.1", 0)).getsockname()[1]  # closed at once: nothing listens there
    msg, _ = failure(f"127.0.0.1:{port}", 2.0)
    assert f"cannot connect to the Ray cluster at 127.0.0.1:{port}" in msg and "connection refused" in msg


def test_a_port_that_accepts_and_says_nothing_fails_within_the_bound(peer):
    port = peer(lambda conn: None)  # accepts, never answers (what hung `ray.init` for minutes)
    msg, took = failure(f"127.0.0.1:{port}", 1.0)
    assert f"127.0.0.1:{port}" in msg and "sent nothing within 1 s" in msg and "not a Ray GCS" in msg
    assert took < 1.0 * SLACK, took


def test_a_peer_that_closes_or_answers_otherwise_is_not_a_gcs(peer):
    closes = peer(lambda conn: conn.close())
    msg, _ = failure(f"127.0.0.1:{closes}", 2.0)
    assert f"127.0.0.1:{closes}" in msg and "closed this one without answering" in msg

    http = peer(lambda conn: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
    msg, _ = failure(f"ray://127.0.0.1:{http}", 2.0)
    assert f"ray://127.0.0.1:{http}" in msg and "not as a gRPC server" in msg and "HTTP/1.1" in msg


@pytest.mark.parametrize("bad", ["head", "head:port", "http://head:6379", "ray://:10001"])
def test_a_malformed_address_is_named(bad):
    with pytest.raises(EngineError, match="is not host:port, ray://host:port or auto") as err:
        split_address(bad)
    assert repr(bad) in str(err.value)


# ---- slow tier: a real Ray head with token authentication ----

HEAD = r"""
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
import ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
         object_store_memory=80 << 20, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address, flush=True)
try:
    signal.pause()
finally:
    ray.shutdown()
"""
GOOD_TOKEN = "a" * 32
PROBE = r"""
import sys
from sluice.engines.ray_engine import ray_session
with ray_session(sys.argv[1]) as ray:
    print("connected", int(ray.cluster_resources()["CPU"]))
"""


@pytest.fixture(scope="module")
def token_head() -> Iterator[str]:
    """A Ray head on 127.0.0.1 with RAY_AUTH_MODE=token; yields its GCS port as 127.0.0.1:P."""
    pytest.importorskip("ray")
    root = Path(tempfile.mkdtemp(prefix="srh", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, HOME=str(root / "home"), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=GOOD_TOKEN,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # Ray's local-only mode: listens on loopback
    proc = subprocess.Popen([sys.executable, "-c", HEAD, str(root / "r")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    try:
        assert line and line[0].strip(), "the Ray head did not start within 120 s"
        yield f"127.0.0.1:{line[0].strip().rsplit(':', 1)[1]}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def cli_freeze(address: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """`sluice manifest freeze --engine ray --address ADDRESS` with HOME in tmp_path and `env` on top."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    (tmp_path / "dataset.toml").write_text('[[sources]]\nname = "a"\npaths = ["*.jsonl"]\n')
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(tmp_path / "dataset.toml"),
                           "-o", str(tmp_path / "m.json"), "--engine", "ray", "--address", address],
                          env=dict(base, HOME=str(home), **env), capture_output=True, text=True,
                          timeout=CONNECT_TIMEOUT_S * 12)
    return proc, time.monotonic() - t0


def assert_named(proc: subprocess.CompletedProcess, took: float, address: str, *causes: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"sluice: error: ray engine: cannot connect to the Ray cluster at {address}:" in proc.stderr
    for cause in causes:
        assert cause in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "192.0.2" not in proc.stderr
    assert took < CONNECT_TIMEOUT_S * 3, took  # Ray alone: 21 s for a refused token, minutes for a silent port


@pytest.mark.slow
def test_a_stale_token_file_is_named_as_the_cause(token_head, tmp_path):
    stale = tmp_path / "stale_token"
    stale.write_text("b" * 32)
    proc, took = cli_freeze(token_head, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(stale))
    assert_named(proc, took, token_head, f"refused the token file {stale}", "stale or wrong token")
    # the same stale token in ~/.ray/auth_token (what an earlier local Ray leaves behind)
    (tmp_path / "home" / ".ray").mkdir(parents=True)
    (tmp_path / "home" / ".ray" / "auth_token").write_text("c" * 32)
    proc, took = cli_freeze(token_head, tmp_path, RAY_AUTH_MODE="token")
    assert_named(proc, took, token_head, f"refused the token file {tmp_path / 'home' / '.ray' / 'auth_token'}")


@pytest.mark.slow
def test_an_unreadable_token_path_and_token_mode_off_are_named(token_head, tmp_path):
    missing = tmp_path / "no_such_token"
    proc, took = cli_freeze(token_head, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(missing))
    assert_named(proc, took, token_head, f"RAY_AUTH_TOKEN_PATH={missing}: it cannot be read")  # Ray: abort()
    proc, took = cli_freeze(token_head, tmp_path, RAY_AUTH_TOKEN=GOOD_TOKEN)
    assert_named(proc, took, token_head, "RAY_AUTH_MODE is not 'token' here", "set RAY_AUTH_MODE=token")


@pytest.mark.slow
def test_the_right_token_connects(token_head, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.run([sys.executable, "-c", PROBE, token_head], capture_output=True, text=True, timeout=120,
                          env=dict(env, HOME=str(tmp_path), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=GOOD_TOKEN))
    assert proc.returncode == 0 and "connected 1" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow
def test_the_cli_names_a_silent_port_within_the_documented_bound(peer, tmp_path):
    port = peer(lambda conn: None)
    proc, took = cli_freeze(f"127.0.0.1:{port}", tmp_path)
    assert_named(proc, took, f"127.0.0.1:{port}", f"sent nothing within {CONNECT_TIMEOUT_S:g} s")
