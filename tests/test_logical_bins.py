"""Best-fit in the compiled kernel (`fusedbins`: `jitdraws.walk_bins`, `jitrows.assemble_bins`) is `Plan.step`.

The kernel draws as concat's walk does, places every piece as
`packing.BestfitPacker` does, and reads each step's packer state (open bins,
pending rows) off its notes. Held here to `Plan.step` (and to the
per-document reference plan) byte for byte, rows, segments and states, over
random specs: 1-16 sources, every exhaustion rule, quota and categorical,
units by tokens, documents and sequences (one packer per source: a source
that runs out leaves its packer ended, carried as it is), piece draws,
windows 1-5, framings, loss
masks, lanes, restores through JSON between calls; documents hundreds of
times a row (whole-row chunks, the kernel's piece rows outgrown mid-draw);
and a perturbed kernel must fail the comparison.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logical_helpers import MappedDocs
from support import skip_unless_installed
from sluice.datastate import state_json
from sluice.errors import EndOfStream
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.fast import PACKED, fast_steps
from sluice.loaderd.logical.fused import StateTexts
from test_logical_fused import LAST, compare, mixture_case, plane_given, restored

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection

HITS = {"calls": 0}


@pytest.fixture(scope="module", params=["numba", "ahead-of-time"])
def kernel(request, jit_kernel):
    """The kernels as numba's dispatchers, then as the module compiled ahead of time: the same source."""
    import os

    from sluice.loaderd.logical import order as order_mod
    from sluice.loaderd.physical import jitload

    if request.param == "numba":
        yield jitload.load(None)
    else:
        yield request.getfixturevalue("aot_kernel") and jitload.load_ahead(os.environ["NUMBA_CACHE_DIR"])
    order_mod.use_compiled(None)  # (the load hands the orders its Feistel kernel: the next modules test numpy's)


def kernel_calls(kern, plan, state, docs, lanes, n, calls, reference=False) -> int:
    """`compare` with the kernel (every step `Plan.step`'s); the kernel's calls among them."""
    before = kern.calls
    oracle = Plan(plan.manifest, plan.spec, reference=True) if reference else None
    compare(plan, state, docs, lanes, n, calls=calls, reference=oracle, kernel=kern)
    got = kern.calls - before
    HITS["calls"] += got
    return got


weight = st.sampled_from(["1", "2", "0.5", "0.3", "3", "0"])
sources = st.lists(st.tuples(st.lists(st.integers(1, 30), min_size=1, max_size=3), weight,
                             st.sampled_from(["repeat", "repeat", "renormalize", "stop", "fail"])),
                   min_size=1, max_size=16).map(lambda v: [(v[0][0], "1", v[0][2]), *v[1:]])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(sources=sources, policy=st.sampled_from(["quota", "quota", "categorical"]),
       unit=st.sampled_from(["tokens", "tokens", "loss_tokens", "documents", "sequences"]), window=st.integers(1, 5),
       pieces=st.sampled_from([None, 1, 3, 16, 50]), **plane_given, empty_every=st.sampled_from([0, 0, 5]),
       restores=st.lists(st.integers(1, 3), min_size=1, max_size=3), n=st.integers(1, 5),
       subset=st.sampled_from(["all", "upper", "odd"]))
def test_bestfit_in_the_kernel_equals_plan_step(kernel, sources, policy, unit, window, pieces, separator, loss_mask,
                                                seq_len, lanes, per_lane, order, seed, resume, max_len, empty_every,
                                                restores, n, subset):
    plan, docs = mixture_case(sources, policy, unit, pieces, separator, loss_mask, seq_len, lanes, per_lane, order,
                              seed, max_len, empty_every, "bestfit", window)
    state = plan.initial_state()
    for _ in range(resume):
        try:
            _, state = plan.step(state, docs)
        except Exception:  # (a `stop` / `fail` source ended: nothing to compare)
            return
    mine = {"all": list(range(lanes)), "upper": list(range(lanes // 2, lanes)),
            "odd": [lane for lane in range(lanes) if lane % 2] or [0]}[subset]
    state = state.subset(mine)
    for calls in restores:
        kernel_calls(kernel, plan, state, docs, mine, n, calls, reference=resume % 3 == 0)
        if LAST["state"] is None:
            return
        plan, state = restored(plan, LAST["state"])
        docs = MappedDocs(plan, docs.fake_max, empty_every=docs.empty_every)


@pytest.mark.slow  # (with the property it checks: the kernel's tests are in the slow tier, conftest.py)
def test_the_property_reaches_the_kernel():
    """The property above must mostly run in the kernel (same module, after it)."""
    if not HITS["calls"]:
        pytest.skip("the property did not run in this session")
    assert HITS["calls"] >= 100, HITS


def outgrown(monkeypatch, kern) -> dict:
    """Count the walks of `kern` that stopped mid-call for more piece rows (WALK_FULL)."""
    seen = {"full": 0}
    real = kern.walk_bins._fn

    def walk(*args):
        got = real(*args)
        seen["full"] += got[0] == 3
        return got

    monkeypatch.setattr(kern.walk_bins, "_fn", walk)
    return seen


@pytest.mark.parametrize("separator", ["eos", "bos_eos", "none"])
def test_documents_far_longer_than_a_row_are_chunked_across_calls(kernel, separator):
    """Whole documents of up to 256 tokens in rows of 4 (up to 64 whole-row chunks from one draw), pending rows
    carried from call to call and through a restore."""
    plan, docs = mixture_case([([30], "1", "repeat"), ([20], "2", "repeat")], "quota", "tokens", None, separator,
                              "exclude_separator", 4, 2, 2, "block", 11, 256, 0, "bestfit", 3)
    plan.mean_framed_len = 1e9  # (the fewest piece rows a call starts with)
    assert kernel_calls(kernel, plan, plan.initial_state(), docs, [0, 1], 5, calls=8) == 8
    assert any(p["*"]["pending"] for ls in LAST["state"].state_dict()["lanes"].values() for p in [ls["packers"]])
    plan, state = restored(plan, LAST["state"])
    plan.mean_framed_len = 1e9
    assert kernel_calls(kernel, plan, state, MappedDocs(plan, 256), [0, 1], 3, calls=6) == 6


@pytest.mark.parametrize("unit,seed", [("documents", 1), ("sequences", 0), ("sequences", 1)])
def test_a_draw_that_outgrows_the_calls_piece_rows_is_placed_whole_before_a_row_is_served(monkeypatch, unit, seed):
    """A draw of up to 64 row-long chunks where the call's piece rows run out in the middle of it (WALK_FULL):
    the walk grows them and places the rest of that draw (its chunks, its remainder) before it serves a row, as
    `BestfitPacker.next_row` places a draw whole; every step's rows and state are `Plan.step`'s. Before, rows
    were served from the chunks placed so far, and a state could lack the rest of the draw (lost on a restore,
    or at the call's end). The kernel's source, uncompiled (the fast tier); the property holds the compiled."""
    from logical_helpers import fast_kernel

    outgrow_case(monkeypatch, fast_kernel(), unit, seed)


@pytest.mark.parametrize("unit,seed", [("documents", 1), ("sequences", 0)])
def test_the_compiled_kernels_place_an_outgrowing_draw_whole(monkeypatch, kernel, unit, seed):
    outgrow_case(monkeypatch, kernel, unit, seed)


def outgrow_case(monkeypatch, kern, unit: str, seed: int) -> None:
    seen = outgrown(monkeypatch, kern)
    plan, docs = mixture_case([([30], "1", "repeat"), ([20], "2", "repeat")], "quota", unit, None, "eos", "all", 4,
                              2, 8, "block", seed, 256, 0, "bestfit", 3)
    plan.mean_framed_len = 1e9
    assert kernel_calls(kern, plan, plan.initial_state(), docs, [0, 1], 5, calls=3) == 3
    assert seen["full"] >= 1


def test_the_benchs_mixture_runs_in_the_kernel(kernel):
    """Five sources by tokens, default piece draws (piece_tokens = seq_len), window 4: every call compiled."""
    plan, docs = mixture_case([([40, 30], w, "repeat") for w in ["0.4", "0.2", "0.2", "0.1", "0.1"]], "quota",
                              "tokens", 64, "eos", "all", 64, 4, 2, "global", 3, 150, 0, "bestfit", 4)
    assert kernel_calls(kernel, plan, plan.initial_state(), docs, list(range(4)), 8, calls=10) == 10


def test_the_states_are_the_bytes_plan_steps_json_gives(kernel):
    """Every step's state is written by the kernel as the JSON each entry sends (`jitrows.bins_texts`): the
    very bytes `state_json` gives for `Plan.step`'s state, open bins and pending rows included, on a call that
    continues the last one (its lanes not read) and on one after a restore."""
    plan, docs = mixture_case([([40, 30], "1", "repeat"), ([30], "0.5", "repeat")], "quota", "tokens", 7, "bos_eos",
                              "exclude_separator", 16, 3, 2, "global", 9, 60, 5, "bestfit", 3)
    state, ref = plan.initial_state(), plan.initial_state()
    for call in range(4):
        if call == 2:
            plan, state = restored(plan, state)
            docs = MappedDocs(plan, 60, empty_every=5)
        got = fast_steps(plan, state, docs, [0, 1, 2], 3, kernel)
        assert not isinstance(got, str) and isinstance(got.state_dicts, StateTexts)
        for j in range(3):
            _, ref = plan.step(ref, docs)
            assert got.state_dicts.texts[j] == state_json(ref.state_dict())
        state = got.states[-1]
    assert any(ls["packers"]["*"]["open"] for ls in state.state_dict()["lanes"].values())


def test_an_ended_packer_is_left_to_plan_step(kernel):
    """A state whose best-fit packer has ended (its stream's last rows pending): the kernel stands aside
    (`packed`), and `Plan.step` serves what is pending, then ends."""
    plan, docs = mixture_case([([30], "1", "repeat")], "quota", "tokens", None, "eos", "all", 16, 1, 1, "block", 5,
                              40, 0, "bestfit", 3)
    _, state = plan.step(plan.initial_state(), docs)
    d = json.loads(json.dumps(state.state_dict()))
    d["lanes"]["0"]["packers"]["*"]["ended"] = True
    state = plan.load_state(d)
    assert fast_steps(plan, state, docs, [0], 2, kernel) == PACKED
    with pytest.raises(EndOfStream):
        for _ in range(10):
            _, state = plan.step(state, docs, [0])


class Perturbed:
    """The real kernel with one best-fit result changed after it (what a wrong kernel would hand back)."""

    def __init__(self, real, what: str) -> None:
        self._real, self.what = real, what

    def __getattr__(self, name):
        return getattr(self._real, name)

    def assemble_bins(self, *args):
        got = self._real.assemble_bins(*args)
        if got is NotImplemented:
            return got
        block = got[0]
        if self.what == "label":
            block[0, 1, 0, 0] += 1
        else:  # two rows of the first step swapped
            block[0, :, [0, 1]] = block[0, :, [1, 0]]
        return got


@pytest.mark.parametrize("what", ["label", "rows"])
def test_a_perturbed_kernel_fails_the_comparison(kernel, what):
    plan, docs = mixture_case([([30], "1", "repeat"), ([20], "2", "repeat")], "quota", "documents", None, "eos",
                              "all", 16, 2, 1, "block", 7, 40, 0, "bestfit", 3)
    with pytest.raises(AssertionError):
        kernel_calls(Perturbed(kernel, what), plan, plan.initial_state(), docs, [0, 1], 3, calls=4)


@pytest.mark.parametrize("where", ["past its document", "an ended stream"])
def test_a_bestfit_state_the_kernel_does_not_continue_is_left_to_plan_step(where):
    """A state that loads (inside every bound `check_bounds` knows) but that no plan of these documents makes:
    an open bin's piece past its document's end (the bound is the longest document, not this one), or a packer
    whose stream ended. The kernel's source (uncompiled: the fast tier) stands aside, `packed`, before it reads
    a token; `Plan.step` then meets the state."""
    from logical_helpers import fast_kernel

    plan, docs = mixture_case([([30], "1", "repeat"), ([20], "2", "repeat")], "quota", "documents", None, "eos",
                              "all", 16, 2, 1, "block", 7, 40, 0, "bestfit", 3)
    state = plan.initial_state()
    for _ in range(3):
        _, state = plan.step(state, docs)
    d = json.loads(json.dumps(state.state_dict()))
    lane = d["lanes"]["0"]["packers"]["*"]
    if where == "past its document":
        s, e, idx = lane["open"][0][0][:3]
        length = int(docs.fake(plan.ref(s, e, idx)).size) + 1  # (framed: one eos)
        lane["open"][0][0] = [s, e, idx, length, length + 1]
    else:
        lane["ended"] = True
    bad = plan.load_state(d)
    assert fast_steps(plan, bad, docs, [0, 1], 2, fast_kernel()) == PACKED
