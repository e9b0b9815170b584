"""A lane whose draws weigh nothing ends with a named error, never a silent endless loop.

Without separators an empty document adds no token. Under exhaustion rule
`repeat`, a lane whose whole share of a source is empty documents would draw
them epoch after epoch without ever filling a row: before this check,
`Plan.step` spun forever. Now it raises
ExhaustedError naming the source and the lane, at the same step, and the fast
path stands aside for it (never loops); a lane that has a non-empty document
anywhere in its draws is unaffected, on either path.
"""

from __future__ import annotations

import pytest
from logical_helpers import MappedDocs, fast_kernel, make_manifest, make_spec

from sluice.errors import ExhaustedError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.fast import fast_steps


def _plans(unit: str, policy: str, algorithm: str, sources):
    manifest = make_manifest(sources, separator="none", unit=unit, policy=policy, algorithm=algorithm)
    spec = make_spec(lanes=4, global_batch=4, micro_batch=1, order="none")
    return Plan(manifest, spec), Plan(manifest, spec, reference=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
@pytest.mark.parametrize("unit,policy", [("documents", "quota"), ("tokens", "quota"), ("documents", "categorical"),
                                         ("sequences", "quota")])
def test_a_lane_of_empty_documents_under_repeat_is_refused_by_name(algorithm, unit, policy):
    # one object of 4 records, 4 lanes, no order: lane 3's share is record 3, which is empty
    fast, ref = _plans(unit, policy, algorithm, [("web", [4], "1", "repeat")])
    errors = []
    assert fast_steps(fast, fast.initial_state(), MappedDocs(fast, 40, empty_every=4), range(4), 3, fast_kernel()) in (
        "mixture", "packed")
    for plan in (fast, ref):
        docs = MappedDocs(plan, 40, empty_every=4)
        with pytest.raises(ExhaustedError) as info:
            plan.step(plan.initial_state(), docs)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert "step 0" in errors[0] and "'web' in lane 3" in errors[0] and "separator" in errors[0]


@pytest.mark.timeout(60)
def test_an_empty_share_beside_a_source_with_tokens_still_serves():
    # source "a" gives lane 3 only an empty document; "b" gives it documents with tokens (its first object has
    # 3 records, so lane 3's records of b are not the empty 4th ones): the lane fills its rows
    # from b (documents quota), wrapping a's share every few draws, and the stream goes on
    fast, ref = _plans("documents", "quota", "concat", [("a", [4], "1", "repeat"), ("b", [3, 40], "1", "repeat")])
    outs = []
    for plan in (fast, ref):
        docs = MappedDocs(plan, 40, empty_every=4)
        state, rows = plan.initial_state(), []
        while len(rows) < 6:
            got = fast_steps(plan, state, docs, range(4), 2, fast_kernel())
            if isinstance(got, str):
                assert plan is ref
                batch, state = plan.step(state, docs)
                rows.append(batch.rows[3][0].input_ids.tobytes())
            else:
                rows += [got.rows(j)[3][0].input_ids.tobytes() for j in range(2)]
                state = got.states[-1]
        outs.append(rows[:6])
        outs.append(rows)
    assert outs[0] == outs[1]
