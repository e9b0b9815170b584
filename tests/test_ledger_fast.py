"""`sluice ledger`'s walk to a step (`plan_cli.advance`): the fast path's calls where a kernel is loaded, else
`Plan.step`; either way the state after each asked step is `Plan.step`'s, and the stream ends (EndOfStream) where
`Plan.step` ends it. The kernel here is the kernels' source run uncompiled (the compiled one is held to it in the
slow tier)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from logical_helpers import MappedDocs, make_manifest, make_spec

from sluice.errors import EndOfStream
from sluice.loaderd.logical import Plan, fast
from sluice.loaderd.plan_cli import advance
from test_logical_fused import UNCOMPILED

SOURCES = [("a", [30, 20], "3", "repeat"), ("b", [15, 25], "2", "repeat"), ("c", [20], "1", "repeat")]


def reference(plan: Plan, docs, stops: list[int]):
    """The states after each of `stops` by `Plan.step` one step at a time; the message where the stream ended."""
    state, got = plan.initial_state(), []
    try:
        for stop in stops:
            while state.step < stop:
                _, state = plan.step(state, docs)
            got.append(state)
    except EndOfStream as exc:
        return got, str(exc)
    return got, None


def walked(plan: Plan, docs, stops: list[int], loader):
    state, got = plan.initial_state(), []
    try:
        for stop in stops:
            state = advance(plan, docs, state, stop, loader)
            got.append(state)
    except EndOfStream as exc:
        return got, str(exc)
    return got, None


@settings(max_examples=25, deadline=None)
@given(algorithm=st.sampled_from(["concat", "bestfit"]), rule=st.sampled_from(["repeat", "stop"]),
       gaps=st.lists(st.integers(1, 40), min_size=1, max_size=4), max_steps=st.sampled_from([0, 50]))
def test_the_fast_walk_gives_plan_steps_states_and_end(algorithm, rule, gaps, max_steps):
    pytest.importorskip("numba")
    sources = [(n, c, w, rule if n == "c" else r) for n, c, w, r in SOURCES]
    manifest = make_manifest(sources, seq_len=16, unit="tokens", piece_tokens=16, algorithm=algorithm)
    spec = make_spec(lanes=2, global_batch=4, micro_batch=2, order="block", **({"max_steps": max_steps} if max_steps
                                                                                 else {}))
    stops = [sum(gaps[:i + 1]) - 1 for i in range(len(gaps))]
    want = reference(Plan(manifest, spec), MappedDocs(Plan(manifest, spec), 30), stops)
    fast_plan = Plan(manifest, spec)
    calls = []

    def arriving():
        calls.append(1)
        return UNCOMPILED

    served = []
    real = fast.fast_steps

    def counted(*a):
        made = real(*a)
        served.append(0 if isinstance(made, str) else len(made.state_dicts))
        return made

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast, "fast_steps", counted)
        got = walked(fast_plan, MappedDocs(fast_plan, 30), stops, SimpleNamespace(arriving=arriving))
    assert [s.state_dict() for s in got[0]] == [s.state_dict() for s in want[0]]
    assert got[1] == want[1]
    assert calls  # (the kernel was asked for)
    if sum(gaps) > 8 and not (max_steps and want[1]):
        assert max(served) > 1  # (calls of several steps: the fast path served, not only `Plan.step`)


def test_without_a_loader_every_step_is_plan_steps():
    manifest = make_manifest(SOURCES, seq_len=16, unit="tokens", piece_tokens=16)
    spec = make_spec(lanes=2, global_batch=4, micro_batch=2, order="block")
    want = reference(Plan(manifest, spec), MappedDocs(Plan(manifest, spec), 30), [9, 30])
    plan = Plan(manifest, spec)
    got = walked(plan, MappedDocs(plan, 30), [9, 30], None)
    assert [s.state_dict() for s in got[0]] == [s.state_dict() for s in want[0]] and got[1] is None


class _Loader:
    """A `KernelLoader`'s face for `_kernel_loader`: whether the module compiled ahead of time is here, and
    whether its load was started."""

    def __init__(self, ready: bool) -> None:
        self._ready, self.started = ready, False

    def ready(self) -> bool:
        return self._ready

    def start(self, why: str = "") -> None:
        self.started = True


@pytest.mark.parametrize(("ready", "steps", "loads"), [
    (True, 5, True),  # (the module compiled ahead of time: a millisecond to load, worth it for any ledger)
    (False, 5, False),  # (numba's compile would cost more than the steps save)
    (False, 2047, False),
    (False, 2048, True),  # (the daemon's START_AFTER_STEPS: the compile pays back)
])
def test_the_ledger_loads_the_kernel_where_it_pays(ready, steps, loads):
    from sluice.loaderd.plan_cli import _kernel_loader

    loader = _Loader(ready)
    got = _kernel_loader(SimpleNamespace(jit=loader), steps)
    assert (got is loader, loader.started) == (loads, loads)
    assert _kernel_loader(SimpleNamespace(jit=None), steps) is None


@settings(max_examples=25, deadline=None)
@given(algorithm=st.sampled_from(["concat", "bestfit"]), lanes=st.sampled_from([1, 2, 4]),
       source=st.integers(0, 2), index=st.integers(0, 14), epochs=st.integers(1, 4),
       max_steps=st.sampled_from([40, 400]), per_call=st.sampled_from([2, 7, 256]))
def test_whence_steps_with_the_fast_path_are_plan_steps(algorithm, lanes, source, index, epochs, max_steps,
                                                        per_call):
    """`first_steps` (`sluice whence`): the step of a sample's first segment in each epoch whose lane share holds
    it, with calls of the fast path while the lane has not taken it, equals the walk by `Plan.step` alone."""
    pytest.importorskip("numba")
    from sluice.loaderd import plan_cli
    from sluice.loaderd.plan_cli import first_steps

    manifest = make_manifest(SOURCES, seq_len=16, unit="tokens", piece_tokens=16, algorithm=algorithm)
    spec = make_spec(lanes=lanes, global_batch=2 * lanes, micro_batch=lanes, order="block")
    plan = Plan(manifest, spec)
    sample = plan.ref(source, 0, index).sample_id
    draws = {}
    for epoch in range(epochs):
        position = plan.order(source, epoch).position_of(index)
        draws.setdefault(position % lanes, []).append((epoch, position // lanes))
    asked = []

    def arriving():
        asked.append(1)
        return UNCOMPILED

    for lane, wanted in sorted(draws.items()):
        want = first_steps(plan, MappedDocs(plan, 30), lane, source, sample, wanted, max_steps)
        fast_plan = Plan(manifest, spec)
        made = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_cli, "WHENCE_STEPS", per_call)
            got = first_steps(fast_plan, MappedDocs(fast_plan, 30), lane, source, sample, wanted, max_steps,
                              SimpleNamespace(arriving=arriving), made.append)
        assert got == want
        if algorithm == "concat" and want[0] is not None and want[0] >= 2:
            # (the steps before the drawing one came in calls of the fast path; concat serves a drawn
            # document's first tokens in the step that draws it)
            assert max(made) > 1
    assert asked


@pytest.mark.parametrize("ready", [True, False])
def test_whence_starts_numbas_compile_only_once_the_walk_is_long(ready):
    """`sluice whence` does not know its walk's length before the sample shows up: the module compiled ahead of
    time is loaded at once, numba's compile only once the walk has made `START_AFTER_STEPS` steps."""
    from sluice.loaderd.physical.jitstart import START_AFTER_STEPS
    from sluice.loaderd.plan_cli import _WalkLoader

    loader, told = _Loader(ready), []
    walk = _WalkLoader(SimpleNamespace(jit=loader), told.append)
    assert loader.started == ready
    walk.made(START_AFTER_STEPS - 1)
    loader.arriving = lambda: "kernel"
    assert walk.arriving() == ("kernel" if ready else None) and loader.started == ready
    walk.made(1)
    assert walk.arriving() == "kernel" and loader.started and told == [START_AFTER_STEPS - 1, 1]
