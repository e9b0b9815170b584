"""One writer of the data state's JSON form: `datastate.state_obj` and `datastate.lane_obj`.

`DataState.state_dict()` and the fast path's states (the kernels' JSON,
`jitrows.state_texts` / `bins_texts`, written around parts cut from this
writer's output: `jit.state_parts`) must give the same bytes for the same state (a
client's checkpoint holds them; tests/test_logical_fused.py compares them);
with two writers, a field added to one would silently differ in the other.
This test fails when a module of sluice builds a state's or a lane's dict
itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sluice
from sluice.datastate import DataState, LaneState, SourceCursor, lane_obj, state_obj
from sluice.wire.encoding import json_bytes

ROOT = Path(sluice.__file__).parent
STATE_KEYS = {"kind", "schema", "dataset_id", "runspec_digest", "step", "lanes"}
LANE_KEYS = {"draws", "rows", "sources", "packers"}


def _writers() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        # an object's __dict__ set in one go (`_setattr(got, "__dict__", {...})`) is not its JSON form
        attrs = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_setattr"
                 for a in n.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and id(node) not in attrs:
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if keys >= STATE_KEYS or keys >= LANE_KEYS:
                    out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return out


def test_only_datastate_writes_a_state_or_a_lane_object():
    writers = _writers()  # parses every module of sluice: once
    assert [w for w in writers if not w.startswith("sluice/datastate.py:")] == []
    assert len(writers) == 2  # state_obj and lane_obj themselves


def test_state_dict_is_the_writers_form_byte_for_byte():
    lane = LaneState(draws=3, rows=2, sources=(SourceCursor(taken=4, docs=4, tokens=90),), packers={"*": {"cur": None}})
    st = DataState("ds", "b3:x", 7, {10: lane, 2: lane})
    want = state_obj("ds", "b3:x", 7, {"2": lane_obj(3, 2, [[0, 4, 1, 4, 90, 0, 0, 0]], {"*": {"cur": None}}),
                                       "10": lane_obj(3, 2, [[0, 4, 1, 4, 90, 0, 0, 0]], {"*": {"cur": None}})})
    assert json_bytes(st.state_dict()) == json_bytes(want)
    assert list(st.state_dict()["lanes"]) == ["2", "10"]  # ascending lane order, as the fast path writes them
