"""loaderd end to end: real daemon processes, real sockets, real corpora and tokenizer.

The served stream must equal the pure Plan (what `sluice plan` prints) for
every step and replica, on every source format, across kill -9 and restores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.errors import FencedError, SourceReadError
from sluice.wire import decoding, encoding, errorcodes, protocol

KINDS = ("jsonl.zst", "parquet", "wds", "sltok")
# Every kind is served through a daemon in the full tier (`make test-all`). The fast
# tier streams jsonl.zst (raw text, tokenized by the daemon) and sltok (pre-tokenized)
# against the plan; parquet and webdataset differ only in the reader, which the fast
# tier checks without a daemon (test_token_cache.py, test_manifest_*.py), and parquet
# is still served by test_worker_processes_serve_the_same_stream.
SLOW_KINDS = ("parquet", "wds")


def kinds(*names: str) -> list:
    """`names` as parametrize values, the SLOW_KINDS ones marked slow."""
    return [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k for k in names]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer_file):
    """kind -> corpus root, built lazily."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_corpus(tmp_path_factory.mktemp(kind.replace(".", "-")), kind, tokenizer_file)
        return built[kind]

    return get


def take(client, steps: int) -> list[dict]:
    """Iterate until `steps` whole steps were received (from the client's current position)."""
    out = []
    target = None
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v) for k, v in mb.items()})
        if target is None:
            target = mb["step"] + steps - 1
        if mb["step"] == target and mb["micro"] + 1 == client.info["micro_per_step"]:
            break
    return out


def check_equal(batches, ref, replica, mps):
    got = stream_digests(batches, mps)
    assert got, "no whole step received"
    for step, digest in got.items():
        assert digest == ref[(step, replica)][0], f"step {step} replica {replica} differs from the plan"
    return got


@pytest.mark.parametrize("kind", kinds(*KINDS))
def test_stream_equals_plan_one_and_two_replicas(corpora, kind):
    root = corpora(kind)
    steps = 10
    ref1 = reference(root, steps, 1)
    ref2 = reference(root, steps, 2)
    with Daemon(root, replicas=1, cache=root / f"cache-{kind}-1") as d:
        c = d.client(0, 1, samples=True)
        batches = take(c, steps)
        got = check_equal(batches, ref1, 0, c.info["micro_per_step"])
        assert sorted(got) == list(range(steps))
        # samples travel with the batches and match the plan's
        first = [s for b in batches if b["step"] == 3 for s in b["samples"]]
        assert list(dict.fromkeys(first)) == ref1[(3, 0)][1]
        c.close()
    # two replicas from one daemon (--serve 0,1): each stream is its half of the plan
    with Daemon(root, replicas=2, cache=root / f"cache-{kind}-2") as d:
        clients = [d.client(r, 2) for r in (0, 1)]
        for r, c in enumerate(clients):
            check_equal(take(c, steps), ref2, r, c.info["micro_per_step"])
            c.close()


def test_worker_processes_serve_the_same_stream(corpora, tmp_path):
    root = corpora("parquet")
    ref = reference(root, 8, 1)
    with Daemon(root, cache=tmp_path / "cache", extra=("--worker-kind", "process")) as d:
        c = d.client(0, 1)
        got = check_equal(take(c, 8), ref, 0, c.info["micro_per_step"])
        assert sorted(got) == list(range(8))
        c.close()


@pytest.mark.parametrize("kind", [pytest.param("sltok", marks=pytest.mark.slow), "jsonl.zst"])
def test_two_replicas_serve_the_plan_and_restore_back_inside_it(corpora, tmp_path, kind):
    root = corpora(kind)
    ref = reference(root, 12, 2)
    with Daemon(root, replicas=2, cache=tmp_path / "cache") as d:
        for r in (0, 1):
            c = d.client(r, 2)
            first = take(c, 6)
            check_equal(first, ref, r, c.info["micro_per_step"])
            sd = c.state_dict_at(2)  # go back: the producer restarts from the state after step 2
            c.load_state_dict(sd)
            again = take(c, 6)
            assert again[0]["step"] == 3
            got = check_equal(again, ref, r, c.info["micro_per_step"])
            assert sorted(got) == list(range(3, 9))
            c.close()


# Slow tier: two daemons and 200 steps; the fast tier keeps a daemon serving one replica of two
# (tests/test_client.py, --serve 1), and tests/test_multinode.py runs daemons serving replica subsets per node.
@pytest.mark.slow
def test_two_daemons_split_replicas_and_200_steps(corpora):
    """One daemon per replica (--serve r): 200 steps each equal the plan, on pre-tokenized shards."""
    root = corpora("sltok")
    steps = 200
    ref = reference(root, steps, 2)
    daemons = [Daemon(root, replicas=2, serve=str(r), cache=root / "cache-split",
                      extra=("--state-dir", str(root / f"state-split-{r}"))).start() for r in (0, 1)]
    try:
        for r, d in enumerate(daemons):
            c = d.client(r, 2, credits=16)
            batches = take(c, steps)
            got = check_equal(batches, ref, r, c.info["micro_per_step"])
            assert sorted(got) == list(range(steps))
            c.close()
    finally:
        for d in daemons:
            d.stop()


# Slow tier: a kill -9 and a restart; tests/test_restart_races.py and tests/test_soak_daemon.py (slow) kill and
# restart daemons under clients and check every step against the plan too.
@pytest.mark.slow
def test_kill9_restart_and_client_restores_identically(corpora, tmp_path):
    root = corpora("jsonl.zst")
    rng = random.Random(5)
    total = 14
    ref = reference(root, total, 1)
    endpoint = f"ipc://{tmp_path}/ld.sock"
    d = Daemon(root, endpoint=endpoint, cache=tmp_path / "cache").start()
    c = d.client(0, 1, timeout_s=1.0, reconnect_s=60.0)
    mps = None
    got: list[dict] = []
    try:
        kill_after = rng.randrange(5, 14)  # micro-batches; may land in the middle of a step
        for mb in c:
            mps = c.info["micro_per_step"]
            got.append({k: (np.asarray(v).copy() if k not in ("step", "micro") else v) for k, v in mb.items()})
            if len(got) == kill_after:
                d.kill9()
                d = Daemon(root, endpoint=endpoint, cache=tmp_path / "cache").start()
            if mb["step"] == total - 1 and mb["micro"] + 1 == mps:
                break
        assert c.reconnects >= 1
        steps_micros = [(b["step"], b["micro"]) for b in got]
        assert steps_micros == [(s, m) for s in range(total) for m in range(mps)], "gap or repeat across the restart"
        check_equal(got, ref, 0, mps)
    finally:
        c.close()
        d.stop()


def test_stale_generation_is_fenced_and_commit_is_durable(corpora, tmp_path):
    root = corpora("parquet")
    ref = reference(root, 12, 1)
    endpoint = f"ipc://{tmp_path}/ld.sock"
    state_dir = tmp_path / "state"
    d = Daemon(root, endpoint=endpoint, cache=tmp_path / "cache", extra=("--state-dir", str(state_dir))).start()
    try:
        a = d.client(0, 1)
        take(a, 4)
        saved = a.state_dict()
        json.dumps(saved)  # JSON-able
        assert saved["step"] == 3
        # a second trainer restores the checkpoint: new generation, the old one is fenced
        b = d.client(0, 1)
        b.load_state_dict(saved)
        resumed = take(b, 5)
        assert resumed[0]["step"] == 4
        check_equal(resumed, ref, 0, b.info["micro_per_step"])
        assert b.generation == 1
        with pytest.raises(FencedError):  # at the latest once the replies already in flight are used up
            for _ in range(a.credits + 1):
                next(a)
        with pytest.raises(FencedError):
            a.commit(3)
        assert b.commit(6) == 6
        a.close()
        b.close()
    finally:
        d.stop()
    # the commit and the generation survive a restart (LMDB)
    d = Daemon(root, endpoint=endpoint, cache=tmp_path / "cache", extra=("--state-dir", str(state_dir))).start()
    try:
        c = d.client(0, 1)
        c.connect()
        assert c.info["committed_step"] == 6 and c.info["generation"] == 1
        c.close()
    finally:
        d.stop()


def test_peers_of_a_replica_get_the_same_bytes_produced_once(corpora, tmp_path):
    root = corpora("sltok")
    with Daemon(root, cache=tmp_path / "cache", extra=("--lead-steps", "4")) as d:
        p0 = d.client(0, 1, peers=2)
        p1 = d.client(0, 1, peers=2)
        # peers train in lockstep: the daemon keeps a step until both have it
        box: dict[str, list] = {}
        t = threading.Thread(target=lambda: box.setdefault("b", take(p1, 6)))
        t.start()
        a = take(p0, 6)
        t.join(60)
        b = box["b"]
        for x, y in zip(a, b, strict=True):
            for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                np.testing.assert_array_equal(x[k], y[k])
        stats = p0.stats()["replicas"]["0"]
        # each step produced once: at most 6 consumed + credits/lead ahead, never twice
        assert stats["produced_steps"] <= 6 + 4 + 8
        p0.close()
        p1.close()


@pytest.mark.slow
def test_stalled_client_keeps_daemon_memory_bounded(corpora, tmp_path):
    import psutil

    root = corpora("sltok")
    queue_bytes = 1 << 20
    # --jit off: the compiled kernel is a fixed cost, not growth (held to its declared size in
    # test_loaderd_jit.py), and a producer that waited 0.5 s for this client's first GET (a loaded machine)
    # would load it in the middle of the samples.
    with Daemon(root, cache=tmp_path / "cache", extra=("--queue-bytes", "1MiB", "--lead-steps", "1000",
                                                      "--decoded-bytes", "8MiB", "--jit", "off")) as d:
        c = d.client(0, 1, credits=1)
        take(c, 1)  # then stall: never ask again
        proc = psutil.Process(d.pid)
        samples = []
        for _ in range(6):
            time.sleep(0.5)
            samples.append(proc.memory_info().rss)
        st = c.stats()["replicas"]["0"]
        # producer blocked at the byte watermark (one entry may overshoot it)
        assert st["queued_bytes"] <= queue_bytes + 64 * 1024
        assert st["produced_steps"] < 1000
        assert max(samples) - samples[0] < 16 << 20, f"RSS grew while stalled: {samples}"
        c.close()


def test_a_paused_client_finds_the_whole_lead_made(corpora, tmp_path):
    """A client that stops asking a few steps in finds the producer `--lead-steps` ahead of it: the producer
    tops the queue up however few steps each delivery made room for (a producer that waited for room for a
    whole multi-step call left the lead short for good once the client paused)."""
    root = corpora("sltok")
    with Daemon(root, cache=tmp_path / "cache", extra=("--lead-steps", "8")) as d:
        c = d.client(0, 1, credits=1)
        take(c, 3)
        deadline = time.monotonic() + 20
        while True:
            st = c.stats()["replicas"]["0"]
            if st["next_step"] - st["floor_step"] >= 8 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert st["next_step"] - st["floor_step"] == 8, st
        c.close()


def test_fuzzed_socket_does_not_disturb_a_served_client(corpora, tmp_path):
    root = corpora("jsonl.zst")
    ref = reference(root, 8, 1)
    with Daemon(root, cache=tmp_path / "cache") as d:
        c = d.client(0, 1)
        stop = threading.Event()
        sent = []

        def fuzz() -> None:
            ctx = zmq.Context.instance()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
            rng = random.Random(11)
            golden = encoding.encode(protocol.Header(kind=protocol.GET, run_id=d.info["run_id"],
                                                     dataset_id=d.info["dataset_id"], replica=0, step=0, micro=0))[0]
            try:
                while not stop.is_set():
                    choice = rng.randrange(5)
                    if choice == 0:
                        frames = [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 12))]
                    elif choice == 1:
                        frames = [golden[: rng.randrange(len(golden))]]
                    elif choice == 2:
                        frames = [golden, rng.randbytes(rng.randrange(1, 64))]
                    elif choice == 3:
                        obj = json.loads(golden)
                        obj[rng.choice(list(obj))] = rng.choice([None, -5, "x", [1], {"a": 1}, 2**70])
                        frames = [json.dumps(obj).encode()]
                    else:
                        obj = json.loads(golden)
                        obj.update(step=rng.randrange(10**6, 10**7), micro=rng.randrange(-1, 9))
                        frames = [json.dumps(obj).encode()]
                    s.send_multipart(frames)
                    sent.append(1)
                    while s.poll(0):
                        s.recv_multipart()
                    time.sleep(0.001)
            finally:
                s.close(0)

        t = threading.Thread(target=fuzz)
        t.start()
        try:
            time.sleep(0.3)
            batches = take(c, 8)
        finally:
            stop.set()
            t.join()
        check_equal(batches, ref, 0, c.info["micro_per_step"])
        stats = c.stats()
        assert len(sent) > 50
        assert sum(stats["errors"].values()) > 0
        assert d.proc.poll() is None
        c.close()


def test_corrupt_object_reaches_the_client_as_an_error_naming_object_and_step(tokenizer_file, tmp_path):
    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file, docs=120, objects=3)
    cache = tmp_path / "cache"
    with Daemon(root, cache=cache) as d:
        c = d.client(0, 1)
        take(c, 1)  # fills the cache with at least one object
        c.close()
    # damage every cached object and its source: verify-on-read drops the cached bytes,
    # the re-fill from the source fails its digest check after the cache's retries
    for path in list((cache / "objects").rglob("*")) + list((root / "shards").glob("*")):
        if path.is_file():
            os.chmod(path, 0o644)
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    with Daemon(root, cache=cache) as d:
        c = d.client(0, 1)
        with pytest.raises(SourceReadError) as info:
            take(c, 2)
        msg = str(info.value)
        assert "step 0" in msg and "shards/c-" in msg and "b3:" in msg
        assert d.proc.poll() is None  # the daemon keeps running
        c.close()


def test_protocol_refusals_and_sigterm(corpora, tmp_path):
    root = corpora("sltok")
    d = Daemon(root, cache=tmp_path / "cache", extra=("--metrics-port", "0")).start()
    try:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)

        def ask(**kw) -> protocol.Message:
            base = dict(kind=protocol.GET, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0,
                        step=0, micro=0, request_id=7)
            base.update(kw)
            s.send_multipart(encoding.encode(protocol.Header(**base)))
            assert s.poll(10000)
            reply = decoding.decode(s.recv_multipart(copy=False), protocol.Limits.for_client())
            # every refusal names the request it refuses: a client matches replies by ID (else: silence)
            assert reply.header.request_id == base["request_id"], reply
            return reply

        assert ask(run_id="other").body["code"] == errorcodes.E_WRONG_RUN
        assert ask(dataset_id="b3:" + "1" * 64).body["code"] == errorcodes.E_WRONG_DATASET
        assert ask(replica=3).body["code"] == errorcodes.E_BAD_REPLICA
        assert ask(micro=99).body["code"] == errorcodes.E_OUT_OF_RANGE
        assert ask(instance="1-dead").body["code"] == errorcodes.E_WRONG_INSTANCE
        assert ask(step=10**6).body["code"] == errorcodes.E_TOO_FAR_AHEAD
        assert ask(kind=protocol.BATCH).body["code"] == errorcodes.E_UNKNOWN_KIND
        assert ask(kind=protocol.RESTORE, body={"state": {"kind": "nope"}}).body["code"] == errorcodes.E_BAD_STATE
        assert ask(kind=protocol.HELLO, body={"replicas": 5}).body["code"] == errorcodes.E_BAD_REPLICA
        ok = ask()
        assert ok.kind == protocol.BATCH and ok.arrays["input_ids"].dtype == np.int32
        # Prometheus: own registry, units in names, run and dataset labels
        port = d.info["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "sluice_time_to_batch_seconds_bucket" in text
        assert 'sluice_protocol_errors_total{code="WRONG_RUN",dataset_id="hidden",run_id="hidden"}' in text
        assert "sluice_prefetch_lead_steps" in text and "sluice_generation" in text
        s.close(0)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(20) == 0
    finally:
        d.stop()


def test_tcp_loopback_endpoint_file_and_vanished_client_releases_credits(corpora, tmp_path):
    root = corpora("sltok")
    ep_file = tmp_path / "endpoint"
    with Daemon(root, cache=tmp_path / "cache", endpoint="tcp://127.0.0.1:*", token="t" * 32,
                extra=("--endpoint-file", str(ep_file), "--request-ttl", "2", "--lead-steps", "2",
                       "--log-level", "info", "--metrics-port", "0")) as d:
        assert d.endpoint.startswith("tcp://127.0.0.1:") and not d.endpoint.endswith("*")
        assert ep_file.read_text().strip() == d.endpoint
        assert (ep_file.stat().st_mode & 0o777) == 0o600
        from sluice.client.cli import daemon_stats

        # peers=2 and the second peer never comes: steps stay held, later GETs stay parked
        c = d.client(0, 1, credits=16, peers=2)
        next(c)
        # The client sent 16 GETs at once, but next(c) needs only the first reply: on a loaded machine
        # the daemon may still be answering GETs of the held steps when this STATS (fair-queued between
        # connections) is read, so look until the GETs past them are parked. The TTL (2 s) is the window
        # for the look: a 0.5 s TTL could expire them before a second connection's STATS got through.
        deadline = time.monotonic() + 10
        while not daemon_stats(d.endpoint, 10, d.token)["replicas"]["0"]["pending"]:
            assert time.monotonic() < deadline, "no GET was parked past the held steps"
            time.sleep(0.02)
        c.close()  # goes away with GETs parked in the daemon: the TTL releases them
        deadline = time.monotonic() + 20
        while daemon_stats(d.endpoint, 10, d.token)["replicas"]["0"]["pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon_stats(d.endpoint, 10, d.token)["replicas"]["0"]["pending"] == 0
        port = d.info["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        released = [x for x in text.splitlines() if x.startswith("sluice_released_requests_total{")]
        assert released and float(released[0].split()[-1]) > 0
    # structured logs: one JSON object per line, with run and dataset IDs
    lines = [json.loads(x) for x in d.log.read_text().splitlines() if x.startswith("{")]
    assert lines and all(x["run_id"] == "t" and x["dataset_id"].startswith("b3:") for x in lines)


def test_cli_refuses_non_loopback_tcp_and_sluice_subcommand_exists(corpora, tmp_path, sluice_main):
    root = corpora("sltok")
    bad = sluice_main("loaderd", root / "manifest.json", root / "run.toml", "--cache", tmp_path / "c",
                     "--endpoint", "tcp://0.0.0.0:5555")
    assert bad.returncode == 2 and "CurveZMQ" in bad.stderr
    bad = sluice_main("loaderd", root / "manifest.json", root / "run.toml", "--cache", tmp_path / "c",
                     "--replicas", "3")
    assert bad.returncode == 2 and "3 replicas do not divide lanes=4" in bad.stderr


def test_a_trainer_without_a_checkpoint_starts_over_at_step_0(corpora, tmp_path):
    # The first trainer read (and the daemon released) steps 0..3, then died
    # before any checkpoint. Its successor starts over: RESTORE to the state
    # before step 0 under a newer generation gives the very same step 0.
    root = corpora("jsonl.zst")
    ref = reference(root, 3, 1)
    with Daemon(root, cache=tmp_path / "cache") as d:
        first = d.client(0, 1)
        gone = take(first, 4)
        mps = first.info["micro_per_step"]
        assert sorted({b["step"] for b in gone}) == [0, 1, 2, 3]
        first.close()
        late = d.client(0, 1, start_step=0, timeout_s=2.0, reconnect_s=2.0)
        from sluice.client import DaemonError

        with pytest.raises(DaemonError, match="OUT_OF_RANGE"):
            take(late, 1)  # step 0 is gone for a plain client
        late.close()
        again = d.client(0, 1)
        again.reset()  # RESTORE to the state before step 0, under the generation after the daemon's
        got = take(again, 3)
        assert [b["step"] for b in got][:1] == [0]
        check_equal(got, ref, 0, mps)
        assert again.generation == 1
        again.close()


def test_a_first_batch_slower_than_the_client_timeout_is_waited_for_not_lost(corpora, tmp_path):
    """Silence from a live daemon is patience, not loss: the client keeps its requests.

    A cold daemon tokenizes before its first step; a client whose `timeout_s`
    is far shorter probes, finds the same daemon, and must keep waiting. Before
    the fix it re-sent its GETs under new IDs: the daemon served the old ones,
    released step 0, and answered the new ones OUT_OF_RANGE (seen in
    bench/peers at the default 10 s timeout on 100 MB objects).
    """
    root = corpora("jsonl.zst")
    steps = 4
    ref = reference(root, steps, 1)
    with Daemon(root, replicas=1, cache=tmp_path / "cold-cache") as d:
        c = d.client(0, 1, timeout_s=0.02)
        got = check_equal(take(c, steps), ref, 0, c.info["micro_per_step"])
        assert sorted(got) == list(range(steps))
        c.close()
