"""The daemon's gate for RESTORE and COMMIT: generations, identity and state values.

Order of checks (DESIGN.md section 6; issue 10 items 14-16), all before
anything durable changes:

1. the generation: not older than the daemon's (FENCED), below
   `MAX_GENERATION` (2^53, exact in any JSON reader) and at most
   `GENERATION_WINDOW` above the daemon's (a jump beyond it is a forged or
   corrupt token; BAD_STATE naming both values);
2. identity: the state's dataset ID, run-spec digest, schema and lanes
   (`DataState.from_state_dict`, `subset`);
3. values: the header step equals the state's step, and every cursor and
   residual pointer is one a plan can produce (`check_bounds`);
4. only then the generation is advanced durably (`FenceStore.advance`) and
   the replica reset or the commit recorded.

A refused RESTORE therefore never raises the generation and never fences the
live writer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from sluice.datastate import DataState, StateBounds, check_bounds
from sluice.errors import FencedError, StateError
from sluice.loaderd.fencing import FenceStore
from sluice.loaderd.logical.order import lane_share
from sluice.wire import protocol

MAX_GENERATION = 2**53 - 1
GENERATION_WINDOW = 1 << 20  # a restore may raise the generation by at most this much at once


def bounds_of(plan: Any) -> StateBounds:
    """The StateBounds of a Plan's manifest and run spec."""
    m, spec = plan.manifest, plan.spec
    return StateBounds(
        source_records=tuple(plan.source_records),
        lane_shares=tuple(tuple(lane_share(n, spec.lanes, lane) for n in plan.source_records)
                          for lane in range(spec.lanes)),
        max_doc_tokens=tuple(_doc_tokens_bound(src) for src in m.sources),
        packer_keys=tuple(plan.packer_keys),
        algorithm=m.packing.algorithm,
        window=m.packing.window,
        seq_len=m.packing.seq_len,
        piece_tokens=m.mixture.piece_tokens,
    )


# Compressed or columnar objects say nothing about one document's length: a bound
# generous enough for any real document that still refuses nonsense such as 10^12.
_UNKNOWN_DOC_TOKENS = 1 << 36


def _doc_tokens_bound(src: Any) -> int:
    """An upper bound on the framed tokens of any one document of `src` (bos + eos included)."""
    return max((_object_doc_bound(src, o) for o in src.objects), default=2)


def _object_doc_bound(src: Any, obj: Any) -> int:
    """An upper bound on the framed tokens of any one document of object `obj` of `src`.

    Pre-tokenized objects hold at most one token per byte. Uncompressed text
    holds at most 8 tokens per byte (a token covers at least one character
    after normalization, and NFKC expands a character's bytes at most 6-fold).
    """
    if obj.compression != "none" or src.format == "parquet":
        return _UNKNOWN_DOC_TOKENS
    return (obj.size if src.format == "tokens" else 8 * obj.size) + 2


def _pieces(pst: Any) -> Iterator[tuple[str, list[int]]]:
    """(field, piece) of a packer state `check_bounds` accepted: a concat residual or bestfit bin pieces."""
    if pst.get("cur") is not None:
        yield "cur", pst["cur"]
    for name in ("open", "pending"):
        for b, pieces in enumerate(pst.get(name, []) if "cur" not in pst else []):
            for i, piece in enumerate(pieces):
                yield f"{name}[{b}][{i}]", piece


class StateGate:
    """Generation (durable in `fence`) plus the validation of incoming lane states."""

    def __init__(self, fence: FenceStore, plan: Any, docs: Any = None) -> None:
        """`docs`: the daemon's DocSource, asked (never waited for) for the length of a document a
        state points into, when its tokens are mapped or cached (`check_documents`); None: bounds only."""
        self.fence = fence
        self.plan = plan
        self.docs = docs
        self.bounds = bounds_of(plan)
        self.generation = fence.generation()
        self._restored: dict[int, tuple[int, int, str]] = {}  # replica -> (generation, step, state) applied

    def check_generation(self, h: protocol.Header) -> None:
        """FENCED for an older generation; BAD_STATE for one beyond the bound or the jump window."""
        g = h.generation
        if g < self.generation:
            raise FencedError(f"{h.kind} with generation {g} is older than the daemon's generation {self.generation}")
        if g > MAX_GENERATION:
            raise StateError(f"{h.kind}: generation {g} exceeds the largest generation {MAX_GENERATION}")
        if g > self.generation + GENERATION_WINDOW:
            raise StateError(f"{h.kind}: generation {g} jumps more than {GENERATION_WINDOW} past the daemon's "
                             f"generation {self.generation}")

    def state_of(self, h: protocol.Header, lanes: list[int]) -> DataState:
        """The validated lane states a RESTORE or COMMIT carries (identity, step, values)."""
        if h.kind == protocol.RESTORE and h.body.get("initial") is True and "state" not in h.body:
            # A trainer starting over without a checkpoint (e.g. it died before its
            # first one): the state before step 0 is a pure function of the run.
            state = self.plan.initial_state()
        else:
            state = self.plan.load_state(h.body.get("state"))
        state = state.subset(lanes)  # StateError names the missing lanes
        if h.step != state.step:
            raise StateError(f"{h.kind}: header step {h.step} differs from the state's step {state.step}")
        check_bounds(state, self.bounds)
        self.check_documents(state)
        return state

    def check_documents(self, state: DataState) -> None:
        """Refuse (StateError naming lane, field, value and bound) a position beyond the document it names.

        Every open document (piece draws: the lane's last-taken document of the
        cursor's epoch) and every packer piece points into one document; its
        offset must lie below that document's framed length. The length is
        known exactly when the document's tokens are mapped by this daemon or
        held by the node cache (`DocSource.doc_length`: a restarted daemon on
        its node); otherwise the bound is its own object's size (see
        `_object_doc_bound`), never a wait for a fill on the IO thread. A
        position past a document that passes that bound (a cold cache, a
        compressed object) is refused by the first step after it instead
        (`LaneMachine._cut`), naming the same values.
        """
        plan = self.plan
        for lane, ls in sorted(state.lanes.items()):
            where = f"data state.lanes[{lane}]"
            for s, c in enumerate(ls.sources):
                if c.open:
                    index = plan.lane_sample(s, c.epoch, lane, c.taken - 1)
                    self._within(s, index, c.open, f"{where}.sources[{s}].open: offset {c.open} of the open "
                                                   f"document (sample index {index})")
            for key, pst in ls.packers.items():
                for name, piece in _pieces(pst):
                    s, _, index, _, end = piece
                    last = end - 1  # (a residual's drawn piece and a bin piece end alike: at most the length)
                    self._within(s, index, last, f"{where}.packers[{key!r}].{name}: {piece} (token {last} of "
                                                 f"sample index {index})")

    def _within(self, s: int, index: int, offset: int, what: str) -> None:
        src = self.plan.manifest.sources[s]
        _, objs, records = self.plan.locate(s, np.asarray([index], dtype=np.int64))
        obj = src.objects[objs[0]]
        bound = _object_doc_bound(src, obj)
        length = self._framed_length(s, objs[0], records[0])
        if length is not None and offset >= length:
            raise StateError(f"{what}: the document has {length} framed tokens (source {src.name!r} object "
                             f"{obj.location} record {records[0]})")
        if offset >= bound:
            raise StateError(f"{what}: not below {bound}, the most framed tokens a document of object "
                             f"{obj.location} ({obj.size} bytes) can have")

    def _framed_length(self, s: int, o: int, record: int) -> int | None:
        """The framed length of record `record` of object `o` of source s if its tokens are mapped or cached."""
        doc_length = getattr(self.docs, "doc_length", None)
        n = None if doc_length is None else doc_length(s, o, record)
        return None if n is None else self.plan.framing.framed_len(n)

    def restore(self, h: protocol.Header, lanes: list[int], floor: int) -> tuple[DataState | None, bool]:
        """Validate, then advance the generation durably.

        Returns (state to reset the replica to, or None; whether the generation
        grew). None when the replica's stream of this generation already
        passes through the state: the same (generation, state) again (a second
        peer restoring one checkpoint, a retried RESTORE), or a later state of
        the same generation whose next step (`floor`: the replica's oldest
        unreleased step) is still to be served. A peer that held more batches
        than the others when the daemon restarted restores a later state than
        they do; resetting to it would refuse them the steps in between, and
        resetting to an earlier state is what the one behind needs.
        """
        self.check_generation(h)
        state = self.state_of(h, lanes)
        grew = self._advance(h.generation)
        key = json.dumps(state.state_dict(), sort_keys=True, separators=(",", ":"))
        applied = self._restored.get(h.replica)
        if applied is not None and applied[0] == h.generation:
            if applied[2] == key or (applied[1] < state.step and state.step + 1 >= floor):
                return None, grew
        self._restored[h.replica] = (h.generation, state.step, key)
        return state, grew

    def commit(self, h: protocol.Header, lanes: list[int]) -> tuple[dict[str, Any], bool]:
        """Validate and record a COMMIT; returns (the record kept, whether the generation grew)."""
        self.check_generation(h)
        state = self.state_of(h, lanes)
        record = self.fence.commit(h.replica, h.step, h.generation, state.state_dict())
        grew = h.generation > self.generation
        self.generation = max(self.generation, h.generation)
        return record, grew

    def _advance(self, generation: int) -> bool:
        self.fence.advance(generation)  # durable before we act on it
        if generation > self.generation:
            self.generation = generation
            return True
        return False
