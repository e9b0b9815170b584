"""One concat packer per source in the compiled kernel (`fusedseqs`: `jitdraws.walk_seqs`) is `Plan.step`.

With mixture unit `sequences` each row is one draw: a source picked by
quota over rows (or categorically), whose own packer fills the row from its
residual and its next documents. Held here to `Plan.step` (and to the
per-document reference plan) byte for byte, rows, segments and states, over
random specs: 1-16 sources, every exhaustion rule (a source ending mid-row
drops the row's pieces), quota and categorical, framings, loss masks, lanes,
restores through JSON between calls, documents many rows long (residuals
carried across calls); and a perturbed kernel must fail the comparison.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logical_helpers import MappedDocs, fast_kernel
from support import skip_unless_installed
from sluice.datastate import state_json
from sluice.errors import StateError
from sluice.loaderd.logical.fast import PACKED, fast_steps
from sluice.loaderd.logical.fused import StateTexts
from test_logical_bins import kernel, kernel_calls, sources  # noqa: F401 (the kernels' fixture)
from test_logical_fused import HITS as CALLS
from test_logical_fused import LAST, compare, mixture_case, plane_given, restored

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection

HITS = {"calls": 0, "missed": 0}


def seqs_case(srcs, policy="quota", separator="eos", loss_mask="all", seq_len=16, lanes=2, per_lane=1, order="block",
              seed=7, max_len=40, empty_every=0, algorithm="concat", window=4):
    return mixture_case(srcs, policy, "sequences", None, separator, loss_mask, seq_len, lanes, per_lane, order, seed,
                        max_len, empty_every, algorithm, window)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(sources=sources, policy=st.sampled_from(["quota", "quota", "categorical"]), **plane_given,
       empty_every=st.sampled_from([0, 0, 5]), restores=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       n=st.integers(1, 5), subset=st.sampled_from(["all", "upper", "odd"]))
def test_per_source_concat_in_the_kernel_equals_plan_step(kernel, sources, policy, separator, loss_mask, seq_len,  # noqa: F811
                                                          lanes, per_lane, order, seed, resume, max_len, empty_every,
                                                          restores, n, subset):
    plan, docs = seqs_case(sources, policy, separator, loss_mask, seq_len, lanes, per_lane, order, seed, max_len,
                           empty_every)
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
        missed = CALLS["miss"]
        HITS["calls"] += kernel_calls(kernel, plan, state, docs, mine, n, calls, reference=resume % 3 == 0)
        HITS["missed"] += CALLS["miss"] - missed
        if LAST["state"] is None:
            return
        plan, state = restored(plan, LAST["state"])
        docs = MappedDocs(plan, docs.fake_max, empty_every=docs.empty_every)


@pytest.mark.slow  # (with the property it checks)
def test_the_property_reaches_the_kernel():
    """The property above must mostly run in the kernel (same module, after it): its other calls are those of
    streams that end (`stop` / `fail` sources, every source exhausted), `Plan.step`'s."""
    if not HITS["calls"] + HITS["missed"]:
        pytest.skip("the property did not run in this session")
    assert HITS["calls"] >= 40 and HITS["calls"] >= 2 * HITS["missed"], HITS


@pytest.mark.parametrize("separator", ["eos", "bos_eos", "none"])
def test_documents_many_rows_long_leave_residuals_across_calls_and_a_restore(kernel, separator):  # noqa: F811
    """Documents of up to 300 tokens in rows of 8: a source's residual lives on across rows of other sources,
    calls and a restore, every call compiled."""
    plan, docs = seqs_case([([30], "1", "repeat"), ([20], "2", "repeat"), ([9], "0.5", "repeat")],
                           separator=separator, seq_len=8, lanes=2, per_lane=2, max_len=300)
    assert kernel_calls(kernel, plan, plan.initial_state(), docs, [0, 1], 5, calls=6) == 6
    held = [p for ls in LAST["state"].state_dict()["lanes"].values() for p in ls["packers"].values() if p["cur"]]
    assert len(held) >= 2, held
    plan, state = restored(plan, LAST["state"])
    assert kernel_calls(kernel, plan, state, MappedDocs(plan, 300), [0, 1], 3, calls=4) == 4


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_a_producer_of_one_lane_runs_in_the_kernel(kernel, algorithm):  # noqa: F811
    """One lane (a replica's producer where every replica has one lane): every call compiled, none declined (a
    read-only argument, which numba's compiled signatures do not take, once sent these to `Plan.step`)."""
    plan, docs = seqs_case([([30], "1", "repeat"), ([20], "2", "repeat")], lanes=1, per_lane=2,
                           algorithm=algorithm)
    declined = kernel.declined
    assert kernel_calls(kernel, plan, plan.initial_state(), docs, [0], 4, calls=5) == 5
    assert kernel.declined == declined


def test_a_source_ending_mid_row_drops_the_row_and_the_stream_ends_as_plan_steps(kernel):  # noqa: F811
    """Sources under `renormalize` with small shares: rows in progress are dropped where a source runs out (the
    kernel's walk rewinds them), then every source ends and `Plan.step` ends the stream."""
    plan, docs = seqs_case([([6], "1", "renormalize"), ([4], "2", "renormalize")], seq_len=16, lanes=2,
                           max_len=30)
    got = kernel_calls(kernel, plan, plan.initial_state(), docs, [0, 1], 2, calls=20)
    assert got >= 1 and LAST["state"] is None


def test_the_states_are_the_bytes_plan_steps_json_gives(kernel):  # noqa: F811
    """Every step's state is written by the kernel (`jitrows.seqs_texts`): the very bytes `state_json` gives for
    `Plan.step`'s state, twelve sources (their packers' keys sorted as strings: "10" before "2"), on a call
    that continues the last one and on one after a restore."""
    plan, docs = seqs_case([([12], "1", "repeat")] * 12, policy="categorical", separator="bos_eos",
                           loss_mask="exclude_separator", seq_len=16, lanes=3, max_len=60, empty_every=5)
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
    assert any(p["cur"] for ls in state.state_dict()["lanes"].values() for p in ls["packers"].values())


class Perturbed:
    """The real kernel with one result changed after it (what a wrong kernel would hand back)."""

    def __init__(self, real, what: str) -> None:
        self._real, self.what = real, what

    def __getattr__(self, name):
        return getattr(self._real, name)

    def assemble_bins(self, *args):
        got = self._real.assemble_bins(*args)
        if got is not NotImplemented and self.what == "rows":
            got[0][0, :, [0, 1]] = got[0][0, :, [1, 0]]  # two rows of the first step swapped
        return got

    def seqs_texts(self, *args):
        got = self._real.seqs_texts(*args)
        if got is not NotImplemented and self.what == "state":
            got[0] = got[0].replace(b'"rows":', b'"rows":1', 1)
        return got


@pytest.mark.parametrize("what", ["rows", "state"])
def test_a_perturbed_kernel_fails_the_comparison(kernel, what):  # noqa: F811
    plan, docs = seqs_case([([30], "1", "repeat"), ([20], "2", "repeat")], lanes=2)
    with pytest.raises(AssertionError):
        kernel_calls(Perturbed(kernel, what), plan, plan.initial_state(), docs, [0, 1], 3, calls=4)


@pytest.mark.parametrize("where", ["past its document", "another source's", "not a pointer"])
def test_a_residual_the_kernel_does_not_continue_is_left_to_plan_step(where):
    """A state that loads (inside every bound `check_bounds` knows) but that no plan of these documents makes: a
    residual past its document's end (the bound is the longest document, not this one), or one held by another
    source's packer. The kernel's source (uncompiled: the fast tier) stands aside, `packed`, before it reads a
    token; `Plan.step` then meets the state (a residual that is not five integers: its packer names it)."""
    plan, docs = seqs_case([([30], "1", "repeat"), ([20], "2", "repeat")], lanes=2, max_len=60)
    state = plan.initial_state()
    for _ in range(3):
        _, state = plan.step(state, docs)
    d = json.loads(json.dumps(state.state_dict()))
    packers = d["lanes"]["0"]["packers"]
    key = next(k for k, p in packers.items() if p["cur"])
    s, e, idx = packers[key]["cur"][:3]
    if where == "past its document":
        length = int(docs.fake(plan.ref(s, e, idx)).size) + 1  # (framed: one eos)
        packers[key]["cur"] = [s, e, idx, length, length + 1]
    elif where == "another source's":
        packers[str(1 - int(key))]["cur"] = packers[key]["cur"]
    else:
        packers[key]["cur"] = [s, e, idx, "0", 3]
    bad = plan.load_state(d)
    assert fast_steps(plan, bad, docs, [0, 1], 2, fast_kernel()) == PACKED
    if where == "not a pointer":
        with pytest.raises(StateError, match=rf"lane 0 packer {key}: concat residual .* is not \[source"):
            plan.step(bad, docs)


@pytest.mark.parametrize("window", [1, 3])
def test_best_fit_with_a_packer_per_source_runs_in_the_kernel_past_a_source_that_ends(kernel, window):  # noqa: F811
    """One best-fit packer per source (`fusedbins` with a packer a source): each row picks its source, whose
    packer pulls that source's documents while no row is pending. A source under `renormalize` runs out: that
    call is `Plan.step`'s (the packer flushes its open bins and ends), and the kernel then serves the flushed
    rows and carries the ended packer in every later state, through a restore."""
    plan, docs = seqs_case([([12], "1", "renormalize"), ([40, 30], "2", "repeat"), ([25], "0.5", "repeat")],
                           seq_len=16, lanes=2, per_lane=2, max_len=30, algorithm="bestfit", window=window)
    got = kernel_calls(kernel, plan, plan.initial_state(), docs, [0, 1], 3, calls=12)
    assert got >= 8 and LAST["state"] is not None
    lanes = LAST["state"].state_dict()["lanes"].values()
    assert any(ls["packers"]["0"]["ended"] for ls in lanes), [ls["packers"]["0"] for ls in lanes]
    plan, state = restored(plan, LAST["state"])
    assert kernel_calls(kernel, plan, state, MappedDocs(plan, 30), [0, 1], 3, calls=4) == 4
    lanes = LAST["state"].state_dict()["lanes"].values()
    assert all(not ls["packers"]["0"]["pending"] for ls in lanes)  # (its flushed rows all served)


def test_a_source_that_runs_out_has_its_best_fit_rows_served_before_it_leaves():
    """`Plan.step`, one best-fit packer per source: where a `renormalize` source runs out, its packer flushes its
    open bins; the source stays pickable until they are all served, so every document drawn from it is in a
    served row (none left pending in the state, counted as drawn and never sent). The kernel's source
    (uncompiled) serves the same rows."""
    plan, docs = seqs_case([([12], "1", "renormalize"), ([40, 30], "2", "repeat")], seq_len=16, lanes=1,
                           per_lane=2, max_len=30, algorithm="bestfit", window=3)
    state, served, ended_at = plan.initial_state(), set(), None
    for step in range(30):
        batch, state = plan.step(state, docs)
        served |= {sid for rows in batch.rows.values() for r in rows for sid, _, _ in r.segments}
        packer = state.state_dict()["lanes"]["0"]["packers"]["0"]
        if packer.get("ended") and ended_at is None:
            ended_at = step
            assert packer["pending"], "the case must flush more than the row it serves"
    assert ended_at is not None and not packer["pending"]
    cursor = state.lanes[0].sources[0]
    drawn = {plan.ref(0, 0, plan.lane_sample(0, 0, 0, t)).sample_id for t in range(cursor.taken)}
    assert drawn <= served, sorted(drawn - served)
    compare(plan, plan.initial_state(), docs, [0], 3, calls=8)
