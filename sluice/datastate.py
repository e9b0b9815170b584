"""Data state: where every lane stands after a step, as pointers (a shared leaf).

Imported by the daemon (logical plane, RESTORE/COMMIT gate), and available to
the client and the trainer hooks without importing the daemon: it depends on
`sluice.errors` only.

A lane's state is a draw counter, one cursor per source (epoch, documents
taken from the lane's share this epoch, whether the source is still active,
realized documents/tokens/loss tokens/rows, and the framed offset of the
source's open document under piece draws), and its packer residual as
pointers. It never holds token data, so it is small, and restoring it is O(1)
in the step: nothing is replayed.

``DataState.state_dict()`` is JSON-able (ints, strings, bools, lists, dicts);
``from_state_dict`` refuses another schema, dataset ID or run spec with an
error that prints both values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.errors import ResizeRefused, StateError

try:  # optional (the "fast" extra): encodes a step's state in ~2 us against the stdlib's ~17 (8 lanes)
    from msgspec.json import encode as _msgspec_encode
except ImportError:  # pragma: no cover - the stdlib encoder alone
    _msgspec_encode = None

# Schema 2 added the cursor column `open` (piece draws, docs/logical.md). Schema 1
# states (7 columns) still load: they come from whole-document streams, so no
# source has an open document (open = 0).
STATE_SCHEMA = 2
READ_SCHEMAS = (1, 2)
STATE_KIND = "sluice.data-state"

# The run spec's `resume` contracts (docs/runspec.md). Only `exact` promises the
# same data-parallel size: the others allow resuming on another number of ranks
# (that divides the lanes, which the daemon checks). sluice's stream is a pure
# function of (manifest, run spec, step), so it always keeps the `exact` promise;
# `coverage` and `distributional` are weaker promises it keeps too.
RESUME_CONTRACTS = ("exact", "exact-elastic", "coverage", "distributional")
RESIZABLE_CONTRACTS = frozenset(RESUME_CONTRACTS) - {"exact"}


def check_resize(resume: str, saved_world_size: int, world_size: int, where: str) -> None:
    """Raise ResizeRefused if contract `resume` forbids resuming a state saved by `saved_world_size`
    ranks on `world_size` ranks (only `exact` does, and only when the two differ); StateError for an
    unknown contract. `where` names the reader (e.g. the client and its replica)."""
    if resume not in RESUME_CONTRACTS:
        raise StateError(f"{where}: resume contract {resume!r:.60} is not one of {', '.join(RESUME_CONTRACTS)}")
    if saved_world_size == world_size or resume in RESIZABLE_CONTRACTS:
        return
    raise ResizeRefused(
        f"{where}: the checkpoint was saved by {saved_world_size} data-parallel ranks and this run has "
        f"{world_size}; the run spec's resume = {resume!r} promises the same data-parallel size. To resume "
        'on another number of ranks (one that divides the lanes), set resume = "exact-elastic" in the run spec',
        resume=resume, saved_world_size=saved_world_size, world_size=world_size)


# Columns of a source cursor held as a list (`SourceCursor.to_list` order): the logical
# plane advances cursors as mutable int lists on its hot path and names the columns so.
CUR_EPOCH, CUR_TAKEN, CUR_ACTIVE, CUR_DOCS, CUR_TOKENS, CUR_LOSS_TOKENS, CUR_ROWS, CUR_OPEN = range(8)


_new, _setattr = object.__new__, object.__setattr__


def state_obj(dataset_id: str, runspec_digest: str, step: int, lanes: dict[str, Any],
              schema: int = STATE_SCHEMA) -> dict[str, Any]:
    """The JSON form of a data state: the one writer (`DataState.state_dict` calls it; the fast path's kernels
    write around the parts `jit.state_parts` cuts from its output, so their bytes agree). `lanes`: lane number (a decimal string) -> its
    `lane_obj`, in ascending lane order."""
    return {"kind": STATE_KIND, "schema": schema, "dataset_id": dataset_id, "runspec_digest": runspec_digest,
            "step": step, "lanes": lanes}


def lane_obj(draws: int, rows: int, sources: list[Any], packers: dict[str, Any]) -> dict[str, Any]:
    """One lane's JSON form in a data state: `sources` its cursors' columns (`SourceCursor.to_list`),
    `packers` packer key -> pointer state. The one writer, as `state_obj`."""
    return {"draws": draws, "rows": rows, "sources": sources, "packers": packers}


@dataclass(frozen=True)
class SourceCursor:
    epoch: int = 0
    taken: int = 0  # documents taken from this lane's share in `epoch`
    active: bool = True
    docs: int = 0  # realized, all epochs
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0  # rows attributed to this source (unit "sequences")
    # Piece draws: framed offset where the next piece of the open document starts (0: none open).
    # The open document is the lane's (taken - 1)-th of `epoch` (opened by the last advance),
    # so the offset alone names it.
    open: int = 0

    def to_list(self) -> list[int]:
        """The cursor's columns in the order the CUR_* constants name (its JSON form)."""
        return [self.epoch, self.taken, int(self.active), self.docs, self.tokens, self.loss_tokens, self.rows,
                self.open]

    @classmethod
    def from_columns(cls, c: list[int]) -> SourceCursor:
        """The cursor of a column list the logical plane itself advanced (unchecked; see from_list).

        Its fields set in one dict, not through the frozen dataclass's eight guarded setattrs: made
        for every lane and step by the producer (~350 ns against ~750, measured).
        """
        got = _new(cls)
        _setattr(got, "__dict__", {"epoch": c[CUR_EPOCH], "taken": c[CUR_TAKEN], "active": bool(c[CUR_ACTIVE]),
                                   "docs": c[CUR_DOCS], "tokens": c[CUR_TOKENS], "loss_tokens": c[CUR_LOSS_TOKENS],
                                   "rows": c[CUR_ROWS], "open": c[CUR_OPEN]})
        return got

    @classmethod
    def from_list(cls, v: Any, where: str, schema: int = STATE_SCHEMA) -> SourceCursor:
        """Validate a cursor's JSON form: 8 integers (schema 2), or 7 for a schema 1 state (no open document)."""
        n = 7 if schema == 1 else 8
        if not (isinstance(v, list) and len(v) == n and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise StateError(f"{where}: source cursor {v!r} is not {n} integers (data state schema {schema})")
        if min(v) < 0:
            raise StateError(f"{where}: source cursor {v!r} has a negative field")
        return cls.from_columns(v if n == 8 else [*v, 0])


@dataclass(frozen=True)
class LaneState:
    draws: int = 0
    rows: int = 0
    sources: tuple[SourceCursor, ...] = ()
    packers: dict[str, Any] = field(default_factory=dict)  # packer key -> pointer state (read-only)

    def to_obj(self) -> dict[str, Any]:
        return lane_obj(self.draws, self.rows, [c.to_list() for c in self.sources], self.packers)

    @classmethod
    def from_obj(cls, obj: Any, n_sources: int, where: str, schema: int = STATE_SCHEMA) -> LaneState:
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
            sources=tuple(SourceCursor.from_list(v, f"{where}.sources[{i}]", schema) for i, v in enumerate(srcs)),
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
        return state_obj(self.dataset_id, self.runspec_digest, self.step,
                         {str(k): v.to_obj() for k, v in sorted(self.lanes.items())}, self.schema)

    @classmethod
    def from_state_dict(
        cls, d: Any, *, dataset_id: str, runspec_digest: str, n_sources: int, n_lanes: int
    ) -> DataState:
        """Validate and load; raises StateError naming the field and both values on a mismatch."""
        if not isinstance(d, dict) or d.get("kind") != STATE_KIND:
            raise StateError(f"data state: not a sluice data state (kind={d.get('kind') if isinstance(d, dict) else type(d).__name__!r})")
        schema = d.get("schema")
        if schema not in READ_SCHEMAS or isinstance(schema, bool):
            raise StateError(f"data state: schema {schema!r}, this sluice reads schemas "
                             f"{', '.join(map(str, READ_SCHEMAS))}")
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
            lanes[int(key)] = LaneState.from_obj(value, n_sources, f"data state.lanes[{key}]", schema)
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


# Every integer of a state must stay exact in any JSON reader (IEEE doubles).
MAX_STATE_INT = 2**53 - 1


@dataclass(frozen=True, kw_only=True)
class StateBounds:
    """What any state a plan can produce must satisfy, derived from manifest and run spec.

    `source_records[s]` samples per epoch of source s; `lane_shares[lane][s]`
    the positions lane `lane` owns of them; `max_doc_tokens[s]` an upper bound
    on one framed document's tokens (derived from object sizes by the caller,
    see `sluice.loaderd.gate`); `packer_keys` the packers a lane has;
    `algorithm`, `window` and `seq_len` the packing policy; `piece_tokens`
    the piece-draw bound (None: whole documents, so no cursor has an open
    document).
    """

    source_records: tuple[int, ...]
    lane_shares: tuple[tuple[int, ...], ...]
    max_doc_tokens: tuple[int, ...]
    packer_keys: tuple[str, ...]
    algorithm: str
    window: int
    seq_len: int
    piece_tokens: int | None = None  # the manifest's mixture.piece_tokens (None: whole documents)


def check_bounds(state: DataState, bounds: StateBounds) -> None:
    """Refuse (StateError naming the field, the value and the bound) any state no plan can produce.

    `from_state_dict` checked the form; this checks the values: cursors within
    the lane's share, realized counts and epochs within exact-integer range,
    packer keys the run has, and every residual pointer inside its source
    (source index, epoch not after the cursor's, sample index, token range).
    """
    n = len(bounds.source_records)
    if state.step > MAX_STATE_INT:
        raise StateError(f"data state.step: {state.step} exceeds {MAX_STATE_INT}")
    for lane, ls in sorted(state.lanes.items()):
        where = f"data state.lanes[{lane}]"
        for key in ("draws", "rows"):
            if getattr(ls, key) > MAX_STATE_INT:
                raise StateError(f"{where}.{key}: {getattr(ls, key)} exceeds {MAX_STATE_INT}")
        for s, c in enumerate(ls.sources):
            share = bounds.lane_shares[lane][s]
            if max(c.to_list()) > MAX_STATE_INT:
                raise StateError(f"{where}.sources[{s}]: {c.to_list()} has a field above {MAX_STATE_INT}")
            if c.taken > share:
                raise StateError(f"{where}.sources[{s}].taken: {c.taken} exceeds the lane's share of {share} "
                                 "samples per epoch")
            if c.open:
                _check_open(c, bounds, f"{where}.sources[{s}].open", s)
        unknown = sorted(set(ls.packers) - set(bounds.packer_keys))
        if unknown:
            raise StateError(f"{where}.packers: keys {unknown} are not packers of this run ({list(bounds.packer_keys)})")
        for key, pst in ls.packers.items():
            _check_packer(pst, ls, bounds, f"{where}.packers[{key!r}]", n)


def _check_open(c: SourceCursor, bounds: StateBounds, where: str, s: int) -> None:
    """An open document's offset: only under piece draws, after a document was taken, in an active source,
    inside a document."""
    if bounds.piece_tokens is None:
        raise StateError(f"{where}: {c.open}, but this manifest draws whole documents (no mixture.piece_tokens)")
    if c.taken == 0:
        raise StateError(f"{where}: {c.open}, but no document of epoch {c.epoch} was taken (taken = 0)")
    if not c.active:
        raise StateError(f"{where}: {c.open}, but the source is inactive (a source leaves only when it opens no "
                         "document)")
    if c.open % bounds.piece_tokens:
        raise StateError(f"{where}: offset {c.open} is not a piece boundary: a document's pieces start at multiples "
                         f"of mixture.piece_tokens = {bounds.piece_tokens}")
    if c.open >= bounds.max_doc_tokens[s]:
        raise StateError(f"{where}: offset {c.open} is not below {bounds.max_doc_tokens[s]}, the most framed tokens "
                         "a document of this source can have")


def _check_packer(pst: Any, ls: LaneState, bounds: StateBounds, where: str, n: int) -> None:
    if not isinstance(pst, dict):
        raise StateError(f"{where}: expected an object")
    if bounds.algorithm == "concat":
        unknown = sorted(set(pst) - {"cur"})
        if unknown:
            raise StateError(f"{where}: unknown fields {unknown} for a concat packer")
        cur = pst.get("cur")
        if cur is None:
            return
        _check_piece(cur, ls, bounds, f"{where}.cur", n, residual=True)
        return
    unknown = sorted(set(pst) - {"open", "pending", "ended"})
    if unknown:
        raise StateError(f"{where}: unknown fields {unknown} for a bestfit packer")
    if not isinstance(pst.get("ended", False), bool):
        raise StateError(f"{where}.ended: expected true or false, got {pst.get('ended')!r}")
    # pending: closed bins, at most one per seq_len chunk of the longest document plus the window
    most_pending = max(bounds.max_doc_tokens, default=0) // bounds.seq_len + bounds.window + 1
    for name, limit in (("open", bounds.window), ("pending", most_pending)):
        bins = pst.get(name, [])
        if not isinstance(bins, list) or len(bins) > limit:
            raise StateError(f"{where}.{name}: expected at most {limit} bins, got {bins!r:.80}")
        for b, pieces in enumerate(bins):
            if not isinstance(pieces, list) or not pieces:
                raise StateError(f"{where}.{name}[{b}]: expected a non-empty list of pieces")
            for i, piece in enumerate(pieces):
                _check_piece(piece, ls, bounds, f"{where}.{name}[{b}][{i}]", n, residual=False)
            fill = sum(p[4] - p[3] for p in pieces)
            if fill > bounds.seq_len:
                raise StateError(f"{where}.{name}[{b}]: holds {fill} tokens, more than seq_len {bounds.seq_len}")


def _check_piece(piece: Any, ls: LaneState, bounds: StateBounds, where: str, n: int, *, residual: bool) -> None:
    """[source, epoch, index, a, b]: a residual (a = offset, b = length) or a bin piece (a = start, b = end)."""
    if not (isinstance(piece, list) and len(piece) == 5
            and all(isinstance(v, int) and not isinstance(v, bool) for v in piece)):
        raise StateError(f"{where}: {piece!r:.80} is not 5 integers")
    s, epoch, index, a, b = piece
    if not 0 <= s < n:
        raise StateError(f"{where}: source index {s} is not in [0, {n})")
    if not 0 <= epoch <= ls.sources[s].epoch:
        raise StateError(f"{where}: epoch {epoch} is not in [0, {ls.sources[s].epoch}] (the source cursor's epoch)")
    if not 0 <= index < bounds.source_records[s]:
        raise StateError(f"{where}: sample index {index} is not in [0, {bounds.source_records[s]})")
    top = bounds.max_doc_tokens[s]
    if residual and not 0 <= a < b <= top:
        raise StateError(f"{where}: residual offset {a} of a {b}-token document is not in [0, length) "
                         f"with length <= {top}")
    if not residual and not 0 <= a < b <= top:
        raise StateError(f"{where}: token range [{a}, {b}) is not within [0, {top}]")
    piece = bounds.piece_tokens
    if piece is not None and a // piece != (b - 1) // piece:
        # Under piece draws every drawn range lies inside one piece [k B, (k + 1) B) of its document; a
        # residual continues its drawn piece, a bin holds a drawn piece or a row-sized cut of one.
        raise StateError(f"{where}: token range [{a}, {b}) crosses a piece boundary (a multiple of "
                         f"mixture.piece_tokens = {piece}); a drawn piece never does")


def state_json(state: dict[str, Any]) -> bytes:
    """`state` (a `DataState.state_dict()`) as `encoding.json_bytes(state)` encodes it, byte for byte.

    With msgspec installed its encoder (keys sorted, compact: the same bytes
    for ints, bools, None, printable ASCII strings without escapes, lists and dicts,
    which is all a data state holds) does it at about a tenth of the cost, a
    per-step cost of the producer (bench/results/peers-log.md, "What limits the
    misses"); any output that could differ (non-ASCII, DEL, an escape) or any value
    it refuses goes to the stdlib encoder, which then decides or raises.
    Floats never occur in a state (cursors, counters and packer pointers are
    ints, checked on load): msgspec writes some of them in another form (1e16,
    the stdlib 1e+16), and values outside JSON that the stdlib refuses it
    encodes (NaN and infinities as null, bytes, sets), so a state holding
    any of those would not get json_bytes' bytes or refusal
    (tests/test_attack_state_json.py).
    """
    if _msgspec_encode is not None:
        try:
            got = _msgspec_encode(state, order="sorted")
        except Exception:  # noqa: BLE001 - whatever it refuses, the stdlib encoder decides (or raises)
            got = None
        # printable ASCII without a backslash: no character either encoder escapes (the stdlib escapes
        # non-ASCII and DEL, msgspec writes them raw; both escape control characters, not alike, so a control
        # character comes out with a backslash). `isascii` and two searches: a tenth of a `translate`'s cost.
        if got is not None and got.isascii() and b"\x7f" not in got and b"\\" not in got:
            return got
    from sluice.wire.encoding import json_bytes

    return json_bytes(state)
