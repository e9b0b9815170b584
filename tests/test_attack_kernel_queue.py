"""Attacks on the fused path's compiled kernel and on a small step queue (issue 9, items 4-5).

The kernel (`logical/jit.py`) must give its source's bytes and states (run uncompiled) on
inputs the property of tests/test_logical_jit.py does not draw: every shard
token dtype with ids at its limit, frame ids that do not fit the shard's
dtype, seq_len 1 and 2, documents many calls long, several rows per lane,
objects of different dtypes in one call. The loader must stay on `Plan.step`,
with one log line and no crash, when its cache directory cannot be
made or its numba cache is garbage, and a cold-cache compile child must end
when the process that started it is killed with -9. Over a step queue of ~2
steps, the daemon must equal the plan through a storm of RESETs, for peers
of two replicas, and for a reader whose replies wait while their steps are
released.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from logical_helpers import MappedDocs, make_manifest, make_spec
from support import copy_numba_cache, skip_unless_installed
from sluice.loaderd.logical import Plan
from sluice.loaderd.physical import jitaot, jitload
import test_logical_jit
from test_logical_jit import run

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection


class WarmPlan(Plan):
    """A plan whose batch-size estimate starts near these corpora's document length (it starts at 512, and a
    call drawing too few candidates stands aside: the kernel would be reached only after dozens of calls). The
    estimate sizes the candidate draw only, never the stream."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.mean_framed_len = 12.0


@pytest.fixture(autouse=True)
def warm_plans(monkeypatch):
    monkeypatch.setattr(test_logical_jit, "Plan", WarmPlan)


@pytest.fixture(scope="module", params=["numba", "ahead-of-time"])
def kernel(request, jit_kernel):
    """numba's dispatchers, then the module compiled ahead of time (`jitaot`): the same attacks on both."""
    if request.param == "numba":
        return jitload.load(None)  # in process already (conftest's jit_kernel): hands the orders the Feistel kernel
    return request.getfixturevalue("aot_kernel") and jitload.load_ahead(os.environ["NUMBA_CACHE_DIR"])


class TypedDocs(MappedDocs):
    """`MappedDocs` whose shard of object o holds `dtypes[o % len(dtypes)]` tokens, each id moved to `top - id`
    (ids at the dtype's limit), read-only as a memory-mapped shard is."""

    def __init__(self, plan, max_len, dtypes, top, **kw):
        super().__init__(plan, max_len, **kw)
        self.dtypes, self.top = dtypes, top

        self.typed = {}

    def _shard(self, s, o):
        got = self.typed.get((s, o))
        if got is None:
            off, toks, n = super()._shard(s, o)
            dt = np.dtype(self.dtypes[o % len(self.dtypes)])
            top = min(self.top, int(np.iinfo(dt).max))
            out = (top - toks.astype(np.int64)).astype(dt)
            out.flags.writeable = False
            got = self.typed[(s, o)] = (off, out, n)
        return got


def framed(manifest, bos, eos, vocab):
    """`manifest` with frame ids `bos`, `eos` and a vocabulary of `vocab` ids."""
    return dataclasses.replace(manifest, tokenizer=dataclasses.replace(manifest.tokenizer, vocab_size=vocab),
                               packing=dataclasses.replace(manifest.packing, bos_id=bos, eos_id=eos))


DTYPE_CASES = [
    ((np.uint16,), 65535, 0, 2),
    ((np.uint16,), 65535, 65535, 70000),  # eos does not fit uint16: the kernel writes it as int32 all the same
    ((np.uint32,), 2**31 - 1, 2**31 - 1, 5),
    ((np.int32,), 2**31 - 1, 0, 2),
    ((np.int64,), 2**31 - 1, 0, 2),
    ((np.uint16, np.uint32, np.int64), 60000, 1, 2),  # objects of three dtypes in one call
]


@pytest.mark.parametrize("dtypes,top,bos,eos", DTYPE_CASES)
@pytest.mark.parametrize("sep", ["eos", "bos_eos", "bos"])
def test_token_dtypes_and_ids_at_the_limit(kernel, dtypes, top, bos, eos, sep):
    manifest = framed(make_manifest([("a", [60, 50, 70], "1", "repeat")], separator=sep, seq_len=16,
                                    loss_mask="exclude_separator"), bos, eos, max(top, bos, eos) + 1)
    spec = make_spec(lanes=3, global_batch=6, micro_batch=1, order="global", seed=5)
    start = Plan(manifest, spec).initial_state()
    hits = run(manifest, spec, lambda p: TypedDocs(p, 30, dtypes, top, empty_every=4), start, [0, 1, 2], 3,
               kernel, calls=4, reference=True)
    assert hits >= 1


SHAPES = [  # (seq_len, per_lane, lanes, max document length, n, empty_every)
    (2, 1, 2, 5, 4, 0),  # two tokens a row (the least seq_len): every document straddles
    (2, 3, 2, 9, 3, 3),
    (4, 1, 1, 600, 5, 0),  # documents many calls long
    (512, 2, 2, 40, 2, 2),  # many documents a row, half of them empty
    (37, 4, 3, 150, 3, 0),  # several rows per lane
]


@pytest.mark.parametrize("seq_len,per_lane,lanes,max_len,n,empty_every", SHAPES)
@pytest.mark.parametrize("sep,mask", [("eos", "exclude_separator"), ("none", "all"), ("bos_eos", "all")])
def test_shapes_far_from_the_property(kernel, seq_len, per_lane, lanes, max_len, n, empty_every, sep, mask):
    manifest = make_manifest([("a", [800, 600, 1000], "1", "repeat")], separator=sep, loss_mask=mask,
                             seq_len=seq_len)
    spec = make_spec(lanes=lanes, global_batch=lanes * per_lane, micro_batch=1, order="global", seed=9)
    start = Plan(manifest, spec).initial_state()
    hits = run(manifest, spec, lambda p: MappedDocs(p, max_len, empty_every=empty_every), start,
               list(range(lanes)), n, kernel, calls=5, reference=True)
    assert hits >= 1 or (sep == "none" and empty_every)  # an empty document without separators: per-lane path



def test_resume_from_every_step_of_a_run(kernel):
    """Every step of 40 as a resume point (residuals mid-document, at a boundary, on an empty document): the
    kernel's calls from there equal its source's run uncompiled and `Plan.step`'s."""
    manifest = make_manifest([("a", [90, 70, 110], "1", "repeat")], separator="bos_eos", seq_len=16,
                             loss_mask="exclude_separator")
    spec = make_spec(lanes=3, global_batch=6, micro_batch=2, order="global", seed=11)
    plan = Plan(manifest, spec)
    docs = MappedDocs(plan, 40, empty_every=6)
    state, hits = plan.initial_state(), 0
    for _ in range(40):
        hits += run(manifest, spec, lambda p: MappedDocs(p, 40, empty_every=6), state, [0, 1, 2], 3, kernel,
                    calls=2)
        _, state = plan.step(state, docs)
    assert hits >= 40


LOAD = (
    "import json, sys\n"
    "from sluice.loaderd.physical.jitload import KernelLoader\n"
    "loader = KernelLoader(sys.argv[2], sys.argv[1])\n"
    "loader.start()\n"
    "loader.wait(240)\n"
    "print(json.dumps({'state': loader.state, 'cause': loader.cause}))\n"
)


def load_in_child(cache_dir, mode: str = "numba", **env_extra) -> tuple[dict, str]:
    """A `KernelLoader` (`mode`: numba's dispatchers unless asked) over `cache_dir` in a fresh process (numba takes
    its cache directory once a process): its final state and cause, and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | env_extra
    got = subprocess.run([sys.executable, "-c", LOAD, str(cache_dir), mode], capture_output=True, text=True,
                         timeout=300, env=env)
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr[-2000:]
    return json.loads(got.stdout.strip().splitlines()[-1]), got.stderr


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "fused kernel" in ln]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage index", "truncated code"])
def test_a_damaged_numba_cache_leaves_the_numpy_path_with_one_line(jit_kernel, tmp_path, damage):
    """numba's cache files (pickles it reads back) damaged after a good compile, marker kept: the load fails with
    one line naming the cause, the daemon stays on `Plan.step`; nothing crashes. (The failure is sticky: every
    daemon over that cache folder stays on `Plan.step` until someone deletes it.) The good compile is the
    session's, copied (a cold folder's compile: the two daemons' test below)."""
    jit_dir = copy_numba_cache(tmp_path / "jit")
    out, _ = load_in_child(jit_dir)
    assert out["state"] == "active", out
    files = [p for p in jit_dir.rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert files
    for p in files:
        if damage == "garbage index" and p.suffix == ".nbi":
            p.write_bytes(b"not a pickle" * 8)
        if damage == "truncated code" and p.suffix == ".nbc":
            p.write_bytes(p.read_bytes()[:30])
    out, err = load_in_child(jit_dir)
    assert out["state"] == "failed" and "Unpickling" in out["cause"], out
    assert "staying on Plan.step" in one_line(err)
    assert f"numba's cache: {jit_dir} (remove it to compile again)" in one_line(err)  # it stays until removed


@pytest.mark.slow
@pytest.mark.parametrize("where", ["cache dir is a file", "NUMBA_CACHE_DIR under a file"])
def test_a_cache_dir_that_cannot_be_made_leaves_the_numpy_path_with_one_line(tmp_path, where):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    if where == "cache dir is a file":
        out, err = load_in_child(blocker)
    else:
        out, err = load_in_child(tmp_path / "jit", NUMBA_CACHE_DIR=str(blocker / "numba"))
    assert out["state"] == "failed", out
    assert str(blocker) in out["cause"] and "staying on Plan.step" in one_line(err)


@pytest.mark.slow
def test_a_compile_child_ends_when_its_parent_is_killed(tmp_path):
    """The process loading the kernel (a daemon) is killed with -9 while a cold cache compiles
    in its child: no `close` runs, yet the child must not live on, reparented, for the seconds (up to
    `WARM_TIMEOUT_S`) its compile takes. It ends itself within about a second; no marker is written."""
    import psutil

    code = (
        "import os, signal, sys, time\n"
        "from sluice.loaderd.physical.jitload import KernelLoader\n"
        "loader = KernelLoader(sys.argv[2], sys.argv[1])\n"
        "loader.start()\n"
        "t = time.monotonic() + 60\n"
        "while loader._child is None and time.monotonic() < t:\n"
        "    time.sleep(0.01)\n"
        "print(loader._child.pid, flush=True)\n"
        "time.sleep(0.3)\n"  # the child is importing or compiling
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "jit"), "auto"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert got.returncode == -9, got.stderr[-2000:]
    child = psutil.Process(int(got.stdout.strip()))  # raises NoSuchProcess where it is already gone
    try:
        child.wait(3)
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the compile child outlived its killed parent by over 3 s")
    assert not any(p.name.startswith("warm-") or p.suffix in (".so", ".json", ".failed")
                   for p in (tmp_path / "jit").iterdir())


@pytest.mark.slow
def test_a_restore_storm_over_a_full_queue_stays_on_the_plan(tmp_path, tokenizer_file):
    """RESETs back to back while the producer fills a queue of ~2 steps (calls of superseded epochs in flight,
    room freed by the RESET and filled again): after every restore the next steps are the plan's."""
    import random

    from loaderd_support import Daemon, build_corpus, reference
    from test_loaderd import check_equal, take

    corpus = build_corpus(tmp_path, "sltok", tokenizer_file)
    ref = reference(corpus, 40, 1)
    rng = random.Random(7)
    with Daemon(corpus, cache=tmp_path / "cache",
                extra=("--queue-bytes", "20KiB", "--lead-steps", "8")) as d:
        c = d.client(0, 1)
        got = take(c, 12)
        mps = c.info["micro_per_step"]
        assert sorted(check_equal(got, ref, 0, mps)) == list(range(12))
        saved = {s: c.state_dict_at(s) for s in range(12)}
        for _ in range(12):
            for _ in range(rng.randint(1, 3)):  # several RESETs before a step is read
                at = rng.randrange(12)
                c.load_state_dict(saved[at])
            again = take(c, rng.randint(1, 4))
            assert again[0]["step"] == at + 1
            steps = check_equal(again, ref, 0, mps)
            assert sorted(steps) == list(range(at + 1, at + 1 + len(steps)))
        c.close()


@pytest.mark.slow
def test_peers_of_two_replicas_hold_the_same_steps_of_a_full_queue(tmp_path, tokenizer_file):
    """Two replicas, each read by two peers (a step is released only once both read it) over queues of ~2
    steps, one peer slow: the fast peer waits, the producer waits for the release, no step is released while a
    peer still has to read it. Each peer gets its replica's plan, byte for byte the same as its peer's."""
    import threading
    import time

    from loaderd_support import Daemon, build_corpus, reference, stream_digests

    corpus = build_corpus(tmp_path, "sltok", tokenizer_file)
    steps = 14
    ref = reference(corpus, steps, 2)
    out: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []
    with Daemon(corpus, replicas=2, cache=tmp_path / "cache",
                extra=("--queue-bytes", "20KiB", "--lead-steps", "8")) as d:

        def reader(replica: int, peer: int) -> None:
            try:
                c = d.client(replica, 2, peers=2)
                got = []
                for mb in c:
                    got.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v)
                                for k, v in mb.items()})
                    if peer == 1:
                        time.sleep(0.01)  # the slow peer: the queue fills behind it
                    if mb["step"] == steps - 1 and mb["micro"] + 1 == c.info["micro_per_step"]:
                        break
                out[(replica, peer)] = (got, c.info["micro_per_step"])
                c.close()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(r, p)) for r in range(2) for p in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a peer did not get its steps within 60 s"
    for (replica, peer), (got, mps) in out.items():
        digests = stream_digests(got, mps)
        assert sorted(digests) == list(range(steps)), (replica, peer)
        for step, digest in digests.items():
            assert digest == ref[(step, replica)][0], f"replica {replica} peer {peer} step {step} is not the plan's"
    for replica in range(2):
        a, b = out[(replica, 0)][0], out[(replica, 1)][0]
        assert [x["input_ids"].tobytes() + x["labels"].tobytes() for x in a] == \
            [x["input_ids"].tobytes() + x["labels"].tobytes() for x in b]


@pytest.mark.slow
def test_two_daemons_loading_one_cold_cache_at_once_both_get_the_kernel(tmp_path):
    """The machine's daemons share one cache folder (`jitload.machine_cache_dir`): two cold loads at once (two
    compile children, one after the other on the folder's lock: the second finds numba's cache warm and the
    module built; a loader's own process never compiles, so a daemon's GIL stays free) both end active on the
    module compiled ahead of time; numba's cache files and the warm marker are in the folder, and a third load
    after them starts no child."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    procs = [subprocess.Popen([sys.executable, "-c", LOAD + "print(loader.how)\n", str(tmp_path / "jit"), "auto"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        how = "ahead-of-time" if jitaot.state(tmp_path / "jit") == "built" else "numba"  # (no C compiler: numba)
        assert p.returncode == 0 and out.strip().splitlines()[-1] == how, err[-2000:]
        assert json.loads(out.strip().splitlines()[-2])["state"] == "active", err[-2000:]
    assert any(p.suffix == ".nbi" for p in (tmp_path / "jit").rglob("*"))
    assert (tmp_path / "jit" / jitload._marker_name()).exists()
    code = LOAD + "assert loader._child is None, 'a warm cache compiled again'\n"
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "jit"), "auto"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert got.returncode == 0 and json.loads(got.stdout.strip().splitlines()[-1])["state"] == "active", \
        got.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("seq_len,queue", [(64, "20KiB"), (131072, "8MiB")])
def test_replies_queued_for_a_slow_reader_survive_the_release_of_their_steps(tmp_path, tokenizer_file, seq_len,
                                                                             queue):
    """A client with many requests in flight that reads slowly: its replies sit in the sockets (or its ring)
    while the steps they came from are released and the queue (~2 steps) fills again. Each is still the plan's
    bytes. With 1 MiB arrays (over the sockets' `COPY_BELOW`) the frames go without a copy."""
    import time

    from loaderd_support import Daemon, build_corpus, reference, stream_digests

    corpus = build_corpus(tmp_path, "sltok", tokenizer_file, seq_len=seq_len, lanes=2, global_batch=2,
                          micro_batch=2)
    steps = 16 if seq_len < 1024 else 8
    ref = reference(corpus, steps, 1)
    with Daemon(corpus, cache=tmp_path / "cache",
                extra=("--queue-bytes", queue, "--lead-steps", "8")) as d:
        c = d.client(0, 1, credits=8)
        got = []
        for mb in c:
            time.sleep(0.03)  # the replies behind this one wait; the queue moves on
            got.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v)
                        for k, v in mb.items()})
            if mb["step"] == steps - 1 and mb["micro"] + 1 == c.info["micro_per_step"]:
                break
        mps = c.info["micro_per_step"]
        c.close()
    digests = stream_digests(got, mps)
    assert sorted(digests) == list(range(steps))
    for step, digest in digests.items():
        assert digest == ref[(step, 0)][0], f"step {step} changed before its reply was read"


@pytest.mark.slow
def test_restores_after_the_kernel_switch_stay_on_the_plan(tmp_path, tokenizer_file):
    """With the kernel active, a trainer restores back before the switch (the kernel now computes steps the
    numpy path computed first) and to a step after it: what follows each restore is the plan's."""
    from loaderd_support import Daemon, build_corpus, reference, stream_digests
    from test_loaderd import take
    from test_loaderd_jit import take_across_the_switch

    corpus = build_corpus(tmp_path, "sltok", tokenizer_file, docs=600, lanes=4, global_batch=8, micro_batch=4,
                          seq_len=64)
    with Daemon(corpus, cache=corpus / "cache") as d:
        c = d.client(0, 1)
        batches, seen = take_across_the_switch(c, after=40, limit_s=50)
        assert seen is not None, "the kernel was not active within the time limit"
        mps = c.info["micro_per_step"]
        last = max(stream_digests(batches, mps))
        ref = reference(corpus, last + 30, 1)
        saved = {at: c.state_dict_at(at) for at in (seen - 600, seen + 20, last - 1000)}  # in the client's history
        for at, state in saved.items():
            c.load_state_dict(state)
            again = take(c, 8)
            assert again[0]["step"] == at + 1
            for step, digest in stream_digests(again, mps).items():
                assert digest == ref[(step, 0)][0], f"step {step} after a restore at {at} (kernel from ~{seen})"
        c.close()
