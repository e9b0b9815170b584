"""Start-up: what a daemon does before its first batch (docs/loaderd.md, "Start-up").

* The tokenizer is parsed on first use only (`assemble.DeferredEncoder`): with
  every object's tokens in the node cache it is never parsed, and the stream
  equals the plan; with a cold cache the first step parses it. Its file is
  still checked against the manifest's digest when the data path opens, so a
  missing or other tokenizer stops the daemon at start as before.
* The deferred identity (what cached tokens are keyed by) is the loaded
  encoder's.
* `embedded_client` starts the daemon before it imports the client.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loaderd_support import build_corpus, reference
from sluice.errors import TokenizerError
from sluice.loaderd.logical import micro_batches_digest
from sluice.loaderd.physical.assemble import DataPathConfig, DeferredEncoder, open_data_path
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.tokcache import token_key


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("startup"), "jsonl.zst", tokenizer_file)


def _serve(root: Path, cache: Path, steps: int = 4) -> tuple[dict[int, str], DeferredEncoder]:
    """Steps 0..steps-1 through the daemon's own data path; their digests and its encoder.

    Waits for the objects' in-order fills before closing: the first steps are served by
    out-of-order demand reads, and only a finished fill leaves the tokens in the cache."""
    manifest = load_manifest(root / "manifest.json")
    spec = load_runspec(root / "run.toml")
    with open_data_path(manifest, spec, DataPathConfig(cache_dir=str(cache), cache_budget=1 << 30)) as data:
        plan = data.plan()
        state = plan.initial_state()
        out = {}
        for _ in range(steps):
            batch, state = plan.step(state, data.docs)
            out[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))
        assert data.docs.wait_filled(120)
        encoder = data.docs.encoder
    assert isinstance(encoder, DeferredEncoder)
    return out, encoder


def test_cached_tokens_are_served_without_parsing_the_tokenizer(corpus, tmp_path):
    want = {step: digest for (step, _), (digest, _) in reference(corpus, 4, 1).items()}
    cold, enc = _serve(corpus, tmp_path / "cache")
    assert cold == want and enc.loaded  # a cold cache: the first step tokenized, so it parsed the file
    warm, enc = _serve(corpus, tmp_path / "cache")  # a restart on the same node cache
    assert warm == want and not enc.loaded


def test_a_different_tokenizer_is_refused_when_the_data_path_opens(corpus, tmp_path):
    import shutil

    root = tmp_path / "corpus"
    shutil.copytree(corpus, root)
    tok = root / "tokenizer.json"
    tok.write_bytes(tok.read_bytes() + b" ")  # same tokenizer, other bytes: another identity
    manifest = load_manifest(root / "manifest.json")
    spec = load_runspec(root / "run.toml")
    with pytest.raises(TokenizerError, match="differs from the manifest's"):
        open_data_path(manifest, spec, DataPathConfig(cache_dir=str(tmp_path / "cache"), cache_budget=1 << 30))
    tok.unlink()
    with pytest.raises(TokenizerError, match="no such file"):
        open_data_path(manifest, spec, DataPathConfig(cache_dir=str(tmp_path / "cache"), cache_budget=1 << 30))


def test_the_deferred_identity_is_the_loaded_encoders(corpus):
    manifest = load_manifest(corpus / "manifest.json")
    deferred = DeferredEncoder(manifest)
    loaded = encoder_for_manifest(manifest)
    assert token_key(manifest, 0, 0, deferred) == token_key(manifest, 0, 0, loaded)  # the same cached tokens
    assert not deferred.loaded
    assert deferred.vocab_size == loaded.vocab_size and deferred.loaded  # anything else loads it, once
    assert deferred.encoder() is deferred.encoder()
    assert [a.tolist() for a in deferred.encode_batch(["def f(): pass"])] == \
        [a.tolist() for a in loaded.encode_batch(["def f(): pass"])]


def test_embedded_client_starts_the_daemon_before_importing_the_client(corpus, tmp_path):
    # In a fresh interpreter: when the child is spawned, numpy and the client are not imported yet.
    code = f"""
import subprocess, sys
seen = []
real = subprocess.Popen.__init__
def spy(self, *a, **k):
    seen.append(("numpy" in sys.modules, "sluice.client.iterator" in sys.modules))
    real(self, *a, **k)
subprocess.Popen.__init__ = spy
from sluice.client import embedded_client
with embedded_client({str(corpus / "manifest.json")!r}, {str(corpus / "run.toml")!r},
                     cache_dir={str(tmp_path / "cache")!r}, as_numpy=True) as client:
    mb = next(client)
    assert mb["step"] == 0 and mb["input_ids"].shape[1] == client.info["seq_len"]
print(seen[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(False, False)"


def test_the_run_token_handler_admits_only_the_token():
    import zmq

    from sluice.loaderd.endpoint import TokenAuthenticator
    from sluice.wire import runtoken

    auth = TokenAuthenticator(zmq.Context.instance(), "t" * 64)  # not started: the reply logic alone
    head = [b"1.0", b"7", b"*", b"127.0.0.1", b""]
    user = runtoken.TOKEN_USER.encode()
    assert auth.reply(head + [b"PLAIN", user, b"t" * 64]) == [b"1.0", b"7", b"200", b"OK", user, b""]
    refused = [head + [b"PLAIN", user, b"t" * 63], head + [b"PLAIN", b"other", b"t" * 64], head + [b"NULL"],
               head + [b"PLAIN", user], head + [b"CURVE", b"k" * 32], [b"1.0", b"8"], [b"2.0"] + head[1:] + [b"PLAIN"]]
    for msg in refused:
        got = auth.reply(msg)
        assert got[2] == b"400" and got[4] == b"" and len(got) == 6, msg
    assert auth.denied == len(refused)


def test_the_daemon_imports_no_asyncio():
    code = "import sys, sluice.loaderd.cli, sluice.loaderd.server; print('asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# A client connecting: the daemon's connection count (endpoint.Connections) reads its socket monitor's events.
CONNECTIONS = r"""
import sys, tempfile, zmq
from sluice.loaderd.endpoint import Connections

ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
conns = Connections(router)
router.bind("ipc://" + tempfile.mkdtemp() + "/s")
dealer = ctx.socket(zmq.DEALER)
dealer.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
while conns.open == 0 and conns.socket.poll(30_000):  # bounded: no event in 30 s ends the wait
    conns.drain()
dealer.close(0)
while conns.open == 1 and conns.socket.poll(30_000):
    conns.drain()
print(conns.accepted, conns.disconnected, "asyncio" in sys.modules)
conns.close(router)
router.close(0)
ctx.term()
"""


def test_counting_a_clients_connection_imports_no_asyncio():
    """zmq.utils.monitor imports zmq.asyncio and asyncio (~40 ms of CPU at a daemon's first connection)."""
    out = subprocess.run([sys.executable, "-c", CONNECTIONS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["1", "1", "False"], out.stdout + out.stderr


def test_the_daemon_imports_neither_the_pre_tokenizer_nor_prometheus_client():
    # tokcache names its transform without pretokenize (multiprocessing, a process pool);
    # Metrics fills plain values and imports prometheus_client only when a registry is asked for
    code = ("import sys, sluice.loaderd.cli, sluice.loaderd.server, sluice.tokenize.tokcache\n"
            "from sluice.loaderd.metrics import Metrics\n"
            "m = Metrics('r', 'd', ['a'], [1.0]); m.batches.inc(); m.time_to_batch.observe(0.1); m.error('X')\n"
            "heavy = ('prometheus_client', 'http.server', 'multiprocessing', 'sluice.tokenize.pretokenize')\n"
            "print([n for n in heavy if n in sys.modules], m.error_counts())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[] {'X': 1}", out.stderr


_SPY = ("import atexit, json, sys; from sluice.loaderd.cli import main\n"
        "atexit.register(lambda: open({out!r}, 'w').write(json.dumps('prometheus_client' in sys.modules)))\n"
        "sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("metrics_port", [False, True])
def test_a_daemon_imports_prometheus_client_only_for_its_metrics_port(corpus, tmp_path, metrics_port):
    import urllib.request

    from loaderd_support import Daemon

    seen = tmp_path / "imported.json"
    d = Daemon(corpus, cache=tmp_path / "cache", extra=("--metrics-port", "0") if metrics_port else ())
    d.args[2] = _SPY.format(out=str(seen))
    with d:
        c = d.client()
        mb = next(c)
        assert mb["step"] == 0
        c.close()
        if metrics_port:
            url = f"http://127.0.0.1:{d.info['metrics_port']}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            assert 'sluice_batches_served_total{dataset_id="' in text and "sluice_time_to_batch_seconds_bucket" in text
        else:
            assert d.info["metrics_port"] is None
    assert d.proc.returncode == 0
    assert json.loads(seen.read_text()) is metrics_port
