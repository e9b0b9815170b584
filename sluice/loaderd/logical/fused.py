"""The fast path's result: every lane and step of a call, rows in one step-major block, states as JSON.

`FusedSteps` is what `fast.fast_steps` returns (made by `fusedmix` for
concat, `fusedbins` for best-fit): step j's rows are ``block[j]``
``(3, lanes * per_lane, seq_len)`` (tokens, labels, positions, lane after
lane), its state after it `state_dicts[j]` (the JSON form every producer
entry carries), its micro-batches' cu_seqlens and samples from the piece
starts (`micro`, concat's full rows) or from its rows (`packed`, best-fit's,
which may end in padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice.loaderd.logical.packing import Row
from sluice.loaderd.logical.state import DataState, LaneState, SourceCursor
from sluice.wire.decoding import json_value

_new, _setattr = object.__new__, object.__setattr__


def _lane_state(draws: int, rows: int, sources: tuple[SourceCursor, ...], packers: dict[str, Any]) -> LaneState:
    """`LaneState(draws=.., rows=.., sources=.., packers=..)` with its fields set in one dict instead of four
    guarded frozen setattrs (made for every lane and step; as `SourceCursor.from_columns`)."""
    got = _new(LaneState)
    _setattr(got, "__dict__", {"draws": draws, "rows": rows, "sources": sources, "packers": packers})
    return got


class _LaterLanes(DataState):
    """A `DataState` whose `lanes` are made from their JSON form (`lane_obj`s by lane name) when first read;
    equal to the `DataState` of the same fields, as a `DataState` is (made ~6 us a step for 8 lanes of five
    sources, mostly never read)."""

    def __init__(self, dataset_id: str, runspec_digest: str, step: int, objs: dict[str, Any], lanes: list[int]
                 ) -> None:
        _setattr(self, "__dict__", {"dataset_id": dataset_id, "runspec_digest": runspec_digest, "step": step,
                                    "_objs": (objs, lanes)})

    def __getattr__(self, name: str) -> Any:
        if name != "lanes":  # (only `lanes` is ever missing: made here, then held as the field it is)
            raise AttributeError(name)
        d = self.__dict__
        objs, lanes = d.pop("_objs")
        per = {}
        for lane in lanes:
            o = objs[str(lane)]
            per[lane] = _lane_state(o["draws"], o["rows"], tuple(map(SourceCursor.from_columns, o["sources"])),
                                    o["packers"])
        d["lanes"] = per
        return per

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataState):
            return NotImplemented
        return (self.dataset_id, self.runspec_digest, self.step, self.lanes, self.schema) == \
            (other.dataset_id, other.runspec_digest, other.step, other.lanes, other.schema)

    __hash__ = DataState.__hash__


class StateTexts(Sequence):
    """Each step's data state of a call as its JSON (`texts[j]`: `datastate.state_json`'s bytes, as the compiled
    kernel writes them, `jitrows.state_texts`), read as `state_dict()`'s dicts: decoded when first read, kept."""

    __slots__ = ("texts", "_dicts")

    def __init__(self, texts: list[bytes]) -> None:
        self.texts = texts
        self._dicts: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self.texts)))]
        got = self._dicts.get(j)
        if got is None:
            got = self._dicts[j] = json_value(self.texts[j])
        return got

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class BinRows(Sequence):
    """A best-fit call's rows (`fusedbins`), step-major as `FusedSteps.packed` holds them, made into `Row`s only
    where read (tests, `sluice plan`): the producer cuts its micro-batches from the arrays (`micro`), one numpy
    cumsum and the sample IDs of the pieces each.

    `seg_len` / `seg_owner`: every row's segments one after another (step-major rows: row t = ``j * P * k +
    lane index * k + r``), its pieces' lengths then its padding's (owner -1); each piece's owner is its row of
    `used` (the kernel's placed pieces: source, epoch, index, object, record, first token, count, start, end,
    framed length); `row_ptr[t]` where row t's segments start (n * P * k + 1)."""

    def __init__(self, block: np.ndarray, k: int, seg_len: np.ndarray, seg_owner: np.ndarray, row_ptr: np.ndarray,
                 used: np.ndarray, keys_of: Any) -> None:
        self.block, self.k, self.seg_len, self.seg_owner, self.row_ptr = block, k, seg_len, seg_owner, row_ptr
        self.used, self.keys_of = used, keys_of
        self.per_step = block.shape[2]
        self._sids: list[str] | None = None
        self._rows: dict[int, Row] = {}

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    def sample_ids(self) -> list[str]:
        """Every placed piece's sample ID (``<object sample key>:<record>``), made on first use."""
        if self._sids is None:
            keys_of = self.keys_of
            self._sids = [f"{keys_of[s][o]}:{r}" for s, o, r in self.used[:, [0, 3, 4]].tolist()]
        return self._sids

    def micro_owners(self, j: int, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Step j's rows [r0, r1) as a micro-batch: its cu_seqlens (padding a segment of its own) and each piece's
        owner in order (its row of `used`, int64: `sample_ids()[owner]` is its sample ID, made only when read)."""
        lo, hi = self.row_ptr[j * self.per_step + r0], self.row_ptr[j * self.per_step + r1]
        cu = np.zeros(hi - lo + 1, dtype=np.int32)
        np.cumsum(self.seg_len[lo:hi], out=cu[1:])
        owners = self.seg_owner[lo:hi]
        return cu, owners[owners >= 0]

    def segments(self, t0: int, t1: int) -> list[list[tuple[str, int, int]]]:
        """Rows t0 .. t1 - 1 (step-major): each its (sample ID, start, end) segments (padding in none)."""
        sids, ptr, owner = self.sample_ids(), self.row_ptr.tolist(), self.seg_owner
        out = []
        for t in range(t0, t1):
            own = owner[ptr[t]:ptr[t + 1]]
            own = own[own >= 0]
            se = self.used[own][:, 7:9].tolist()
            out.append([(sids[o], a, b) for o, (a, b) in zip(own.tolist(), se)])
        return out

    def __getitem__(self, t: Any) -> Any:
        if isinstance(t, slice):
            return [self[x] for x in range(*t.indices(len(self)))]
        got = self._rows.get(t)
        if got is None:
            j, row = divmod(t, self.per_step)
            ptr = self.row_ptr
            b = self.block[j]
            got = self._rows[t] = Row(b[0, row], b[1, row], b[2, row],
                                      tuple(self.seg_len[ptr[t]:ptr[t + 1]].tolist()),
                                      tuple(self.segments(t, t + 1)[0]))
        return got

    __hash__ = None  # type: ignore[assignment]


def holds_lanes(state: DataState, lanes: list[int]) -> bool:
    """Whether `state` has every lane of `lanes`, without making a `_LaterLanes`' lanes."""
    later = state.__dict__.get("_objs")
    if later is not None:
        return set(lanes) <= set(later[1])
    return all(lane in state.lanes for lane in lanes)


@dataclass
class FusedSteps:
    """Steps ``first .. first + n - 1`` of `lanes`, computed at once.

    `block[j]` is step j's ``(3, P*k, L)`` rows (tokens, labels, positions),
    lanes in the order given; `state_dicts[j]` the data state after step j as
    ``state_dict()`` writes it (what every step's entry carries), and
    `state(j)` / `states` the `DataState`s, made on demand (a producer needs
    only the call's last one: making every step's cost ~6 us a step).
    `keys` are the piece starts of all steps (step-major flat positions of the
    block's token plane, sorted), `owners` the entry each piece belongs to;
    `sids` / `starts` / `offs` give an entry's sample ID, its position in its
    lane's stream and its framed offset there (the kernel's `sids` are made on
    first use from `used`, its walked pieces, and `keys_of`, the plan's sample
    keys: `sample_ids`).
    """

    first: int
    lanes: list[int]
    k: int
    L: int
    block: np.ndarray
    state_dicts: list[dict[str, Any]] | StateTexts  # (the kernel's: `StateTexts`, its JSON decoded when read)
    keys: np.ndarray
    owners: list[int] | np.ndarray
    sids: list[str | None] | None
    # `rows` only (the producer never reads them: arrays, made lists there)
    entry_start: np.ndarray  # per entry: where it starts in the lane-major flat stream
    entry_off: np.ndarray  # per entry: its framed offset in its document
    bound_global: np.ndarray  # per piece (in key order): its lane-major flat position
    entry_source: np.ndarray | None = None  # per entry: its source (concat's; best-fit counts `row_tokens`)
    # `fusedbins`' result: every step's rows, step-major (`BinRows`; keys, owners, .. then unused)
    packed: BinRows | None = None
    row_tokens: np.ndarray | None = None  # `fusedbins`': every row's tokens per source (step-major rows)
    used: np.ndarray | None = None  # the kernel's: its walked pieces, one an entry (source, epoch, index, object, record, ..)
    keys_of: Any = None  # the plan's sample keys (`Plan.sample_keys`), with `used`
    sources: int = 0  # the plan's sources, with `entry_source` (`unit`'s tokens per source)
    _made: dict[int, DataState] = field(default_factory=dict)
    # every micro-batch's cu_seqlens one after another, where each one's pieces start in `keys` and its tokens per
    # source, for micro-batches of `_unit` tokens (`unit`; the kernel's are whole steps'; -1: none made yet)
    _cu: np.ndarray | None = None
    _bounds: list[int] = field(default_factory=list)
    _tokens: list[list[int]] = field(default_factory=list)
    _unit: int = -1

    def state(self, j: int) -> DataState:
        """The data state after step j (``first + j``): `state_dicts[j]` as a `DataState` (memoized), its lanes
        made when first read (a producer hands the call's last state to the next call, which continues from
        where the kernel left its lanes without reading them: `located.Ended`)."""
        got = self._made.get(j)
        if got is None:
            d = self.state_dicts[j]
            got = self._made[j] = _LaterLanes(d["dataset_id"], d["runspec_digest"], d["step"], d["lanes"],
                                              self.lanes)
        return got

    @property
    def states(self) -> list[DataState]:
        """The data state after each step of the call."""
        return [self.state(j) for j in range(len(self.state_dicts))]

    def _step_range(self, j: int) -> tuple[int, int]:
        PT = len(self.lanes) * self.k * self.L
        lo, hi = self.keys.searchsorted([j * PT, (j + 1) * PT])
        return int(lo), int(hi)

    def micro(self, j: int, r0: int, r1: int) -> tuple[np.ndarray, list[str]]:
        """Step j's rows [r0, r1) as a micro-batch: (cu_seqlens int32, sample IDs in order of first appearance).
        For concat rows (`unit`) r1 - r0 divides r0 and the step's rows; ValueError otherwise."""
        if self.packed is not None:
            cu, owners = self.packed.micro_owners(j, r0, r1)
            sids = self.packed.sample_ids()
        else:
            per, rows = r1 - r0, len(self.lanes) * self.k
            if per <= 0 or r0 % per or rows % per:
                raise ValueError(f"rows [{r0}, {r1}) of a step of {rows} rows are not a micro-batch of `unit`'s")
            cu, owners, _ = self.unit((j * rows + r0) // per, per * self.L)
            sids = self.sample_ids()
        return cu, list(dict.fromkeys([sids[o] for o in owners.tolist()]))  # type: ignore[misc]

    def segments(self, j: int, r0: int, r1: int) -> list[list[tuple[str, int, int]]] | None:
        """Per row of step j's rows [r0, r1) of best-fit (`packed`, rows that may end in padding): its (sample ID,
        start, end) segments, as `MicroBatch.segments` (padding in none); None for concat rows, which are full
        (`unit` says what each token belongs to)."""
        if self.packed is None:
            return None
        base = j * len(self.lanes) * self.k
        return self.packed.segments(base + r0, base + r1)

    def sample_ids(self) -> list[str | None]:
        """Every entry's sample ID (``<object sample key>:<record>``; the kernel's made here on first use)."""
        if self.sids is None:
            keys_of = self.keys_of
            self.sids = [f"{keys_of[s][o]}:{r}" for s, o, r in self.used[:, [0, 3, 4]].tolist()]
        return self.sids

    def unit(self, u: int, U: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Micro-batch u of the call, for concat steps (`packed` None), where each is `U` tokens of whole rows (U
        divides a step's P*k*L; micro-batch u is the u-th stretch of U tokens of the step-major token planes): its
        cu_seqlens (a view of every micro-batch's), the entries its pieces belong to in order (one a piece,
        int64), and its tokens per source (a list a source). Made for every micro-batch of the call at once
        (`unit_arrays`) when first asked for a size (the kernel's whole steps' come made)."""
        if self._unit != U:
            n = len(self.state_dicts) * len(self.lanes) * self.k * self.L // U
            src = self.entry_source[self._owners_np()]  # type: ignore[index]
            self._cu, self._bounds, self._tokens = unit_arrays(self.keys, n, U, src, self.sources)
            self._unit = U
        lo, hi = self._bounds[u], self._bounds[u + 1]
        return self._cu[lo + u:hi + u + 1], self._owners_np()[lo:hi], self._tokens[u]  # type: ignore[index]

    def _owners_np(self) -> np.ndarray:
        if not isinstance(self.owners, np.ndarray):
            self.owners = np.asarray(self.owners, dtype=np.int64)
        return self.owners

    def rows(self, j: int) -> dict[int, list[Row]]:
        """Step j's rows per lane, as `Plan.step` makes them (arrays view the block; provenance per piece)."""
        L, k, PT = self.L, self.k, len(self.lanes) * self.k * self.L
        if self.packed is not None:
            R = len(self.lanes) * k
            return {lane: self.packed[j * R + i * k:j * R + (i + 1) * k] for i, lane in enumerate(self.lanes)}
        lo, hi = self._step_range(j)
        keys = (self.keys[lo:hi] - j * PT).tolist()
        owners, glob = list(self.owners[lo:hi]), self.bound_global[lo:hi].tolist()
        entry_start, entry_off = self.entry_start.tolist(), self.entry_off.tolist()
        block, sids = self.block[j], self.sample_ids()
        out: dict[int, list[Row]] = {}
        p = 0
        for i, lane in enumerate(self.lanes):
            rows = []
            for r in range(k):
                row = i * k + r
                row_end = (row + 1) * L
                q = p
                while q < len(keys) and keys[q] < row_end:
                    q += 1
                widths, segs = [], []
                for b in range(p, q):
                    w = (keys[b + 1] if b + 1 < q else row_end) - keys[b]
                    u = owners[b]
                    fs = glob[b] - entry_start[u] + entry_off[u]
                    widths.append(w)
                    segs.append((sids[u], fs, fs + w))
                rows.append(Row(block[0, row], block[1, row], block[2, row], tuple(widths), tuple(segs)))
                p = q
            out[lane] = rows
        return out


def unit_arrays(keys: np.ndarray, n: int, U: int, src: np.ndarray, S: int
                ) -> tuple[np.ndarray, list[int], list[list[int]]]:
    """Every one of `n` micro-batches of `U` tokens (full rows; micro-batch u the u-th U tokens of the step-major
    token planes) from the call's piece starts `keys` (sorted) and each piece's source `src` (of `S`): their
    cu_seqlens in one int32 array (micro-batch u's: its piece starts less ``u * U``, then U, at ``bounds[u] + u
    .. bounds[u + 1] + u``), where each one's pieces start in `keys` (`bounds`, n + 1), and each one's tokens per
    source. Every micro-batch starts with a piece (a row start is a piece start), so a piece ends at the next key
    or its micro-batch's end; `jitrows._step_cu` makes the same for whole steps in the kernel."""
    bounds = keys.searchsorted(np.arange(0, (n + 1) * U, U, dtype=np.int64))
    units = np.repeat(np.arange(n, dtype=np.int64), np.diff(bounds))
    at = np.arange(len(keys), dtype=np.int64) + units  # (piece p of micro-batch u: cu[p + u])
    cu = np.empty(len(keys) + n, dtype=np.int32)
    cu[at] = keys - units * U
    cu[bounds[1:] + np.arange(n)] = U
    lengths = cu[at + 1] - cu[at]
    tokens = np.bincount(units * S + src, weights=lengths, minlength=n * S).astype(np.int64).reshape(n, S)
    return cu, bounds.tolist(), tokens.tolist()
