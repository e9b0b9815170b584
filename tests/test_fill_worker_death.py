"""A killed `--worker-kind process` fill worker is replaced: the next object is tokenized by a fresh one, to the
same tokens.
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

from loaderd_support import build_corpus

BOUND_S = 20.0  # generous: this only catches a hang


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("death"), "jsonl.zst", tokenizer_file)


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
