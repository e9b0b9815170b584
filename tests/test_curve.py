"""CurveZMQ: encrypted, authenticated connections; TCP beyond loopback only with keys."""

from __future__ import annotations

import shutil

import pytest
from loaderd_support import Daemon, build_corpus

from sluice.client import DaemonUnavailable
from sluice.curve import generate, load_client_keys


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("curve"), "jsonl.zst", tokenizer_file, docs=60)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    server_pub, server_sec = generate(root / "own", "loaderd")
    client_pub, client_sec = generate(root / "own", "trainer")
    _, stranger_sec = generate(root / "strangers", "stranger")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copy(client_pub, allowed / "trainer.key")
    return {"server_pub": server_pub, "server_sec": server_sec, "client_sec": client_sec,
            "stranger_sec": stranger_sec, "allowed": allowed}


def test_secret_key_files_are_private(keys):
    import os
    import stat

    assert stat.S_IMODE(os.stat(keys["server_sec"]).st_mode) == 0o600


def test_only_allowed_clients_are_served(corpus, keys):
    extra = ("--curve-secret", str(keys["server_sec"]), "--curve-clients", str(keys["allowed"]))
    with Daemon(corpus, extra=extra, endpoint="tcp://127.0.0.1:*") as d:
        good = d.client(curve=load_client_keys(keys["client_sec"], keys["server_pub"]))
        mb = next(iter(good))
        assert mb["step"] == 0 and mb["input_ids"].shape[1] == 64
        good.close()
        stranger = d.client(curve=load_client_keys(keys["stranger_sec"], keys["server_pub"]),
                            timeout_s=0.5, reconnect_s=1.5)
        with pytest.raises(DaemonUnavailable):
            next(iter(stranger))  # the ZAP handler refuses its key: no answer, ever
        stranger.close()
        plain = d.client(timeout_s=0.5, reconnect_s=1.5)
        with pytest.raises(DaemonUnavailable):
            next(iter(plain))  # no CurveZMQ at all: the handshake never completes
        plain.close()


def test_tcp_beyond_loopback_needs_keys(corpus, sluice_main):
    proc = sluice_main("loaderd", corpus / "manifest.json", corpus / "run.toml", "--cache", corpus / "cache-x",
                       "--endpoint", "tcp://0.0.0.0:*")
    assert proc.returncode == 2
    assert "needs CurveZMQ keys" in proc.stderr and "--curve-secret" in proc.stderr


def test_half_a_key_configuration_is_refused(corpus, keys, tmp_path, sluice_main):
    proc = sluice_main("loaderd", corpus / "manifest.json", corpus / "run.toml", "--cache", corpus / "cache-y",
                       "--curve-secret", keys["server_sec"])
    assert proc.returncode == 2 and "go together" in proc.stderr
    public_copy = tmp_path / "loaderd.key"  # private, as a secret key file must be (else that is refused first)
    shutil.copy(keys["server_pub"], public_copy)
    public_copy.chmod(0o600)
    proc = sluice_main("loaderd", corpus / "manifest.json", corpus / "run.toml", "--cache", corpus / "cache-y",
                       "--curve-secret", public_copy, "--curve-clients", keys["allowed"])
    assert proc.returncode == 2 and "holds no secret key" in proc.stderr
