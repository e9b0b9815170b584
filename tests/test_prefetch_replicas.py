"""Prefetch announcements of several replicas sharing one DocSource (docs/tokenize.md, "Out of order").

A daemon serving R >= 2 replicas with thread producers has one DocSource for
all of them; each replica's producer thread announces its next steps' records
with `prefetch`. Specifications:
* Announcements are kept per caller (producer thread) and merged: a replica's
  prefetch replaces only its own earlier announcements, so records two
  replicas announce in one object are all tokenized out of order, ahead of
  their need, whatever the order of the calls. A packer waits for the demand
  path only for a record nobody announced (counted as
  `sluice_demand_waited_documents_total`).
* A real daemon with `--replicas 2` on the fly, two clients reading at once:
  each stream equals its half of the plan; the demand path made documents.
* After a RESTORE of one replica, its next prefetch drops only its own
  announcements of the position it left; an object another replica still
  announces is not stale (its fill goes on) and that replica's announced
  records are still made.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sluice.cache import NodeCache
from sluice.loaderd.physical.demand import AHEAD_BATCH
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from support import freeze_here
from test_out_of_order import HeldEncoder


def _text(obj: int, i: int) -> str:
    return f"o{obj} {i} " + "z" * (i % 17)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory, tokenizer_file):
    """Two plain jsonl objects of 3000 small records each."""
    folder = tmp_path_factory.mktemp("replicas")
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    for o in (0, 1):
        with open(folder / f"o{o}.jsonl", "w") as f:
            for i in range(3000):
                f.write(json.dumps({"text": _text(o, i)}) + "\n")
    (folder / "dataset.toml").write_text(
        'name = "replicas"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 64\nalgorithm = "concat"\n'
        'eos = "<|endoftext|>"\npad = "<|pad|>"\n[[sources]]\nname = "s"\npaths = ["o0.jsonl", "o1.jsonl"]\n'
        'format = "jsonl"\ntext_field = "text"\nweight = "1"\n')
    freeze_here(folder / "dataset.toml", folder / "manifest.json")
    return load_manifest(folder / "manifest.json")


class Ref:
    def __init__(self, obj: int, record: int) -> None:
        self.source, self.obj, self.record = 0, obj, record


def _refs(obj: int, records) -> list[Ref]:
    return [Ref(obj, r) for r in records]


class Replica:
    """A long-lived thread standing for one replica's producer thread (its ident keys its announcements)."""

    def __init__(self, name: str) -> None:
        self._ex = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.ident = self._ex.submit(threading.get_ident).result()

    def prefetch(self, docs: DocSource, refs: list[Ref]) -> None:
        self._ex.submit(docs.prefetch, refs).result(30)

    def close(self) -> None:
        self._ex.shutdown(wait=True)


def _demand_started(enc: HeldEncoder) -> None:
    deadline = time.monotonic() + 30
    while not any(n.startswith("loaderd-demand") for n in enc.calls):
        assert time.monotonic() < deadline, "no demand batch started"
        time.sleep(0.01)


def _made(enc: HeldEncoder, docs: DocSource, want: int, timeout: float = 15.0) -> dict[int, set[int]]:
    """The records the demand path made per object, once it made `want` documents (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while docs.demanded_docs < want and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # nothing more arrives
    made: dict[int, set[int]] = {0: set(), 1: set()}
    for t in list(enc.demand_texts):
        o, i = t.split()[:2]
        made[int(o[1:])].add(int(i))
    return made


def test_two_replicas_announcements_in_one_object_are_all_made(manifest, tmp_path):
    a_recs, b_recs = list(range(1500, 1700)), list(range(2200, 2400))  # far beyond the (held) fill
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0, demand_free=0)
    a, b = Replica("replica-a"), Replica("replica-b")
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            a.prefetch(docs, _refs(0, a_recs))  # replica a's next steps: its first batch starts and is held
            _demand_started(enc)
            b.prefetch(docs, _refs(0, b_recs))  # replica b's, in the same object
            enc.demand_gate.set()
            made = _made(enc, docs, len(a_recs) + len(b_recs))
            got = [docs(r) for r in _refs(0, a_recs[-3:] + b_recs[-3:])]
            waited_announced = docs.demand_waited_docs  # made ahead: no packer waited for them
            unannounced = docs(Ref(0, 2800))  # beyond the held fill, announced by nobody: waited for
            waited = docs.demand_waited_docs
        finally:
            enc.release()
            docs.close()
            a.close()
            b.close()
    assert made[0] == set(a_recs) | set(b_recs)  # b's prefetch replaced none of a's
    want = encoder_for_manifest(manifest).encode_batch([_text(0, i) for i in a_recs[-3:] + b_recs[-3:] + [2800]])
    assert all(np.array_equal(x, y) for x, y in zip(got + [unannounced], want))
    # sluice_demand_waited_documents_total: the prefetch misses, counted once per document
    assert (waited_announced, waited) == (0, 1)


def test_a_restore_of_one_replica_leaves_the_other_replicas_work_alone(manifest, tmp_path):
    a_old, b_recs, a_new = list(range(1000, 1300)), list(range(2000, 2300)), list(range(2500, 2520))
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=0, demand_free=0)
    a, b = Replica("replica-a"), Replica("replica-b")
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            a.prefetch(docs, _refs(0, a_old))  # both replicas read object 0
            _demand_started(enc)  # a's first batch is in progress (held)
            b.prefetch(docs, _refs(0, b_recs))
            docs.restored(a.ident)  # replica a is restored to a position in object 1
            a.prefetch(docs, _refs(1, a_new))
            enc.demand_gate.set()
            made = _made(enc, docs, AHEAD_BATCH + len(b_recs) + len(a_new))
            stopped, dropped = docs.stale_fills_stopped, docs.stale_records_dropped
        finally:
            enc.release()
            docs.close()
            a.close()
            b.close()
    assert made[0] & set(a_old) == set(a_old[:AHEAD_BATCH])  # a's old position: only its batch in progress
    assert made[0] - set(a_old) == set(b_recs)  # b's announcements survived a's RESTORE and prefetch
    assert made[1] == set(a_new)
    assert (stopped, dropped) == (0, 0)  # object 0 is in b's window: not stale


# ------------------------------------------------------------ a real daemon, two replicas
RECORDS = 20000  # per object of the daemon test


@pytest.mark.slow
def test_a_daemon_with_two_replicas_on_the_fly_serves_the_plan_and_makes_their_records_out_of_order(
        tmp_path, tokenizer_file):
    """A real loaderd (`--replicas 2`, thread producers, one DocSource) over two plain jsonl objects
    both replicas draw from (order "global"), two clients reading at once: each stream equals its
    half of the plan, and documents beyond the fills were made by the demand path (STATS).

    What this cannot show: that both replicas' announced records were made ahead. STATS has no
    per-replica or "a packer waited" figure, and the demanded total is the same before the fix
    (commit 8359928): a dropped announcement is still made by the demand path, later, when its
    packer asks; the unit tests above pin that behaviour."""
    from loaderd_support import Daemon, build_corpus, reference
    from test_loaderd import check_equal, take

    root = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=40, objects=2)
    for o in (0, 1):  # larger objects of short records: most of a step's records lie beyond the fills
        (root / "shards" / f"c-{o}.jsonl").write_text(
            "".join(json.dumps({"text": _text(o, i)}) + "\n" for i in range(RECORDS)))
    freeze_here(root / "dataset.toml", root / "manifest.json")
    steps = 60
    ref = reference(root, steps, 2)
    got: dict[int, list[dict]] = {}
    with Daemon(root, replicas=2, cache=tmp_path / "cache") as d:
        clients = [d.client(r, 2) for r in (0, 1)]
        try:
            readers = [threading.Thread(target=lambda r=r: got.__setitem__(r, take(clients[r], steps)))
                       for r in (0, 1)]
            for t in readers:
                t.start()
            for t in readers:
                t.join(120)
            assert not any(t.is_alive() for t in readers), "a client did not receive its steps"
            producer = clients[0].stats()["producer"]
            mps = clients[0].info["micro_per_step"]
        finally:
            for c in clients:
                c.close()
    for r in (0, 1):
        assert sorted(check_equal(got[r], ref, r, mps)) == list(range(steps))
    assert producer["sluice_demanded_documents_total"] > 0, producer
