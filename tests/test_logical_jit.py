"""The fast path's compiled kernel gives its source's bytes and states run uncompiled, and `Plan.step`'s.

`jit.Kernel` walks a call's draws and assembles its rows in numba
(`fusedmix`: `jitdraws.walk` / `jitrows.assemble` for concat; `fusedbins`:
`walk_bins` / `assemble_bins` for best-fit), as numba's dispatchers and as
the module compiled ahead of time. The fast tier holds the same source run
uncompiled (`jitload.uncompiled`) to `Plan.step`; here every call of the
compiled kernels must give identical blocks, states (the JSON bytes), rows
and micro-batch provenance to the uncompiled source's, and `Plan.step`'s,
over framings, loss masks, row counts, lane subsets, resume points and
several objects per call; a deliberately broken kernel must fail the same
comparison. The loader never raises: numba missing or a failed compile
leaves the daemon on `Plan.step` with one log line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logical_helpers import MappedDocs, make_manifest, make_spec
from support import skip_unless_installed
from sluice.datastate import state_json
from sluice.errors import EndOfStream, ExhaustedError, InternalError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical import jit as jit_mod
from sluice.loaderd.logical import order as order_mod
from sluice.loaderd.physical import jitload
from sluice.loaderd.logical.fast import KERNEL_REFUSED, fast_steps
from sluice.loaderd.logical.fused import StateTexts
from test_logical_fused import (LAST, UNCOMPILED, check_mixture, compare, count_locates, five_sources_case,
                                mixture_case, mixture_given)

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection

HITS = {"kernel": 0}


@pytest.fixture(scope="module", params=["numba", "ahead-of-time"])
def kernel(request, jit_kernel):
    """The kernels as numba's dispatchers, then as the module compiled ahead of time (`jitaot`): the same source,
    held to the same properties."""
    if request.param == "numba":
        yield jitload.load(None)  # in process already (conftest's jit_kernel): hands the orders the Feistel kernel
    else:
        yield request.getfixturevalue("aot_kernel") and jitload.load_ahead(os.environ["NUMBA_CACHE_DIR"])
    order_mod.use_compiled(None)  # (the load hands the orders its Feistel kernel: the next modules test numpy's)


def rows_view(got, j):
    return [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens, r.segments)
            for lane, rs in sorted(got.rows(j).items()) for r in rs]


def same(a, b) -> None:
    """Two `FusedSteps` (the uncompiled source's and the kernel's) serve the same: block byte for byte, states, rows,
    every micro-batch's cu_seqlens and samples."""
    assert a.block.dtype == b.block.dtype and a.block.shape == b.block.shape
    assert a.block.tobytes() == b.block.tobytes()
    assert a.states == b.states and a.state_dicts == b.state_dicts
    if isinstance(b.state_dicts, StateTexts):  # the kernel's JSON: the very bytes every entry's state is sent as
        assert b.state_dicts.texts == [state_json(d) for d in a.state_dicts]
    for j in range(len(a.states)):
        assert rows_view(a, j) == rows_view(b, j)
        r0, r1 = 0, a.block.shape[2]
        ca, sa = a.micro(j, r0, r1)
        cb, sb = b.micro(j, r0, r1)
        assert ca.tobytes() == cb.tobytes() and sa == sb


def run(manifest, spec, docs_of, start, lanes, n, kern, calls=4, reference=False, mean=None) -> int:
    """`calls` calls from `start` on two plans, the kernels' source uncompiled and `kern`; each pair equal, each
    step `Plan.step`'s (and
    the per-document reference plan's where `reference`). `mean`: the plans' mean framed length to start from
    (the candidate count follows it). Returns how many calls the kernel computed."""
    pa, pb = Plan(manifest, spec), Plan(manifest, spec)
    if mean is not None:
        pa.mean_framed_len = mean
    da, db, dr = docs_of(pa), docs_of(pb), docs_of(pa)
    oracle = Plan(manifest, spec, reference=True) if reference else None
    state, hits = start, 0
    for _ in range(calls):
        before = kern.calls
        a = fast_steps(pa, state, da, lanes, n, UNCOMPILED)
        b = fast_steps(pb, state, db, lanes, n, kern)
        assert (a if isinstance(a, str) else None) == (b if isinstance(b, str) else None)  # the same reason
        if isinstance(a, str):
            try:
                _, state = pa.step(state, dr, lanes)
            except (EndOfStream, ExhaustedError):
                return hits
            continue
        hits += kern.calls - before
        same(a, b)
        ref = state
        for j in range(n):
            batch, ref = pa.step(ref, dr, lanes)
            assert [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens,
                     r.segments) for lane, rs in sorted(batch.rows.items()) for r in rs] == rows_view(b, j)
            assert b.states[j] == ref and b.state_dicts[j] == ref.state_dict()
            if isinstance(b.state_dicts, StateTexts):  # (byte for byte, as the entries send it)
                assert b.state_dicts.texts[j] == state_json(ref.state_dict())
            if reference:
                rb, rafter = oracle.step(state if j == 0 else b.states[j - 1], dr, lanes)
                assert [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens,
                         r.segments) for lane, rs in sorted(rb.rows.items()) for r in rs] == rows_view(b, j)
                assert rafter == b.states[j]
        state = b.states[-1]
    return hits


framing = st.sampled_from(["eos", "bos", "bos_eos", "none"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(
    counts=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    separator=framing,
    loss_mask=st.sampled_from(["all", "exclude_separator"]),
    seq_len=st.sampled_from([4, 16, 37]),
    lanes=st.sampled_from([1, 2, 3, 4]),
    per_lane=st.integers(1, 3),
    seed=st.integers(0, 2**32),
    resume=st.integers(0, 6),
    max_len=st.sampled_from([1, 5, 40, 150]),
    n=st.integers(1, 5),
    subset=st.sampled_from(["all", "upper", "odd"]),
    empty_every=st.sampled_from([0, 0, 5]),
    rule=st.sampled_from(["repeat", "repeat", "stop"]),
)
def test_kernel_equals_numpy_and_plan_step(kernel, counts, separator, loss_mask, seq_len, lanes, per_lane, seed,
                                           resume, max_len, n, subset, empty_every, rule):
    manifest = make_manifest([("a", counts, "1", rule)], separator=separator, loss_mask=loss_mask,
                             seq_len=seq_len)
    spec = make_spec(lanes=lanes, global_batch=lanes * per_lane, micro_batch=1, order="block", seed=seed)
    plan = Plan(manifest, spec)
    docs = MappedDocs(plan, max_len, empty_every=empty_every)
    start = plan.initial_state()
    for _ in range(resume):
        try:
            _, start = plan.step(start, docs)
        except (EndOfStream, ExhaustedError):
            return
    mine = {"all": list(range(lanes)), "upper": list(range(lanes // 2, lanes)),
            "odd": [lane for lane in range(lanes) if lane % 2] or [0]}[subset]
    HITS["kernel"] += run(manifest, spec, lambda p: MappedDocs(p, max_len, empty_every=empty_every),
                          start.subset(mine), mine, n, kernel, reference=True)


FIXED = [(sep, mask, seq_len, per_lane) for sep in ("eos", "bos", "bos_eos", "none")
         for mask in ("all", "exclude_separator") for seq_len, per_lane in ((16, 1), (37, 2))]


def fixed_cases(kern) -> int:
    """Every framing and loss mask over several objects per call; returns the kernel's calls."""
    hits = 0
    for sep, mask, seq_len, per_lane in FIXED:
        manifest = make_manifest([("a", [300, 200, 400, 100], "1", "repeat")], separator=sep, loss_mask=mask,
                                 seq_len=seq_len)
        spec = make_spec(lanes=4, global_batch=4 * per_lane, micro_batch=1, order="global", seed=3)
        start = Plan(manifest, spec).initial_state()
        hits += run(manifest, spec, lambda p: MappedDocs(p, 40, empty_every=7), start, [0, 1, 2, 3], 4, kern,
                    calls=6)
    return hits


def test_every_framing_takes_the_kernel(kernel):
    assert fixed_cases(kernel) >= len(FIXED) * 2


@pytest.mark.parametrize("order", ["block", "global"])
def test_the_kernel_crosses_the_end_of_a_share(kernel, order):
    """Calls whose candidates go on into the next epoch (`repeat`): the kernel's are the uncompiled source's and
    `Plan.step`'s; every call fused once the candidate count has followed the mean length."""
    manifest = make_manifest([("a", [120], "1", "repeat")], separator="eos", seq_len=16)
    spec = make_spec(lanes=2, global_batch=2, micro_batch=1, order=order, seed=5)
    plan, start = Plan(manifest, spec), None
    docs = MappedDocs(plan, 5)
    state = plan.initial_state()
    for _ in range(60):
        got = fast_steps(plan, state, docs, [0, 1], 4, UNCOMPILED)
        state = plan.step(state, docs)[1] if isinstance(got, str) else got.states[-1]
        start = start or (not isinstance(got, str) and state)
    hits = run(manifest, spec, lambda p: MappedDocs(p, 5), start, [0, 1], 4, kernel, calls=40,
               mean=plan.mean_framed_len)
    assert hits == 40


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 1 << 44), seed=st.integers(0, 2**32), count=st.integers(1, 200),
       rounds=st.integers(1, 8))
def test_the_compiled_feistel_equals_numpy_and_the_scalar_walk(kernel, n, seed, count, rounds):
    """`Feistel.forward_many` with the kernel handed over by the load gives numpy's values and `forward`'s (every
    order's chunks of lane positions go through it), for domains of 1 to 2**44 and any number of rounds."""
    from sluice.loaderd.logical import jitdraws

    perm = order_mod.Feistel(n, order_mod.derive_keys("t", seed, count=rounds))
    xs = np.random.default_rng(seed).integers(0, n, count, dtype=np.int64)
    try:
        order_mod.use_compiled(None)
        want = perm.forward_many(xs).tolist()
        order_mod.use_compiled(jitdraws.feistel_many)
        got = perm.forward_many(xs).tolist()
    finally:
        order_mod.use_compiled(jitdraws.feistel_many)
    assert got == want == [perm.forward(x) for x in xs.tolist()]


def test_an_order_of_an_uncompiled_type_takes_numpy(kernel, monkeypatch):
    """Compiling is off after the load: positions of another type are converted to the compiled one; an argument
    the dispatcher refuses (TypeError) leaves the chunk to numpy's rounds, never a compile."""
    from sluice.loaderd.logical import jitdraws

    perm = order_mod.Feistel(1000, order_mod.derive_keys("u", 1))
    xs = np.arange(0, 1000, 7, dtype=np.int32)
    want = [perm.forward(int(x)) for x in xs]
    order_mod.use_compiled(jitdraws.feistel_many)
    assert perm.forward_many(xs).tolist() == want
    with pytest.raises(TypeError):
        jitdraws.feistel_many(xs.astype(np.float64), np.ones(2, np.uint64), np.uint64(5), np.uint64(31),
                              np.uint64(1000), np.zeros(len(xs), np.int64))
    refused = []

    def refuse(*args):
        refused.append(True)
        raise TypeError("not compiled")

    monkeypatch.setattr(order_mod, "_COMPILED", refuse)
    assert perm.forward_many(xs).tolist() == want and refused


class Broken(jit_mod.Kernel):
    """The real kernels with one result perturbed after them (what a wrong kernel would hand back)."""

    def __init__(self, real, what):
        self.__dict__.update(real.__dict__)
        self.calls, self.declined, self.what = 0, 0, what
        assemble, finish = self._assemble, self._finish

        def bad_assemble(*args):
            got = list(assemble(*args))
            if self.what == "owners" and len(got[5]) > 1:
                got[5] = got[5].copy()
                got[5][1] = got[5][0]
            return tuple(got)

        def bad_finish(block, nexts, marks, P, n, T):
            finish(block, nexts, marks[1:] if self.what == "labels" else marks, P, n, T)

        self._assemble, self._finish = bad_assemble, bad_finish


@pytest.mark.parametrize("what", ["labels", "owners"])
def test_a_broken_kernel_is_caught(kernel, what):
    with pytest.raises(AssertionError):
        fixed_cases(Broken(kernel, what))


@pytest.mark.slow  # (with the property it checks: the kernel's tests are in the slow tier, conftest.py)
def test_property_reaches_the_kernel():
    """The property above must reach the kernel (same module, after it)."""
    if not HITS["kernel"]:
        pytest.skip("the property test did not run in this session")
    assert HITS["kernel"] >= 40, HITS


def test_an_uncompiled_token_type_is_left_to_plan_step(kernel):
    """Compiling is off after the load: a dtype it was not compiled for is handed back (`kernel_refused`: the
    step is `Plan.step`'s), never compiled on the producer's path."""
    manifest = make_manifest([("a", [50, 40], "1", "repeat")], separator="eos", seq_len=16)
    spec = make_spec(lanes=2, global_batch=2, micro_batch=1, order="block", seed=1)

    class Int8Docs(MappedDocs):
        def _shard(self, s, o):
            off, toks, n = super()._shard(s, o)
            return off, (toks % 100).astype(np.int8), n

    plan = Plan(manifest, spec)
    before = kernel.calls
    got = fast_steps(plan, plan.initial_state(), Int8Docs(plan), [0, 1], 3, kernel)
    assert got == KERNEL_REFUSED and kernel.calls == before


def test_loader_off_never_loads():
    loader = jitload.KernelLoader("off")
    loader.start()
    assert loader.state == "off" and loader.kernel is None and loader.wait(0)
    assert loader.ended(0)  # (no load ever ran: the daemon's close has nothing to wait for)


def test_loader_without_numba_stays_on_plan_step_with_one_line(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "numba", None)  # what an install without the jit extra sees
    monkeypatch.delenv("NUMBA_CACHE_DIR")  # (the session's folder holds a module compiled ahead of time)
    loader = jitload.KernelLoader("auto", tmp_path / "jit")
    with caplog.at_level(logging.INFO, logger="sluice.loaderd"):
        loader.start()
        assert loader.wait(30)
        loader.start()  # a second start does nothing
    assert loader.ended(5)  # (the load's thread is over: a daemon's close waits for it, `DocSource.close`)
    assert loader.state == "failed" and loader.kernel is None
    assert loader.cause.startswith("ModuleNotFoundError") and "numba" in loader.cause
    lines = [r.getMessage() for r in caplog.records if "fused kernel" in r.getMessage()]
    assert len(lines) == 1 and "ModuleNotFoundError" in lines[0] and "\n" not in lines[0]


def test_loader_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="jit mode 'fast'"):
        jitload.KernelLoader("fast")


def test_every_kernel_module_is_in_the_marker_and_calls_only_its_own_kernels():
    """numba's cache checks only the file of the function it compiled: a kernel calling a kernel of another file
    would run that file's old code after an edit of it, and a kernel file the warm marker does not hash would
    leave an edited kernel to compile in the daemon's process. So every module that imports numba is one of
    `jitload.KERNEL_SOURCES`, and none imports another sluice module."""
    import ast
    from pathlib import Path

    logical = Path(jit_mod.__file__).resolve().parent
    kernels = []
    for path in sorted(logical.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if "numba" in names:
            kernels.append(path)
            assert not [m for m in names if m.startswith("sluice")], path
    assert tuple(kernels) == tuple(sorted(jitload.KERNEL_SOURCES))


def test_the_warm_marker_follows_numbas_cache_key_not_only_the_source_text(tmp_path):
    """numba's cache index is keyed by the source file's path and stamp: the same kernels installed elsewhere
    (another virtualenv or tree) or touched by a reinstall have a cold cache, so they must not find a marker
    that sends the load straight to an in-process compile (seconds of the daemon's GIL)."""
    import os
    import shutil

    pytest.importorskip("numba")
    a = tuple(tmp_path / "a" / p.name for p in jitload.KERNEL_SOURCES)
    b = tuple(tmp_path / "b" / p.name for p in jitload.KERNEL_SOURCES)
    for d in (a[0].parent, b[0].parent):
        d.mkdir()
    for src, pa, pb in zip(jitload.KERNEL_SOURCES, a, b):
        shutil.copy2(src, pa)
        shutil.copy2(src, pb)
    assert len(a) == 2 and jitload._marker_name(a) == jitload._marker_name(a)
    assert jitload._marker_name(a) != jitload._marker_name(b)  # same text, another place
    for touched in a:  # each kernel file: numba's cache keys every function on its own file
        before = jitload._marker_name(a)
        st = touched.stat()
        os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert jitload._marker_name(a) != before  # same text and place, touched


@pytest.mark.slow
def test_close_kills_a_cold_compile_child(tmp_path):
    """A daemon stopping while a cold cache compiles: `close` kills the child (it must not outlive the daemon
    by the seconds a compile takes), the load fails with its one line, no marker is written. Run in a fresh
    process: numba takes its cache directory once a process."""
    import json
    import os
    import subprocess

    code = (
        "import json, sys, time\n"
        "from sluice.loaderd.physical.jitload import KernelLoader\n"
        "loader = KernelLoader('auto', sys.argv[1])\n"
        "loader.start()\n"
        "t = time.monotonic() + 60\n"
        "while loader._child is None and time.monotonic() < t:\n"
        "    time.sleep(0.01)\n"
        "child = loader._child\n"
        "loader.close()\n"
        "loader.wait(30)\n"
        "print(json.dumps({'state': loader.state, 'cause': loader.cause, 'rc': child.wait(10)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "jit")], capture_output=True, text=True,
                         timeout=120, env=env)
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["state"] == "failed" and out["rc"] < 0, (out, got.stderr[-2000:])
    assert "compiling in a child failed" in out["cause"]
    assert not any(p.name.startswith("warm-") for p in (tmp_path / "jit").iterdir())
    assert "Traceback" not in got.stderr


def test_compiled_code_lives_in_the_users_cache_folder_else_under_the_node_cache(monkeypatch, tmp_path):
    """Compiled once per machine (a fresh node cache does not compile again); the operator's NUMBA_CACHE_DIR
    wins and makes nothing; a cache folder that cannot be made falls back to the node cache's."""
    fallback = tmp_path / "node-cache" / "jit"
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jitload.machine_cache_dir(fallback) == tmp_path / "xdg" / "sluice" / "jit"
    assert (tmp_path / "xdg" / "sluice" / "jit").is_dir()
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert jitload.machine_cache_dir(fallback) == fallback
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jitload.machine_cache_dir(fallback) == tmp_path / "mine"
    assert not (tmp_path / "mine").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(**mixture_given)
def test_mixtures_and_piece_draws_with_the_kernel_equal_plan_step(kernel, sources, policy, unit, algorithm, window,
                                                                  pieces, separator, loss_mask, seq_len, lanes,
                                                                  per_lane, order, seed, max_len, empty_every, resume,
                                                                  restores, n, subset):
    """test_logical_fused's mixture property with a loaded kernel handed in: calls the kernel covers (concat,
    best-fit) and those it does not (per-source packers: `Plan.step`'s) alike equal `Plan.step`, restores
    included."""
    plan, docs = mixture_case(sources, policy, unit, pieces, separator, loss_mask, seq_len, lanes, per_lane, order,
                              seed, max_len, empty_every, algorithm, window)
    check_mixture(plan, docs, resume, restores, n, subset, kernel=kernel)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(**mixture_given)
def test_mixtures_with_the_kernel_many_examples(kernel, sources, policy, unit, algorithm, window, pieces, separator,
                                                loss_mask, seq_len, lanes, per_lane, order, seed, max_len, empty_every,
                                                resume, restores, n, subset):
    """The property above over 400 random cases, each plan's calls following one another (the kept queues of
    `located.Carry` serve the next call and the ones after a restore)."""
    plan, docs = mixture_case(sources, policy, unit, pieces, separator, loss_mask, seq_len, lanes, per_lane, order,
                              seed, max_len, empty_every, algorithm, window)
    check_mixture(plan, docs, resume, restores, n, subset, kernel=kernel)


def test_a_mixture_that_narrows_to_one_source_stays_in_the_kernel(kernel):
    """Two sources until one renormalizes out: every call, before and after, walked and assembled in the kernel;
    every step `Plan.step`'s."""
    plan, docs = mixture_case([([60, 40], "1", "repeat"), ([6], "1", "renormalize")], "quota", "documents", None,
                              "eos", "all", 16, 2, 1, "block", 5, 40, 0)
    before = kernel.calls
    state, walked = plan.initial_state(), 0
    for _ in range(20):
        live = sum(c.active for c in state.lanes[0].sources)
        assert compare(plan, state, docs, [0, 1], 3, calls=1, kernel=kernel) == 1
        walked += live == 2
        state = LAST["state"]
    assert walked >= 1 and kernel.calls - before == 20


class BrokenMix(jit_mod.Kernel):
    """The real kernels with one result of the walk or the pieces' assembly perturbed after them."""

    def __init__(self, real, what):
        self.__dict__.update(real.__dict__)
        self.calls, self.declined, self.what = 0, 0, what
        walk_fn, assemble_fn = real.walk._fn, self._assemble

        def bad_walk(*args):
            got = walk_fn(*args)
            if what == "draws":
                args[-1][:, :, 0] += 1  # meta: every lane's draws after each step, one more
            if what == "open":
                args[-3][:, :, 7] += (args[-3][:, :, 7] > 0) * 5  # the pieces' ends, where a document stays open
            return got

        def bad_assemble(*args):
            got = list(assemble_fn(*args))
            if what == "cut":  # the cut pieces' targets written to each other's cells (sizes kept: gather and
                got[3] = np.roll(got[3], 1)  # finish write through them without bounds checks)
            if what == "positions":
                got[4] = got[4].copy()
                got[4][-1] += 1
            return tuple(got)

        self.walk = jit_mod._Walk.__new__(jit_mod._Walk)
        self.walk.__dict__.update(real.walk.__dict__, _fn=bad_walk, calls=0)
        self._assemble = bad_assemble


@pytest.mark.parametrize("what", ["draws", "open", "cut", "positions"])
def test_a_broken_walk_or_assembly_kernel_is_caught(kernel, what):
    """Mixtures with pieces of 3 (documents stay open, pieces are cut before their document's end): each
    perturbation of the kernels' results fails the comparison with `Plan.step`."""
    plan, docs = mixture_case([([40], "1", "repeat"), ([30], "2", "repeat")], "quota", "tokens", 3, "eos", "all",
                              16, 2, 1, "block", 5, 40, 0)
    with pytest.raises((AssertionError, InternalError)):  # (pieces that do not tile a lane: refused, not written)
        compare(plan, plan.initial_state(), docs, [0, 1], 3, calls=6, kernel=BrokenMix(kernel, what))


def test_mixture_calls_run_in_the_walk_and_assembly_kernels(kernel):
    """Five sources by tokens with pieces: every call walked and assembled in compiled code (none declined) and
    equal to `Plan.step`."""
    sources = [([40, 30], w, "repeat") for w in ("0.4", "0.2", "0.2", "0.1", "0.1")]
    plan, docs = mixture_case(sources, "quota", "tokens", 16, "eos", "exclude_separator", 16, 4, 2, "block", 9, 60,
                              0)
    walks, declined = kernel.walk.calls, kernel.declined
    assert compare(plan, plan.initial_state(), docs, [0, 1, 2, 3], 4, calls=10, kernel=kernel) == 10
    assert kernel.walk.calls - walks >= 10 and kernel.declined == declined


@pytest.mark.parametrize("policy,weights,lift", [
    ("quota", ("0.1234567", "0.8765433"), 1 << 20),  # weights ~2**23 times tokens ~2**43: past int64 in the kernel
    ("categorical", ("0.0000000001", "1"), 0),  # an active weight total over 2**32: the kernel's pick is not exact
])
def test_integers_past_the_kernels_range_are_left_to_plan_step(kernel, policy, weights, lift):
    """Where the mixture's exact integers would not fit the kernel's int64 arithmetic, the call is handed back
    before any walk (`kernel_refused`: `Plan.step` makes its step): realized tokens lifted to ~2**43 with
    weights over a 10**7 denominator, or categorical weights totalling over 2**32."""
    plan, docs = mixture_case([([40], weights[0], "repeat"), ([30], weights[1], "repeat")], policy, "tokens", 5,
                              "eos", "all", 16, 2, 1, "block", 3, 40, 0)
    state = plan.initial_state()
    for _ in range(2):
        _, state = plan.step(state, docs)
    d = json.loads(json.dumps(state.state_dict()))
    for lane in d["lanes"].values():
        for c, w in zip(lane["sources"], plan.weights):
            c[4] += w * lift  # (tokens; the deficits stay where they were)
    state = plan.load_state(d)
    walks = kernel.walk.calls
    assert fast_steps(plan, state, docs, [0, 1], 3, kernel) == KERNEL_REFUSED
    assert kernel.walk.calls == walks  # (nothing walked)


def test_kept_queues_serve_the_next_calls_and_a_restore(kernel, monkeypatch):
    """Five sources by tokens with pieces: a call reuses what the previous one located (`located.Carry`), so most
    calls locate nothing (integrate located every source every call: 5+ a call), and the kept queues of step 40
    serve a restore to step 0 byte for byte (they are checked by epoch and position, never trusted)."""
    plan, docs = five_sources_case()
    located = count_locates(monkeypatch)
    assert compare(plan, plan.initial_state(), docs, [0, 1, 2, 3], 4, calls=10, kernel=kernel) == 10
    assert located["n"] < 10 * 5 // 2
    assert compare(plan, plan.initial_state(), docs, [0, 1, 2, 3], 4, calls=3, kernel=kernel) == 3
