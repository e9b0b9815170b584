"""The in-order fill's pause for demand tasks, paced by its own chunks (demandtasks.py, `demand.FillPace`).

Specifications:
* A fill whose chunks are cheap (fastokens) does not wait for the demand
  tasks between chunks: with a demand task held for the whole test, it
  still tokenizes its object to the end at once (before, it waited up to 2 s
  after every chunk, so the object stayed "filling" and every step took the
  plan's slow path).
* A fill whose chunks are slow (`tokenizers`, made slower here) still gives
  way to the demand tasks: with one held, it makes only a few chunks in the
  time it could have made dozens.
* The ids are the same either way (the fill writes what it would have).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sluice.cache import NodeCache
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.tokenize import encoder_for_manifest
from support import freeze_here
from test_out_of_order import HeldEncoder, _one_object


class _Ref:
    def __init__(self, record: int) -> None:
        self.source, self.obj, self.record = 0, 0, record


class SlowFill(HeldEncoder):
    """HeldEncoder whose fill calls each take `delay` s more (a slow backend's chunk)."""

    def __init__(self, enc, delay: float, **kw) -> None:
        super().__init__(enc, **kw)
        self.delay = delay

    def encode_batch(self, texts):
        if threading.current_thread().name.startswith("loaderd-worker"):
            time.sleep(self.delay)  # (the chunk's cost, not a synchronization)
        return super().encode_batch(texts)


def _held_demand(docs: DocSource, enc: HeldEncoder, records: int) -> None:
    """Announce the object's last records: a demand task starts on them and is held at the gate."""
    docs.prefetch([_Ref(r) for r in range(records - 50, records)])
    deadline = time.monotonic() + 30
    while not any(n.startswith("loaderd-demand") for n in enc.calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(n.startswith("loaderd-demand") for n in enc.calls), "no demand task started"


def _fastokens_object(folder, tokenizer_file, n: int):
    """`_one_object`'s manifest frozen with the fastokens backend (proven on its sample by freeze)."""
    pytest.importorskip("fastokens")
    _one_object(folder, tokenizer_file, n)
    spec = (folder / "dataset.toml").read_text()
    (folder / "dataset.toml").write_text('tokenizer_backend = "fastokens"\n' + spec)
    freeze_here(folder / "dataset.toml", folder / "manifest.json")
    return load_manifest(folder / "manifest.json")


def test_a_fill_of_cheap_chunks_does_not_wait_for_a_busy_demand_path(tmp_path, tokenizer_file):
    n = 6000
    manifest = _fastokens_object(tmp_path / "c", tokenizer_file, n)
    plain = encoder_for_manifest(manifest)
    assert plain.backend == "fastokens"
    enc = HeldEncoder(plain, fill_free=10**9, demand_free=0)  # the demand task is held; the fill is not
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)  # ~60 chunks
        try:
            _held_demand(docs, enc, n)
            # Before: up to 2 s after each chunk while the demand task runs, over 100 s for this object.
            deadline = time.monotonic() + 45
            while docs.tokenized_objects < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            done, chunks = docs.tokenized_objects, enc.calls.get("loaderd-worker_0", 0)
            assert enc.demand_texts == []  # the demand task was held throughout
            got = [docs(_Ref(r)) for r in (0, n // 2, n - 1)]
        finally:
            enc.release()
            docs.close()
    assert done == 1 and chunks > 30
    want = plain.encode_batch([f"doc {i} " + "z" * (i % 17) for i in (0, n // 2, n - 1)])
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow  # waits 1.5 s on purpose
def test_a_fill_of_slow_chunks_still_gives_way_to_the_demand_path(tmp_path, tokenizer_file):
    n = 6000
    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, n))
    enc = SlowFill(encoder_for_manifest(manifest), 0.03, fill_free=10**9, demand_free=0)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            _held_demand(docs, enc, n)
            t0, calls0 = time.monotonic(), enc.calls.get("loaderd-worker_0", 0)
            time.sleep(1.5)  # the window the fill's chunks are counted in (not a synchronization)
            made = enc.calls.get("loaderd-worker_0", 0) - calls0
            elapsed = time.monotonic() - t0
        finally:
            enc.release()
            docs.close()
    # Unpaused it would make one chunk per 0.03 s (50 here); paused, at most 1 per 0.03 + 8 x 0.03 s (the first
    # ones, before 3 are timed, up to 2 s).
    assert made < elapsed / 0.03 / 3, made
