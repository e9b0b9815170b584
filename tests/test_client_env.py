"""`Client.from_env()`: endpoint, replica, token and CurveZMQ keys from the environment, as torchrun's ranks.

A real daemon on tcp with CurveZMQ and a run token: a client made from
RANK/WORLD_SIZE, SLUICE_ENDPOINT_FILE, SLUICE_TOKEN_FILE and SLUICE_CURVE_*
reads its replica's micro-batches. Every missing or bad variable is a
SpecError naming it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from loaderd_support import build_corpus

from sluice.client import Client, EmbeddedDaemon
from sluice.curve import generate
from sluice.errors import DaemonError, SpecError


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("env-keys")
    daemon_public, daemon_secret = generate(root / "daemon", "loaderd")
    trainer_public, trainer_secret = generate(root / "own", "trainer-0")
    (root / "trainers").mkdir()
    shutil.copy(trainer_public, root / "trainers")  # the daemon's allowed clients: public keys only
    token = root / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"0123456789abcdef0123456789abcdef\n")
    os.close(fd)
    return {"daemon_secret": daemon_secret, "daemon_public": daemon_public, "clients": str(root / "trainers"),
            "secret": trainer_secret, "token": str(token)}


@pytest.mark.slow  # a daemon process
def test_a_rank_made_from_the_environment_reads_its_replica_over_curve(tmp_path, tokenizer_file, keys):
    corpus = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=80)
    endpoint_file = tmp_path / "endpoint"
    daemon = EmbeddedDaemon(corpus / "manifest.json", corpus / "run.toml", cache_dir=tmp_path / "cache", replicas=2,
                            extra_args=("--endpoint", "tcp://127.0.0.1:*", "--endpoint-file", str(endpoint_file),
                                        "--curve-secret", keys["daemon_secret"], "--curve-clients", keys["clients"],
                                        "--token-file", keys["token"]))
    try:
        env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLUICE_ENDPOINT_FILE": str(endpoint_file),
               "SLUICE_TOKEN_FILE": keys["token"], "SLUICE_CURVE_SECRET": keys["secret"],
               "SLUICE_CURVE_SERVER": keys["daemon_public"]}
        with Client.from_env(env, as_numpy=True, end_step=1) as client:
            assert (client.endpoint, client.replica, client.replicas) == (daemon.endpoint, 1, 2)
            client.reset()
            got = [(mb["step"], mb["micro"]) for mb in client]
        assert got == [(0, 0), (0, 1)]  # replica 1's share of step 0: global batch 8 = 2 replicas x 2 x 2
        without_keys = {k: v for k, v in env.items() if not k.startswith("SLUICE_CURVE")}
        with Client.from_env(without_keys, connect_s=1.0, reconnect_s=2.0, timeout_s=1.0) as client:
            with pytest.raises(DaemonError, match="UNAUTHORIZED.*CurveZMQ keys are not the daemon"):  # CURVE only
                client.reset()
    finally:
        daemon.close()


def _env(**kw: str) -> dict[str, str]:
    return {"SLUICE_ENDPOINT": "ipc:///tmp/x.sock", **kw}


@pytest.mark.parametrize("env, says", [
    ({}, r"\$SLUICE_ENDPOINT is not set"),
    (_env(RANK="0"), r"\$RANK is set but \$WORLD_SIZE is not"),
    (_env(WORLD_SIZE="2"), r"\$WORLD_SIZE is set but \$RANK is not"),
    (_env(RANK="2", WORLD_SIZE="2"), r"\$RANK 2 gives replica 2, not below 2 replicas \(\$WORLD_SIZE 2\)"),
    (_env(RANK="one", WORLD_SIZE="2"), r"\$RANK is 'one'; expected an integer >= 0"),
    (_env(RANK="0", WORLD_SIZE="3", SLUICE_PEERS="2"), r"\$WORLD_SIZE 3 is not a multiple of \$SLUICE_PEERS 2"),
    (_env(SLUICE_ENDPOINT="localhost:5555"), r"the endpoint 'localhost:5555' is not ipc://... or tcp://host:port"),
    (_env(SLUICE_ENDPOINT_FILE="/nonexistent/ep"), r"both \$SLUICE_ENDPOINT and \$SLUICE_ENDPOINT_FILE are set"),
    ({"SLUICE_ENDPOINT_FILE": "/nonexistent/ep"}, r"\$SLUICE_ENDPOINT_FILE /nonexistent/ep: cannot read it"),
    (_env(SLUICE_TOKEN="short"), r"\$SLUICE_TOKEN: a run token must be 16 to 256"),
    (_env(SLUICE_TOKEN="0123456789abcdef", SLUICE_TOKEN_FILE="/t"), r"both \$SLUICE_TOKEN and \$SLUICE_TOKEN_FILE"),
    (_env(SLUICE_TOKEN_FILE="/nonexistent/token"), r"\$SLUICE_TOKEN_FILE: token file /nonexistent/token"),
    (_env(SLUICE_CURVE_SECRET="/nonexistent/k.key_secret", SLUICE_CURVE_SERVER="/k.key"),
     r"\$SLUICE_CURVE_SECRET / \$SLUICE_CURVE_SERVER: client curve secret /nonexistent/k.key_secret"),
    (_env(SLUICE_CURVE_SECRET="/k.key_secret"), r"\$SLUICE_CURVE_SECRET is set but \$SLUICE_CURVE_SERVER is not"),
    (_env(SLUICE_CURVE_SERVER="/k.key"), r"\$SLUICE_CURVE_SERVER is set but \$SLUICE_CURVE_SECRET is not"),
])
def test_a_missing_or_bad_variable_is_named(env, says):
    with pytest.raises(SpecError, match=r"^Client.from_env: " + says):
        Client.from_env(env)


def test_rank_and_world_size_map_to_replicas_and_peers(keys):
    from sluice.client.env import client_args

    one = client_args(_env())
    assert (one["replica"], one["replicas"], one["token"], one["curve"]) == (0, 1, None, None)  # no launcher
    got = client_args(_env(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", SLUICE_PEERS="2"))
    assert (got["replica"], got["replicas"], got["peers"]) == (2, 4, 2)  # ranks 4, 5 read replica 2
    got = client_args(_env(RANK="5", WORLD_SIZE="8", SLUICE_REPLICA="1", SLUICE_REPLICAS="2"))
    assert (got["replica"], got["replicas"]) == (1, 2)  # the launcher's own numbering wins over torchrun's
    got = client_args(_env(SLUICE_TOKEN_FILE=keys["token"], SLUICE_CURVE_SECRET=keys["secret"],
                           SLUICE_CURVE_SERVER=keys["daemon_public"]))
    assert got["token"] == "0123456789abcdef0123456789abcdef" and got["curve"].server_public


def test_a_node_file_gives_the_endpoint_and_keys_and_the_environment_wins(tmp_path, keys):
    from sluice.client.env import client_args

    node = tmp_path / "node"
    (node / "keys").mkdir(parents=True)
    for name in ("secret", "daemon_public"):
        src = Path(keys[name])
        (node / "keys" / src.name).write_bytes(src.read_bytes())
        os.chmod(node / "keys" / src.name, 0o600)
    (node / "endpoint").write_text("tcp://127.0.0.1:5555\n")
    node_file = node / "node.env"
    node_file.write_text("# node 1, written at provisioning\nSLUICE_NODE_RANK=1\n\nSLUICE_ENDPOINT_FILE=endpoint\n"
                         f"export SLUICE_CURVE_SECRET=keys/{Path(keys['secret']).name}\n"
                         f"SLUICE_CURVE_SERVER=\"keys/{Path(keys['daemon_public']).name}\"\n"
                         f"SLUICE_TOKEN_FILE={keys['token']}\n")
    got = client_args({"SLUICE_NODE_FILE": str(node_file), "RANK": "3", "WORLD_SIZE": "4"})
    assert (got["endpoint"], got["replica"], got["replicas"]) == ("tcp://127.0.0.1:5555", 3, 4)  # relative paths
    assert got["curve"].server_public and got["token"] == "0123456789abcdef0123456789abcdef"
    # the environment's setting replaces the file's (the pair as one): no "both are set" error
    got = client_args({"SLUICE_NODE_FILE": str(node_file), "SLUICE_ENDPOINT": "ipc:///tmp/x.sock",
                       "SLUICE_TOKEN": "fedcba9876543210"})
    assert (got["endpoint"], got["token"], got["curve"] is not None) == ("ipc:///tmp/x.sock", "fedcba9876543210", True)


@pytest.mark.parametrize("text, says", [
    (None, r"cannot read it"),
    ("SLUICE_ENDPOINT tcp://h:1\n", r"line 1: expected NAME=value"),
    ("# c\nSLUICE_CURVE_SECRT=k\n", r"line 2: 'SLUICE_CURVE_SECRT' is not a node setting"),
    ("SLUICE_TOKEN=0123456789abcdef\n", r"line 1: 'SLUICE_TOKEN' is not a node setting"),
    ("SLUICE_ENDPOINT=tcp://h:1\nSLUICE_ENDPOINT=tcp://h:2\n", r"line 2: SLUICE_ENDPOINT is set twice"),
    ("SLUICE_ENDPOINT=\n", r"line 1: SLUICE_ENDPOINT is empty"),
    ("SLUICE_ENDPOINT='tcp://h:1\n", r"line 1: unmatched quote"),
    ("SLUICE_ENDPOINT=tcp://h:1\nSLUICE_ENDPOINT_FILE=ep\n",
     r"line 2: SLUICE_ENDPOINT_FILE and SLUICE_ENDPOINT \(set above\) say the same thing"),
])
def test_a_bad_node_file_is_named_with_its_line(tmp_path, text, says):
    node_file = tmp_path / "node.env"
    if text is not None:
        node_file.write_text(text)
    with pytest.raises(SpecError, match=rf"^Client.from_env: \$SLUICE_NODE_FILE {re.escape(str(node_file))}:? {says}"):
        Client.from_env({"SLUICE_NODE_FILE": str(node_file)})


def test_the_shipped_node_env_example_is_a_node_file(tmp_path):
    from sluice.client.nodefile import parse_node_file

    example = Path(__file__).resolve().parent.parent / "deploy" / "node.env.example"
    node_file = tmp_path / "node.env"  # the trainer lines switched on, as an operator would
    node_file.write_text(example.read_text().replace("#SLUICE_", "SLUICE_"))
    assert parse_node_file(node_file) == {"SLUICE_ENDPOINT_FILE": "/run/sluice/endpoint",
                                          "SLUICE_CURVE_SECRET": str(tmp_path / "keys/trainer.key_secret"),
                                          "SLUICE_CURVE_SERVER": str(tmp_path / "keys/loaderd.key")}
