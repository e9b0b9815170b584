"""Save/load conformance of every resumable stage of the logical plane.

As torchdata's `run_test_save_load_state` does for its nodes: for each packer
(concat, best-fit), through `Plan.step` and through the fast path
(`fast.fast_steps`), the state is saved at three telling points, carried
through JSON as a checkpoint carries it, loaded into a fresh `Plan`, and the
rest of the stream must equal the uninterrupted one:

* the middle of the stream (packer residuals open),
* the first step after an epoch boundary of a source (a new permutation),
* the end: the last step before the stream stops, after which the restored
  plan must end exactly as the uninterrupted one did,
* with piece draws (unit tokens, `mixture.piece_tokens`): a step after which
  a source's document is open (only some of its pieces drawn).
"""

from __future__ import annotations

import json

import pytest

from logical_helpers import fake_docs, fast_kernel, make_manifest, make_spec

from sluice.errors import EndOfStream
from sluice.loaderd.logical import Plan, StepBatch, micro_batches_digest

# "a" repeats (epoch boundaries), "b" stops (the stream has an end)
SOURCES = [("a", [9, 5], "0.6", "repeat"), ("b", [40, 23], "0.4", "stop")]


def stream(plan: Plan, state, docs) -> tuple[list[str], list, bool]:
    """Digests of every step until the end (or 400 steps), the state after each, and whether it ended."""
    digests, states = [], []
    for _ in range(400):
        try:
            batch, state = plan.step(state, docs)
        except EndOfStream:
            return digests, states, True
        digests.append(micro_batches_digest(plan.replica_micro_batches(batch, 1, 0)))
        states.append(state)
    return digests, states, False


@pytest.mark.parametrize("pieces", [None, 5], ids=["whole-documents", "piece-draws"])
@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_save_load_at_the_middle_an_epoch_boundary_and_the_end(algorithm, pieces):
    unit = "tokens" if pieces else "documents"
    manifest = make_manifest(SOURCES, algorithm=algorithm, unit=unit, piece_tokens=pieces)
    spec, docs = make_spec(lanes=2, global_batch=4), fake_docs()
    plan = Plan(manifest, spec)
    full, states, ended = stream(plan, plan.initial_state(), docs)
    assert ended and len(full) > 6, "the fixture must have an end and some length"
    boundary = next(k for k, s in enumerate(states) if any(lane.sources[0].epoch > 0 for lane in s.lanes.values()))
    points = {"middle": len(full) // 2, "epoch boundary": boundary, "end": len(full) - 1}
    assert 0 < boundary < len(full) - 1
    if pieces:
        opened = [k for k, s in enumerate(states) if any(c.open for lane in s.lanes.values() for c in lane.sources)]
        assert len(opened) > 3, "piece draws must leave documents open at some steps"
        points["open document"] = opened[len(opened) // 2]
    for name, k in points.items():
        saved = json.loads(json.dumps(states[k].state_dict()))
        fresh = Plan(manifest, spec)  # nothing cached from the first run
        rest, _, rest_ended = stream(fresh, fresh.load_state(saved), docs)
        assert rest == full[k + 1 :], f"{algorithm}: resumed after step {k} ({name}) differs"
        assert rest_ended, f"{algorithm}: resumed after step {k} ({name}) did not end where the stream ends"


def fused_stream(plan: Plan, state, docs, n: int = 3) -> tuple[list[str], list, bool]:
    """`stream` through the fast path, `n` steps a call (one `Plan.step` where it stands aside, which is where
    the stream ends)."""
    from sluice.loaderd.logical import fast

    digests, states = [], []
    lanes = list(range(plan.spec.lanes))
    while len(digests) < 400:
        got = fast.fast_steps(plan, state, docs, lanes, n, fast_kernel())
        if isinstance(got, str):
            try:
                batch, state = plan.step(state, docs)
            except EndOfStream:
                return digests, states, True
            made = [(batch, state)]
        else:
            made = [(StepBatch(after.step, got.rows(j)), after) for j, after in enumerate(got.states)]
        for batch, state in made:
            digests.append(micro_batches_digest(plan.replica_micro_batches(batch, 1, 0)))
            states.append(state)
    return digests, states, False


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
@pytest.mark.parametrize("pieces", [None, 5], ids=["whole-documents", "piece-draws"])
def test_save_load_through_the_fused_path_equals_the_reference_stream(pieces, algorithm):
    """The two-source mixture above on the fast path (mapped shards; `fusedmix` / `fusedbins` walk its draws in
    the kernels' source), saved and loaded at the same points: the stream, uninterrupted or resumed, is
    `Plan.step`'s, byte for byte, to its end."""
    from logical_helpers import MappedDocs

    from sluice.loaderd.logical import fast

    unit = "tokens" if pieces else "documents"
    manifest = make_manifest(SOURCES, unit=unit, piece_tokens=pieces, algorithm=algorithm)
    spec = make_spec(lanes=2, global_batch=4)
    plan = Plan(manifest, spec)
    docs = MappedDocs(plan)
    want, states, ended = stream(Plan(manifest, spec, reference=True), plan.initial_state(), MappedDocs(plan))
    calls = []
    real = fast.fast_steps
    try:
        fast.fast_steps = lambda *a: calls.append(real(*a)) or calls[-1]
        full, _, full_ended = fused_stream(plan, plan.initial_state(), docs)
        assert full == want and full_ended == ended
        assert sum(not isinstance(c, str) for c in calls) >= len(full) // 3 - 2  # every call but the last ones fused
        opened = [k for k, s in enumerate(states) if any(c.open for lane in s.lanes.values() for c in lane.sources)]
        boundary = next(k for k, s in enumerate(states) if any(lane.sources[0].epoch > 0 for lane in s.lanes.values()))
        points = {"middle": len(want) // 2, "epoch boundary": boundary, "end": len(want) - 1,
                  **({"open document": opened[len(opened) // 2]} if pieces else {})}
        for name, k in points.items():
            fresh = Plan(manifest, spec)
            rest, _, rest_ended = fused_stream(fresh, fresh.load_state(json.loads(json.dumps(states[k].state_dict()))),
                                               MappedDocs(fresh))
            assert rest == want[k + 1:] and rest_ended, f"resumed after step {k} ({name}) differs"
    finally:
        fast.fast_steps = real
