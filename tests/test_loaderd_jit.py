"""A daemon switches from the fast path in Python to the compiled kernel mid-stream, and its stream is the plan's.

`loaderd --jit numba` (and `auto` on a machine without the module compiled
ahead of time, tests/test_jitaot.py) starts on the fused path's Python code and
loads the numba kernel in the background when `jitstart.StartRule` says (the
run spec's `max_steps` leaves `START_AFTER_STEPS` steps or more, the producer
waited for its consumer `IDLE_START_S` in all, or `START_AFTER_STEPS` steps
made); from its next call on the producer computes with it. The stream
before, across and after the switch must equal the reference plan's
(tests/test_logical_jit.py holds the kernel to its source run uncompiled, call by call;
this is the daemon doing it for real, on pre-tokenized shards). `--jit off`
never loads it and says so in STATS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from loaderd_support import Daemon, build_corpus, reference, stream_digests
from support import skip_unless_installed

from sluice.loaderd.physical.jitload import KERNEL_RSS_BYTES
from sluice.loaderd.physical.jitstart import IDLE_START_S, START_AFTER_STEPS

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("jit"), "sltok", tokenizer_file, docs=600, lanes=4,
                        global_batch=8, micro_batch=4, seq_len=64)


def active(client) -> float:
    return client.stats()["producer"]["sluice_fused_kernel_loaded"]


def take_across_the_switch(client, after: int, limit_s: float = 90.0, from_step: int = START_AFTER_STEPS,
                           pause_s: float = 0.0) -> tuple[list[dict], int | None]:
    """Micro-batches until the kernel has been active for `after` more steps (or `limit_s`); the first step
    (from `from_step`, checked every 16) received after it was seen active (None: never). `pause_s`: the
    consumer's own time per step (a trainer's), before taking the next."""
    out, seen, deadline = [], None, time.monotonic() + limit_s
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v)
                    for k, v in mb.items()})
        last = mb["micro"] + 1 == client.info["micro_per_step"]
        if last and seen is None and mb["step"] >= from_step and mb["step"] % 16 == 0 and active(client):
            seen = mb["step"]
        if last and ((seen is not None and mb["step"] >= seen + after) or time.monotonic() > deadline):
            break
        if last and pause_s:
            PAUSE.wait(pause_s)  # (nothing sets it: the consumer's step, not a synchronization)
    return out, seen


PAUSE = threading.Event()


def assert_the_plan_across_the_switch(corpus, batches, seen) -> None:
    """Every step taken (from the first, on `Plan.step`, to past the switch at ~`seen`) is the plan's."""
    assert seen is not None, "the kernel was not active within the time limit"
    got = stream_digests(batches, 2)
    ref = reference(corpus, max(got) + 1, 1)
    assert sorted(got) == list(range(max(got) + 1))
    for step, digest in got.items():
        assert digest == ref[(step, 0)][0], f"step {step} differs from the plan (kernel active from ~{seen})"


@pytest.mark.slow
def test_the_stream_equals_the_plan_across_the_switch(corpus):
    with Daemon(corpus, cache=corpus / "cache-auto", extra=("--jit", "numba")) as d:
        c = d.client()
        assert active(c) == 0  # the start is on `Plan.step`
        batches, seen = take_across_the_switch(c, after=200)
        fast = c.stats()["fast_path"]  # loaded, and counted as serving steps (not only "loaded")
        c.close()
    assert_the_plan_across_the_switch(corpus, batches, seen)
    assert fast["kernel_loaded"] == 1 and fast["steps_by_path"]["fused-kernel"] > 0, fast
    assert fast["kernel_ahead_of_time"] == 0, fast  # (`--jit numba`)


@pytest.mark.slow
def test_this_corpus_reaches_the_kernel(corpus, tmp_path, jit_kernel):
    """The steps above are the kernel's to compute (one live source, mapped shards), not all refused by the
    fused path: the producer's own calls on the daemon's data path, counted."""
    from sluice.loaderd.physical.jitload import load
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    kernel = load(None)  # loaded in this process already by conftest's jit_kernel (its cache: NUMBA_CACHE_DIR)
    config = DataPathConfig(cache_dir=str(tmp_path / "cache"), cache_budget=1 << 30)
    with open_data_path(load_manifest(corpus / "manifest.json"), load_runspec(corpus / "run.toml"), config) as data:
        maker = StepMaker(data.plan(), data.docs, replica=0, replicas=1)
        maker.jit.kernel = kernel  # as the loader sets it
        state = maker.plan.initial_state()
        for _ in range(400):  # (one step a call while the shards are still being filled into the cache)
            state = maker.produce_steps(state, 4)[-1][1]
            if kernel.calls >= 20:
                break
    assert kernel.calls >= 20, kernel.calls


@pytest.mark.slow
def test_jit_off_never_loads(corpus):
    with Daemon(corpus, cache=corpus / "cache-off", extra=("--jit", "off")) as d:
        c = d.client()
        n = 0
        for mb in c:
            n += 1
            if mb["step"] >= START_AFTER_STEPS + 64:
                break
        time.sleep(1.0)  # what a warm load takes, had it started
        assert active(c) == 0
        c.close()
    assert not (corpus / "cache-off" / "jit").exists()


def started_by(log_path) -> tuple[str, int, int | None]:
    """The reason and the step after which the load started, and the step after which it was first due but held
    back while tokens were made from text (None: not held back), from the daemon's "fused kernel active after
    ... (HOW; started by REASON; after step N[; held back after step M while tokens were made])" log line
    (("", -1, None) where none)."""
    for line in log_path.read_text(errors="replace").splitlines():
        msg = json.loads(line).get("msg", "") if line.startswith("{") else line  # (the daemon logs JSON lines)
        if "fused kernel active after" in msg:
            why, rest = msg.split("started by ", 1)[1].rstrip(")").split("; after step ", 1)
            step, _, held = rest.partition("; held back after step ")
            return why, int(step), (int(held.split()[0]) if held else None)
    return "", -1, None


@pytest.mark.slow
def test_a_run_the_spec_says_is_long_loads_the_kernel_at_once(tmp_path, tokenizer_file):
    """`max_steps` leaving START_AFTER_STEPS steps or more: the load starts after the first call (step 0), not
    after the step count; the kernel then serves (once loaded: a cold numba cache compiles in a child first) and
    every step is still the plan's."""
    corpus = build_corpus(tmp_path, "sltok", tokenizer_file, docs=600, lanes=4, global_batch=8, micro_batch=4,
                          seq_len=64, max_steps=1 << 30)  # (the stream must outlast a cold cache's compile)
    with Daemon(corpus, cache=corpus / "cache", extra=("--log-level", "info", "--jit", "numba")) as d:
        c = d.client()
        batches, seen = take_across_the_switch(c, after=100, from_step=0)
        c.close()
    assert_the_plan_across_the_switch(corpus, batches, seen)
    why, step, held = started_by(d.log)
    assert why == f"max_steps: {(1 << 30) - 1} steps to go" and step == 0 and held is None, d.log.read_text()[-2000:]


@pytest.mark.slow
def test_a_producer_waiting_for_its_consumer_loads_the_kernel(corpus):
    """No `max_steps`; a consumer taking 20 ms a step (a fast trainer's): the producer waits for it, so the
    load starts once it has waited IDLE_START_S, long before START_AFTER_STEPS steps (at ~25 steps)."""
    with Daemon(corpus, cache=corpus / "cache-idle", extra=("--log-level", "info", "--jit", "numba")) as d:
        c = d.client()
        batches, seen = take_across_the_switch(c, after=20, from_step=0, pause_s=0.02, limit_s=60)
        c.close()
    assert_the_plan_across_the_switch(corpus, batches, seen)
    why, step, _ = started_by(d.log)
    assert why.startswith("idle: the producer waited") and 0 < step < START_AFTER_STEPS // 4, d.log.read_text()[-2000:]
    assert float(why.split()[4]) >= IDLE_START_S


@pytest.mark.slow
def test_the_kernel_waits_until_no_tokens_are_made_from_text(tmp_path, tokenizer_file):
    """On the fly (jsonl.zst), every step is `Plan.step`'s while some object's tokens are being made (fall-back
    ``filling``): the kernel could not serve them, so a waiting producer (20 ms a step, its idle rule met within
    ~40 steps) does not load it then (0.35 s of GIL and ~120 MiB for nothing); once the last object is made it
    does, and serves; the log line says after which step the rule was due and held back. `--lead-steps 8`: the
    producer reaches its lead within the filling, so the idle rule is due well before the last object is made
    (with the default 16 its waits reached 0.5 s only as filling ended)."""
    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file, docs=100, lanes=4, global_batch=8,
                        micro_batch=4, seq_len=64)
    with Daemon(root, extra=("--log-level", "info", "--lead-steps", "8", "--jit", "numba")) as d:
        c = d.client()
        batches, seen = take_across_the_switch(c, after=10, from_step=0, pause_s=0.02, limit_s=60)
        fast_path = c.stats()["fast_path"]
        c.close()
    assert seen is not None, "the kernel never served"
    filling = fast_path["fallbacks"]["filling"]
    why, step, held = started_by(d.log)
    assert why.startswith("idle: the producer waited") and step >= filling, (why, step, fast_path)
    # The case was met: the rule was due while steps were still made from text (about 2-4 s of filling here,
    # 100-150 steps; the rule is due after 30-40), and the load waited for the filling's end.
    assert held is not None and held < filling - 1 <= step, (why, step, held, fast_path)
    assert fast_path["steps_by_path"]["fused-kernel"] > 0, fast_path


MEASURE_LOAD = """
import sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
import sluice.loaderd.server  # everything a daemon imports before the kernel
from sluice.loaderd.physical import jitload
before = rss()
kernel = jitload.load(sys.argv[1])
print(before, rss())
"""


def test_a_loaded_kernel_stays_within_its_declared_memory(jit_kernel):
    """The kernel is a fixed cost in every process that loads it (numba, LLVM, the code): what it adds to a
    fresh interpreter's resident memory stays within `KERNEL_RSS_BYTES`, the figure the daemon's bounds declare
    (docs/loaderd.md; the soak test's RSS bound counts it)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc to read resident memory")
    out = subprocess.run([sys.executable, "-c", MEASURE_LOAD, os.environ["NUMBA_CACHE_DIR"]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    added = after - before
    assert 16 << 20 < added <= KERNEL_RSS_BYTES, f"the kernel added {added >> 20} MiB (declared {KERNEL_RSS_BYTES >> 20})"


MEASURE_HEAP = """
import gc, sys
import sluice.loaderd.server  # everything a daemon imports before the kernel
from sluice.loaderd.physical import jitload
from sluice.loaderd.physical.gcpause import freeze_startup_heap
freeze_startup_heap()  # as the daemon does at its start
before = len(gc.get_objects())
loader = jitload.KernelLoader("numba", sys.argv[1])
loader.start("test")
assert loader.wait(120) and loader.state == "active", (loader.state, loader.cause)
import numba.core.registry
print(before, len(gc.get_objects()), gc.isenabled(),
      any(o is numba.core.registry.__dict__ for o in gc.get_objects()))
"""


def test_the_kernels_load_leaves_no_objects_to_later_collections(jit_kernel):
    """A collection holds the GIL for its whole walk (gcpause.py): what the load adds (numba's modules and
    registries, tens of thousands of objects alive for the daemon's life) is frozen out of the collector, as the
    daemon's start-up heap is, and the collector is on again afterwards."""
    out = subprocess.run([sys.executable, "-c", MEASURE_HEAP, os.environ["NUMBA_CACHE_DIR"]],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, enabled, numba_tracked = out.stdout.split()
    assert enabled == "True" and numba_tracked == "False", out.stdout
    assert int(after) - int(before) < 5000, out.stdout  # without the freeze: about 84,000 more
