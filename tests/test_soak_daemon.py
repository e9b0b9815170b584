"""Soak: 8 clients, faults injected, every byte checked against the plan, RSS within bounds.

One daemon (run token, ipc path endpoint) serves 8 replicas to 8 client
threads. While they read, strangers without the token (or with a wrong one)
and a fuzzer with the token send garbage; the daemon is killed with SIGKILL
and restarted on the same endpoint (clients RESTORE their last state); then
the whole "job" is killed (clients closed abruptly with GETs in flight) and a
new job restores every replica from its last state under a new generation,
while the daemon is killed again during those RESTOREs.
Every step each client received must equal `sluice plan`'s digest, and the
daemon's RSS must stay within its declared bounds (queue and decoded-object
budgets, the compiled kernel's declared size, plus the interpreter's baseline).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from loaderd_support import Daemon, build_corpus, reference
from sluice.loaderd.physical import jitload
from sluice.wire import encoding, protocol, runtoken

pytestmark = pytest.mark.slow

TOKEN = "soak-token-" + "4" * 24
REPLICAS = 8
QUEUE = 4 << 20
DECODED = 16 << 20


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Reader(threading.Thread):
    """One replica's trainer: reads whole steps until `until`, or stops at `stop` with its state."""

    def __init__(self, d: Daemon, r: int, until: int, out: dict, stop: threading.Event, state=None,
                 generation: int | None = None) -> None:
        super().__init__(daemon=True, name=f"reader-{r}")
        self.d, self.r, self.until, self.out, self.stop_ = d, r, until, out, stop
        self.state, self.generation = state, generation
        self.error: BaseException | None = None
        self.last_step = -1
        self.reconnects = 0
        self.restore_retries = 0

    def run(self) -> None:
        import blake3

        c = self.d.client(self.r, REPLICAS, credits=4, timeout_s=2.0, reconnect_s=60.0)
        try:
            if self.state is not None:
                c.fence(self.generation)  # the new job's generation, the same for every replica
                c.reset(self.state)
            h = None
            for mb in c:
                h = h or blake3.blake3()
                for name in protocol.ARRAY_ORDER:
                    h.update(np.ascontiguousarray(mb[name], dtype="<i4").tobytes())
                if mb["micro"] + 1 < c.info["micro_per_step"]:
                    continue
                step, h = mb["step"], h.hexdigest()
                prev = self.out.setdefault((step, self.r), h)
                assert prev == h, f"replica {self.r} step {step} differs from an earlier delivery"
                h, self.last_step = None, step
                if step + 1 >= self.until or self.stop_.is_set():
                    break
                time.sleep(0.05)  # a training step: keeps every reader mid-stream when faults hit
            self.state, self.generation = c.state_dict(), c.generation
            self.reconnects, self.restore_retries = c.reconnects, c.restore_retries
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            c.close()  # abrupt for a stopped job: GETs still in flight


def stranger(endpoint: str, stop: threading.Event, password: str | None, fuzz: bool) -> None:
    """Someone else on the socket: no/wrong token (refused at the handshake) or a token holder fuzzing.

    A fresh socket every round: libzmq does not reconnect a session whose handshake failed.
    """
    rnd = random.Random(password or "none")
    while not stop.is_set():
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if password is not None:
            s.plain_username = runtoken.TOKEN_USER.encode()
            s.plain_password = password.encode()
        s.connect(endpoint)
        try:
            for _ in range(5):
                if fuzz:
                    frames = [rnd.randbytes(rnd.randrange(0, 300)) for _ in range(rnd.randrange(1, 12))]
                else:  # a well-formed GET that would take replica 0's steps if it were let in
                    frames = encoding.encode(protocol.Header(kind=protocol.GET, replica=0, step=rnd.randrange(50),
                                                             micro=0, body={"token": password or ""}))
                try:
                    s.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                while s.poll(20):
                    s.recv_multipart()
        finally:
            s.close(0)


def test_soak_eight_clients_with_faults_every_byte_as_planned(tmp_path_factory, tokenizer_file):
    root = build_corpus(tmp_path_factory.mktemp("soak"), "jsonl.zst", tokenizer_file, lanes=8, global_batch=16,
                        micro_batch=2, docs=160)
    endpoint = f"ipc://{tmp_path_factory.mktemp('soak-sock')}/loaderd.sock"
    extra = ("--queue-bytes", str(QUEUE), "--decoded-bytes", str(DECODED), "--lead-steps", "4",
             "--request-ttl", "2", "--log-level", "error")

    def start() -> Daemon:
        return Daemon(root, replicas=REPLICAS, cache=root / "cache", endpoint=endpoint, token=TOKEN,
                      extra=extra).start()

    d = start()
    baseline = rss(d.pid)
    stop_all = threading.Event()
    others = [threading.Thread(target=stranger, args=(endpoint, stop_all, pw, fz), daemon=True)
              for pw, fz in ((None, False), ("w" * 32, False), (TOKEN, True))]
    for t in others:
        t.start()
    peak = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss(d.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: dict = {}
    try:
        # phase 1: read to step 60; kill -9 the daemon once every reader passed step 20
        job = threading.Event()
        readers = [Reader(d, r, 60, out, job) for r in range(REPLICAS)]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 60
        while min(t.last_step for t in readers) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(t.last_step for t in readers) >= 20, "readers made no progress"
        d.kill9()
        d = start()  # same endpoint, same fence store: clients RESTORE and go on
        for t in readers:
            t.join(90)
        assert not any(t.is_alive() for t in readers), "a reader hangs after the daemon restart"
        assert not [t.error for t in readers if t.error], [t.error for t in readers if t.error]
        assert all(t.reconnects >= 1 for t in readers), "a reader never saw the daemon restart"
        # phase 2: a new job restores every replica from its last state under one new
        # generation, and dies mid-stream (readers stopped with GETs in flight)
        states = {t.r: t.state for t in readers}
        generation = max(t.generation for t in readers) + 1
        job2 = threading.Event()
        readers = [Reader(d, r, 100, out, job2, state=states[r], generation=generation) for r in range(REPLICAS)]
        for t in readers:
            t.start()
        while min(t.last_step for t in readers) < 80 and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        job2.set()
        for t in readers:
            t.join(60)
        assert not [t.error for t in readers if t.error], [t.error for t in readers if t.error]
        states = {t.r: t.state for t in readers}
        generation = max(t.generation for t in readers) + 1
        readers = [Reader(d, r, 100, out, threading.Event(), state=states[r], generation=generation)
                   for r in range(REPLICAS)]
        for t in readers:
            t.start()
        time.sleep(0.1)  # kill -9 while the new job says HELLO and RESTOREs (or just after)
        d.kill9()
        d = start()
        for t in readers:
            t.join(90)
        assert not any(t.is_alive() for t in readers), "a reader hangs after the job restart"
        assert not [t.error for t in readers if t.error], [t.error for t in readers if t.error]
        retries = sum(t.restore_retries for t in readers)  # RESTOREs that met the killed daemon
        probe = d.client(0, REPLICAS)
        stats = probe.stats()
        probe.close()
    finally:
        stop_all.set()
        sampling.set()
        d.stop()
    # every byte as planned
    ref = reference(root, max(s for s, _ in out) + 1, REPLICAS)
    assert {(s, r) for s in range(100) for r in range(REPLICAS)} <= set(out)
    bad = [(s, r) for (s, r), dg in out.items() if ref[(s, r)][0] != dg]
    assert not bad, f"steps served differently from the plan: {bad[:5]}"
    # the strangers were refused, the fuzzer's garbage answered with errors
    assert stats["unauthorized"] > 0
    assert sum(stats["errors"].values()) > 0
    # memory within the declared bounds: queues of every replica + decoded objects + the compiled kernel (the
    # producer loads it once it waited 0.5 s for its readers, which a slow machine reaches) + slack
    bound = baseline + REPLICAS * QUEUE + DECODED + jitload.KERNEL_RSS_BYTES + (96 << 20)
    assert peak[0] <= bound, f"daemon RSS {peak[0] >> 20} MiB exceeds {bound >> 20} MiB"
    print(f"soak: baseline {baseline >> 20} MiB, peak {peak[0] >> 20} MiB, bound {bound >> 20} MiB, "
          f"errors {stats['errors']}, unauthorized {stats['unauthorized']}, RESTOREs retried {retries}",
          file=sys.stderr)
