"""The producer's entries from the compiled kernel equal `produce_step`'s (`Plan.step`'s), call after call.

Specification: with the fast path's kernel loaded, `StepMaker.produce_steps` /
`produce_run` give, for every step, the entry `produce_step` makes: the
micro-batches byte for byte, the sample IDs (made when first read:
`StepEntry.samples` from a `LazySamples`), the state (dict and JSON bytes),
the tokens per source, the byte count; and the states after them. A call
continuing the very state object the last call returned starts from where the
kernel left its lanes (`located.Ended`; best-fit's `fusedbins.Held`, per-source
packers' `fusedseqs.Residuals`), so this holds, for concat, best-fit and a
concat packer per source (unit `sequences`), along a stream of calls,
after a state that did not come from the last call (a RESTORE: the state
through JSON), after a call made again because its reads changed
(`DocSource.check_reads` False once), and with one or several steps a call.
The kernel's tests are in the slow tier (conftest.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from logical_helpers import MappedDocs, make_manifest, make_spec

from sluice.loaderd.logical import Plan
from sluice.loaderd.physical.producer import StepMaker
from sluice.loaderd.physical.stepqueue import LazySamples, StepEntry

SOURCES = {
    "one source": [("a", [50, 40, 60], "1", "repeat")],
    "five sources by tokens": [(f"s{i}", [30, 25], w, "repeat") for i, w in enumerate(["0.4", "0.2", "0.2", "0.1",
                                                                                          "0.1"])],
}


PACKING = {"concat": ("concat", "tokens"), "bestfit": ("bestfit", "tokens"), "sequences": ("concat", "sequences")}


def manifest_of(sources: list, packing: str):
    algorithm, unit = PACKING[packing]
    return make_manifest(sources, seq_len=32, unit=unit, piece_tokens=32 if unit == "tokens" else None,
                         algorithm=algorithm)


class FlakyDocs(MappedDocs):
    """Mapped documents whose `check_reads` says False every `every`-th call (a cached file changed while the
    producer read it: the call is made again from the same state)."""

    def __init__(self, plan, max_len: int, every: int) -> None:
        super().__init__(plan, max_len)
        self.every, self.checks = every, 0

    def check_reads(self) -> bool:
        self.checks += 1
        return self.checks % self.every != 0


class DoneDocs(MappedDocs):
    """Every object's tokens mapped (a warmed pre-tokenized corpus): the producer announces nothing."""

    def all_done(self) -> bool:
        return True


def view(e: StepEntry) -> tuple:
    return (e.step, [{k: v.tobytes() for k, v in m.items()} for m in e.micros], e.samples, e.state, e.state_json,
            e.nbytes, e.error, e.source_tokens)


@pytest.mark.parametrize("algorithm", sorted(PACKING))
@pytest.mark.parametrize("micro_batch", [8, 2])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_entries_equal_single_steps_along_calls_restores_and_retries(jit_kernel, name, micro_batch, algorithm):
    manifest = manifest_of(SOURCES[name], algorithm)
    spec = make_spec(lanes=8, global_batch=8, micro_batch=micro_batch, order="block", seed=3)
    plan = Plan(manifest, spec)
    single = StepMaker(Plan(manifest, spec), MappedDocs(plan, 60), replica=0, replicas=1)
    steps = 90
    want, wstates, state = [], [], single.plan.initial_state()
    for _ in range(steps):
        e, state = single.produce_step(state)
        want.append(view(e))
        wstates.append(state)
    docs = FlakyDocs(plan, 60, every=7)
    maker = StepMaker(plan, docs, replica=0, replicas=1)
    maker.jit = SimpleNamespace(kernel=jit_kernel)  # (a loaded `KernelLoader`'s face)
    before = jit_kernel.calls
    got, state, sizes, call = [], plan.initial_state(), [1, 4, 1, 1, 3, 4, 2], 0
    while len(got) < steps:
        n = sizes[call % len(sizes)]
        call += 1
        if call % 9 == 0:  # a RESTORE: the same state, not the object the last call returned
            state = plan.load_state(json.loads(json.dumps(state.state_dict())))
        if call % 2:
            entries, state = maker.produce_run(state, n)
        else:
            made = maker.produce_steps(state, n)
            entries = [e for e, _ in made]
            for j, (_, after) in enumerate(made):
                assert after == wstates[len(got) + j]
            state = made[-1][1]
        assert state == wstates[len(got) + len(entries) - 1]
        got += [view(e) for e in entries]
    assert got[:steps] == want
    assert jit_kernel.calls - before >= call // 2  # (the kernel made most calls' steps)


def test_lazy_sample_ids_are_made_once_when_first_read():
    made = []

    def make() -> list[list[str]]:
        made.append(1)
        return [["a:0", "b:1"]]

    e = StepEntry(step=3, micros=[], samples=LazySamples(make), state=None, nbytes=0, created=0.0)
    assert not made
    assert e == StepEntry(step=3, micros=[], samples=[["a:0", "b:1"]], state=None, nbytes=0, created=0.0)
    assert e.samples == [["a:0", "b:1"]] and e.samples_json(0) == b'["a:0","b:1"]' and len(made) == 1


@pytest.mark.parametrize("algorithm", sorted(PACKING))
def test_a_stream_of_kernel_calls_never_makes_its_states_lanes(jit_kernel, algorithm):
    """The state a call returns (`FusedSteps.state`) makes its lanes only when read: the next call continues
    from where the kernel left them (`located.Ended`, best-fit's `fusedbins.Held`) and never reads them; read,
    they are `Plan.step`'s."""
    manifest = manifest_of(SOURCES["five sources by tokens"], algorithm)
    spec = make_spec(lanes=4, global_batch=4, micro_batch=4, order="block", seed=5)
    plan, ref = Plan(manifest, spec), Plan(manifest, spec)
    maker = StepMaker(plan, DoneDocs(plan, 60), replica=0, replicas=1)
    maker.jit = SimpleNamespace(kernel=jit_kernel)
    state, made, returned = plan.initial_state(), 0, []
    before = jit_kernel.calls
    while made < 40:
        entries, state = maker.produce_run(state, 4)
        made += len(entries)
        returned.append(state)
    assert jit_kernel.calls - before >= 5
    # (made neither by the call that returned the state nor by the next call, which continued from it)
    assert sum("lanes" in s.__dict__ for s in returned[2:]) == 0
    want, docs = ref.initial_state(), MappedDocs(ref, 60)
    for _ in range(made):
        _, want = ref.step(want, docs)
    assert state == want and want == state and state.state_dict() == want.state_dict()
