"""A dead producer process is seen at once: kill -9 of `loaderd --producer process`'s child.

The client pulling from that replica gets the steps produced before the
death, then an ERROR(INTERNAL) naming the producer process, its pid, how it
died and the step, within seconds (before the fix the daemon's IO thread
blocked on a control message to the dead child and the client waited minutes
for DaemonUnavailable). Later GETs, from a new client too and after a RESTORE, get
the same error. A killed `--worker-kind process` fill worker is replaced: the
next object is tokenized by a fresh one, to the same tokens.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import psutil
import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.client import DaemonError

BOUND_S = 20.0  # generous: the daemon looks every 0.5 s; this only catches a hang (it was minutes)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("death"), "jsonl.zst", tokenizer_file)


def producer_child(daemon: Daemon) -> psutil.Process:
    (child,) = psutil.Process(daemon.pid).children()  # one replica served: one producer process
    assert "procchild" in " ".join(child.cmdline())
    return child


def copy(mb: dict) -> dict:
    return {k: (v.copy() if hasattr(v, "copy") and k not in ("samples",) else v) for k, v in mb.items()}


def pull_until_error(it) -> tuple[list[dict], DaemonError, float]:
    got, t0 = [], time.monotonic()
    with pytest.raises(DaemonError) as info:
        for mb in it:
            got.append(copy(mb))
            assert time.monotonic() - t0 < BOUND_S, "still pulling: the dead producer was not noticed"
    return got, info.value, time.monotonic() - t0


def test_a_killed_producer_process_fails_the_waiting_gets_naming_it(corpus, tmp_path):
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--producer", "process")) as d:
        c = d.client(0, 1)
        it = iter(c)
        before = [copy(next(it))]
        mps = c.info["micro_per_step"]
        before += [copy(next(it)) for _ in range(3 * mps - 1)]  # steps 0..2
        child = producer_child(d)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        # Pull only once the daemon's sockets saw the child go: the releases of the steps still queued then
        # send FLOOR to no peer, which used to block the IO thread for good (pulling at once could race past).
        time.sleep(1.0)
        got, err, waited = pull_until_error(it)
        assert waited < BOUND_S
        assert err.code == "INTERNAL"
        text = str(err)
        assert f"pid {child.pid}" in text and "SIGKILL" in text and "exit code -9" in text
        assert "producer process" in text and "replica 0" in text
        # What was produced before the death is served, equal to the plan, and the error is the next step.
        steps = sorted({b["step"] for b in before + got})
        assert steps == list(range(len(steps)))
        assert f"step {steps[-1] + 1}:" in text and err.step == steps[-1] + 1
        ref = reference(corpus, len(steps), 1)
        for step, digest in stream_digests(before + got, mps).items():
            assert digest == ref[(step, 0)][0]
        # A RESTORE does not revive it (nor hang: its RESET to the dead child never blocks the daemon).
        t0 = time.monotonic()
        c.load_state_dict(c.state_dict_at(1))
        with pytest.raises(DaemonError, match=f"step 2: the producer process \\(pid {child.pid}\\)"):
            next(iter(c))
        assert time.monotonic() - t0 < BOUND_S
        c.close()
        # A new client is not left waiting either: it gets the same error.
        late = d.client(0, 1, timeout_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(DaemonError, match=f"pid {child.pid}"):
            for _ in late:
                pass
        assert time.monotonic() - t0 < BOUND_S
        late.close()
        assert d.proc is not None and d.proc.poll() is None  # the daemon itself still answers




@pytest.mark.slow
def test_a_killed_fill_worker_process_is_replaced_and_the_next_object_is_tokenized(corpus, tmp_path, caplog):
    # --worker-kind process: a killed decode/tokenize worker used to break its pool for good (every later
    # object failed, as "bug in sluice: BrokenProcessPool ... object None"); the pool is replaced and the
    # object's fill submitted again, so the tokens equal a thread worker's.
    from sluice.cache import NodeCache
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.manifest.model import load_manifest
    from sluice.tokenize import encoder_for_manifest

    manifest = load_manifest(corpus / "manifest.json")
    enc = encoder_for_manifest(manifest)
    last = manifest.sources[0].objects[1].records - 1
    refs = [Ref(0, 0, 0), Ref(0, 1, 0), Ref(0, 1, last)]
    with NodeCache(tmp_path / "threads", 1 << 30) as cache:
        plain = DocSource(manifest, cache, enc, workers=1)
        try:
            want = [np.asarray(plain(r)).copy() for r in refs]
        finally:
            plain.close()
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with NodeCache(tmp_path / "procs", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, worker_kind="process")
        try:
            got = [np.asarray(docs(refs[0])).copy()]
            wait_for(lambda: docs.tokenized_objects == 1)  # object 0 was filled by a worker process
            spawned = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
            workers = [c for c in spawned if not c.children() and "resource_tracker" not in " ".join(c.cmdline())]
            assert workers, f"no fill worker among {spawned}"
            for w in workers:  # the forkserver's children, idle now: kill -9 (the OOM killer's way)
                os.kill(w.pid, signal.SIGKILL)
            psutil.wait_procs(workers, timeout=10)
            with caplog.at_level(logging.WARNING, logger="sluice.loaderd"):
                got += [np.asarray(docs(r)).copy() for r in refs[1:]]
                wait_for(lambda: docs.tokenized_objects == 2)  # object 1's fill ran in a fresh worker
        finally:
            docs.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert "fill worker process died; its pool is replaced" in caplog.text


def wait_for(done, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not done within the bound"
        time.sleep(0.02)


@dataclass(frozen=True)
class Ref:
    source: int
    obj: int
    record: int
