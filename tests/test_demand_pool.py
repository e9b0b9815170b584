"""The demand path's tokenizer processes (sluice/loaderd/physical/demandpool.py, docs/tokenize.md "Out of order").

Specifications:
* Records tokenized in a worker process are the ids the in-order reader and
  the daemon's own encoder give (tokens cross as a file, not pickled lists).
* With every in-order fill held after its first chunk and the demand path in
  worker processes, a DocSource serves every step and the stream equals the oracle computed from
  the texts encoded in order.
* A worker killed with SIGKILL is replaced and the batch sent again (the ids
  are the same); with no retries left the caller gets TokenizerWorkerError
  naming the worker's pid and the object, never a hang.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.errors import TokenizerWorkerError
from sluice.loaderd.physical.demandpool import DemandPool
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.formats import read_texts
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from test_out_of_order import HeldEncoder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("dpool"), "jsonl.zst", tokenizer_file)


def _texts(cache, manifest, o):
    obj = manifest.sources[0].objects[o]
    return read_texts(cache.fetch(obj, manifest.resolve(obj.location)).path, "jsonl", obj.compression, "text",
                      obj.location)


def _dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def test_a_killed_worker_is_replaced_and_the_batch_sent_again_else_named(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    plain = encoder_for_manifest(manifest)
    records = [37, 3, 60, 11]
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        raw = cache.fetch(manifest.sources[0].objects[1], manifest.resolve(manifest.sources[0].objects[1].location))
        want = [plain.encode_batch(_texts(cache, manifest, 1))[r] for r in records]
        spool = str(cache.root / "tmp")
        pool = DemandPool(manifest, 1, spool, retries=1)
        try:
            got = pool.tokens((0, 1), str(raw.path), records)
            assert all(np.array_equal(a, b) and a.dtype == np.uint32 for a, b in zip(got, want))
            (pid,) = pool.pids()
            os.kill(pid, signal.SIGKILL)
            _dead(pid)
            again = pool.tokens((0, 1), str(raw.path), records)  # a fresh worker, the same ids
            assert pool.restarts == 1 and pool.pids() != [pid]
            assert all(np.array_equal(a, b) for a, b in zip(again, want))
        finally:
            pool.close()
        pool = DemandPool(manifest, 1, spool, retries=0)
        try:
            (pid,) = pool.pids()
            os.kill(pid, signal.SIGKILL)
            _dead(pid)
            with pytest.raises(TokenizerWorkerError) as info:
                pool.tokens((0, 1), str(raw.path), records)
            assert str(pid) in str(info.value) and manifest.sources[0].objects[1].location in str(info.value)
            assert info.value.worker == pid
        finally:
            pool.close()
        raw.close()
        assert not [p for p in os.listdir(spool) if p.startswith("demand-")]  # token files unlinked


@pytest.mark.slow
def test_with_fills_held_the_stream_from_worker_processes_equals_the_in_order_oracle(corpus, tmp_path):
    from sluice.loaderd.logical import Plan, micro_batches_digest
    from sluice.runspec import load_runspec

    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))  # order "global": documents from anywhere
    objects = manifest.sources[0].objects
    plain = encoder_for_manifest(manifest)
    with NodeCache(tmp_path / "ref-cache", 1 << 30) as ref_cache:
        tokens = [plain.encode_batch(_texts(ref_cache, manifest, o)) for o in range(len(objects))]
    want, state = {}, plan.initial_state()
    for _ in range(8):
        batch, state = plan.step(state, lambda ref: tokens[ref.obj][ref.record])
        want[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))

    enc = HeldEncoder(plain, fill_free=1)  # the daemon's encoder: each fill writes one chunk, then is held
    got = {}
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=len(objects), chunk_bytes=2048, demand_workers=2)
        try:
            assert docs.start_demand_pool()
            state = plan.initial_state()
            for _ in range(8):
                batch, state = plan.step(state, docs)
                got[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))
            demanded, in_workers = docs.demanded_docs, docs._dpool.documents
        finally:
            enc.release()
            docs.close()
    assert got == want
    assert demanded > 0 and in_workers == demanded  # every demanded document came from a worker process
    assert enc.demand_texts == []  # none was encoded in a demand thread of this process


def test_demand_workers_flag_takes_auto_or_a_count_and_names_a_bad_value():
    from sluice.errors import SpecError
    from sluice.loaderd.cli import demand_workers_arg
    from sluice.loaderd.physical.demandpool import default_workers

    assert demand_workers_arg("auto") == default_workers() >= 0
    assert demand_workers_arg("0") == 0 and demand_workers_arg("3") == 3
    for bad in ("-1", "many", "257"):
        with pytest.raises(SpecError, match=f"--demand-workers '{bad}'"):
            demand_workers_arg(bad)


def _descendants(pid: int) -> list[int]:
    """Process ids below `pid` (children, grandchildren, ...), from /proc."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_daemon_with_demand_workers_serves_the_plan_even_after_its_workers_are_killed(corpus, tmp_path):
    from loaderd_support import Daemon, reference
    from test_loaderd import check_equal, take

    ref = reference(corpus, 10, 1)
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--demand-workers", "2")) as d:
        c = d.client(0, 1)
        got = take(c, 2)
        below = [p for p in _descendants(d.pid) if b"multiprocessing.forkserver" in _cmdline(p)]
        assert below, "no worker process below the daemon"
        for pid in below:  # the forkserver and the tokenizer workers: kill -9
            os.kill(pid, signal.SIGKILL)
        got += take(c, 8)
        stats = c.stats()
        c.close()
    assert sorted(check_equal(got, ref, 0, c.info["micro_per_step"])) == list(range(10))
    assert stats["producer"]["sluice_demanded_documents_total"] > 0
