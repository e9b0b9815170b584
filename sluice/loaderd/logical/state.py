"""Data state: where every lane stands after a step, as pointers.

A lane's state is a draw counter, one cursor per source (epoch, documents
taken from the lane's share this epoch, whether the source is still active,
and realized documents/tokens/loss tokens/rows), and its packer residual as
pointers. It never holds token data, so it is small, and restoring it is O(1)
in the step: nothing is replayed.

``DataState.state_dict()`` is JSON-able (ints, strings, bools, lists, dicts);
``from_state_dict`` refuses another schema, dataset ID or run spec with an
error that prints both values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.errors import StateError

STATE_SCHEMA = 1
STATE_KIND = "sluice.data-state"


@dataclass(frozen=True)
class SourceCursor:
    epoch: int = 0
    taken: int = 0  # documents taken from this lane's share in `epoch`
    active: bool = True
    docs: int = 0  # realized, all epochs
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0  # rows attributed to this source (unit "sequences")

    def to_list(self) -> list[int]:
        return [self.epoch, self.taken, int(self.active), self.docs, self.tokens, self.loss_tokens, self.rows]

    @classmethod
    def from_list(cls, v: Any, where: str) -> SourceCursor:
        if not (isinstance(v, list) and len(v) == 7 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise StateError(f"{where}: source cursor {v!r} is not 7 integers")
        if min(v) < 0:
            raise StateError(f"{where}: source cursor {v!r} has a negative field")
        return cls(v[0], v[1], bool(v[2]), v[3], v[4], v[5], v[6])


@dataclass(frozen=True)
class LaneState:
    draws: int = 0
    rows: int = 0
    sources: tuple[SourceCursor, ...] = ()
    packers: dict[str, Any] = field(default_factory=dict)  # packer key -> pointer state (read-only)

    def to_obj(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "rows": self.rows,
            "sources": [c.to_list() for c in self.sources],
            "packers": self.packers,
        }

    @classmethod
    def from_obj(cls, obj: Any, n_sources: int, where: str) -> LaneState:
        if not isinstance(obj, dict):
            raise StateError(f"{where}: lane state is not an object")
        for key in ("draws", "rows"):
            if not isinstance(obj.get(key), int) or obj[key] < 0:
                raise StateError(f"{where}.{key}: expected a non-negative integer, got {obj.get(key)!r}")
        srcs = obj.get("sources")
        if not isinstance(srcs, list) or len(srcs) != n_sources:
            raise StateError(f"{where}.sources: expected {n_sources} cursors, got {srcs!r:.80}")
        packers = obj.get("packers")
        if not isinstance(packers, dict):
            raise StateError(f"{where}.packers: expected an object")
        return cls(
            draws=obj["draws"],
            rows=obj["rows"],
            sources=tuple(SourceCursor.from_list(v, f"{where}.sources[{i}]") for i, v in enumerate(srcs)),
            packers=packers,
        )


@dataclass(frozen=True)
class DataState:
    """State of the lanes this holder knows, after global step `step` (-1 = before step 0)."""

    dataset_id: str
    runspec_digest: str
    step: int
    lanes: dict[int, LaneState]
    schema: int = STATE_SCHEMA

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "schema": self.schema,
            "dataset_id": self.dataset_id,
            "runspec_digest": self.runspec_digest,
            "step": self.step,
            "lanes": {str(k): v.to_obj() for k, v in sorted(self.lanes.items())},
        }

    @classmethod
    def from_state_dict(
        cls, d: Any, *, dataset_id: str, runspec_digest: str, n_sources: int, n_lanes: int
    ) -> DataState:
        """Validate and load; raises StateError naming the field and both values on a mismatch."""
        if not isinstance(d, dict) or d.get("kind") != STATE_KIND:
            raise StateError(f"data state: not a sluice data state (kind={d.get('kind') if isinstance(d, dict) else type(d).__name__!r})")
        if d.get("schema") != STATE_SCHEMA:
            raise StateError(f"data state: schema {d.get('schema')!r}, this sluice reads schema {STATE_SCHEMA}")
        if d.get("dataset_id") != dataset_id:
            raise StateError(
                f"data state: dataset ID {d.get('dataset_id')!r} differs from the manifest's {dataset_id!r}; "
                "this state belongs to another dataset"
            )
        if d.get("runspec_digest") != runspec_digest:
            raise StateError(
                f"data state: run spec digest {d.get('runspec_digest')!r} differs from this run spec's "
                f"{runspec_digest!r}; this state belongs to another run spec"
            )
        step = d.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise StateError(f"data state.step: expected an integer >= -1, got {step!r}")
        lanes_obj = d.get("lanes")
        if not isinstance(lanes_obj, dict):
            raise StateError("data state.lanes: expected an object")
        lanes: dict[int, LaneState] = {}
        for key, value in lanes_obj.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < n_lanes):
                raise StateError(f"data state.lanes: lane key {key!r} is not in [0, {n_lanes})")
            lanes[int(key)] = LaneState.from_obj(value, n_sources, f"data state.lanes[{key}]")
        return cls(dataset_id=dataset_id, runspec_digest=runspec_digest, step=step, lanes=lanes)

    def subset(self, lanes: Any) -> DataState:
        missing = [lane for lane in lanes if lane not in self.lanes]
        if missing:
            raise StateError(f"data state after step {self.step}: lanes {missing} are not held")
        return DataState(self.dataset_id, self.runspec_digest, self.step, {lane: self.lanes[lane] for lane in lanes})

    def merge(self, other: DataState) -> DataState:
        """Union of two holders' lanes (e.g. two replicas' clients); steps must agree."""
        if (other.dataset_id, other.runspec_digest) != (self.dataset_id, self.runspec_digest):
            raise StateError("data state merge: the states come from different datasets or run specs")
        if other.step != self.step:
            raise StateError(f"data state merge: step {self.step} and step {other.step} differ")
        overlap = set(self.lanes) & set(other.lanes)
        if any(self.lanes[lane] != other.lanes[lane] for lane in overlap):
            raise StateError(f"data state merge: lanes {sorted(overlap)} disagree")
        return DataState(self.dataset_id, self.runspec_digest, self.step, {**self.lanes, **other.lanes})
