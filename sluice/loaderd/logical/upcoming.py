"""The documents a replica's lanes need next, as arrays: what the producer announces to the workers.

`Plan.upcoming(state, lane, n)` lists one lane's next documents as `DocRef`s,
one Python object per document: the packer's residual, then per active source
its open document (piece draws) and its next n positions. The producer's
announcement takes every lane's list and interleaves them in need order (a
step takes from every lane: every lane's first document, then every lane's
second, ...). Built one document at a time that cost about 1 ms per
announcement of 4 steps on the bench corpus (350 documents), more than the
steps themselves. `upcoming_columns` gives the same documents in the same
order as three int64 arrays, computing the n positions of a lane's source as
one slice of the memoized lane chunks (`Plan.lane_samples`) and their
(object, record) with one `searchsorted` per source; only the residual and
open documents (at most a few per lane) go through `Plan.ref`::

    lane 0: [r0] [o0] a0 a1 a2 ...        need order: r0 r1 o0 o1 a0 b0 a1 b1 ...
    lane 1: [r1] [o1] b0 b1 b2 ...        (column by column, a shorter lane's gaps skipped)

Pure: a function of (plan, state, lanes, n), never of timing.
tests/test_upcoming_columns.py proves it names exactly what the interleaved
`Plan.upcoming` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sluice.loaderd.logical.order import lane_share
from sluice.loaderd.logical.packing import make_packer
from sluice.loaderd.logical.plan import Plan
from sluice.loaderd.logical.state import DataState


@dataclass(frozen=True)
class Upcoming:
    """Documents in need order: document i is record `record[i]` of object `obj[i]` of source `source[i]`."""

    source: np.ndarray
    obj: np.ndarray
    record: np.ndarray

    def __len__(self) -> int:
        return len(self.record)


_EMPTY = np.zeros(0, dtype=np.int64)


def upcoming_columns(plan: Plan, state: DataState, lanes: Sequence[int], n: int) -> Upcoming:
    """The documents of ``[plan.upcoming(state, lane, n) for lane in lanes]``, interleaved in need order
    (every lane's i-th before any lane's (i+1)-th, lanes in the given order), as arrays.

    Raises what `Plan.upcoming` raises for a state naming a sample outside its source (StateError).
    """
    rows: list[tuple[np.ndarray, np.ndarray]] = []  # per lane: (sources, sample indices) in the lane's need order
    for lane in lanes:
        srcs, idxs = _lane(plan, state, lane, n)
        rows.append((srcs, idxs))
    width = max((len(i) for _, i in rows), default=0)
    if not width:
        return Upcoming(_EMPTY, _EMPTY, _EMPTY)
    # One row per lane, padded with -1; read column by column: the interleave of the lanes' lists.
    idx = np.full((len(rows), width), -1, dtype=np.int64)
    single = len(plan.source_records) == 1
    src = None if single else np.zeros((len(rows), width), dtype=np.int64)
    for k, (s, i) in enumerate(rows):
        idx[k, : len(i)] = i
        if src is not None:
            src[k, : len(s)] = s
    flat = idx.T.ravel()
    keep = flat >= 0
    samples = flat[keep]
    sources = np.zeros(len(samples), dtype=np.int64) if src is None else src.T.ravel()[keep]
    objs = np.empty(len(samples), dtype=np.int64)
    records = np.empty(len(samples), dtype=np.int64)
    for s in range(len(plan.source_records)) if not single else (0,):
        mask = slice(None) if single else sources == s
        part = samples[mask]
        if not len(part):
            continue
        starts, ids = plan._starts_np[s]
        k = np.searchsorted(starts, part, side="right") - 1
        objs[mask] = ids[k]
        records[mask] = part - starts[k]
    return Upcoming(sources, objs, records)


def _lane(plan: Plan, state: DataState, lane: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One lane's `Plan.upcoming` as (sources, sample indices) arrays, in its order."""
    ls = state.lanes[lane]
    m = plan.manifest
    parts_s: list[np.ndarray] = []
    parts_i: list[np.ndarray] = []

    def head(s: int, epoch: int, index: int) -> None:  # a residual or open document
        plan.ref(s, epoch, index)  # (the range check `Plan.upcoming` makes: a bad state is refused alike)
        parts_s.append(np.array([s], dtype=np.int64))
        parts_i.append(np.array([index], dtype=np.int64))

    for key in plan.packer_keys:
        packed = ls.packers.get(key)
        if packed is None:
            continue
        p = make_packer(m.packing.algorithm, m.packing.seq_len, m.packing.window)
        p.load(packed, f"lane {lane}")
        for s, epoch, index in p.residual_refs():
            head(s, epoch, index)
    for s, c in enumerate(ls.sources):
        if not c.active:
            continue
        share = lane_share(plan.source_records[s], plan.spec.lanes, lane)
        epoch, taken = c.epoch, c.taken
        if c.open and 0 < taken <= share:  # the open document's next pieces come first
            head(s, epoch, plan.lane_sample(s, epoch, lane, taken - 1))
        left = n
        while left > 0:
            if taken >= share:
                if m.sources[s].exhaustion != "repeat" or share == 0:
                    break
                epoch, taken = epoch + 1, 0
            k = min(left, share - taken)
            got = plan.lane_samples(s, epoch, lane, taken, taken + k)
            parts_s.append(np.full(k, s, dtype=np.int64))
            parts_i.append(got)
            taken += k
            left -= k
    if not parts_i:
        return _EMPTY, _EMPTY
    if len(parts_i) == 1:
        return parts_s[0], parts_i[0]
    return np.concatenate(parts_s), np.concatenate(parts_i)
