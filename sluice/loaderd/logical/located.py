"""The compiled fast path's located positions, kept from one call to the next of the same plan.

A call of `fusedmix` needs, per lane and live source, the next sample
positions located: (index, object, record, first token, token count). Those
are pure functions of (source, epoch, lane, position) and of the manifest
and the shards' offsets (verified bytes), so what one call located and did
not draw is still right for the next call: `Carry` keeps each lane's queue
tail and the documents its last pieces read, and `queues` hands them back,
locating only what is not kept (about `AHEAD` calls' worth at a time). This
saved ~2/3 of the per-call Python of a five-source mixture (profiled with
bench/fused_mix.py: 5 sources x 8 lanes of `lane_samples` and one `locate`
per source every call). No byte depends on it: the kernel checks each
queue's epoch and range before it reads it and asks for a refill otherwise.

What is not kept is the shards' mapping: each call maps the objects it
reads again (`ensure_mapped`), so the reads are verified per call as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sluice.loaderd.logical.walk import MIN_BATCH, Aside, Shards

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import Plan

AHEAD = 4  # a fresh queue locates this many calls' expected draws (a kept one serves the next calls)


class Carry:
    """Per (lane, source): (epoch, first position, rows (m, 5) int64) of the last call's queue; per (source,
    epoch, index): the located (object, record, first token, token count) of a document a lane's last piece
    read (its residual's, next call)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], tuple[int, int, np.ndarray]] = {}
        self.docs: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}

    @staticmethod
    def of(plan: Plan) -> Carry:
        """The plan's carry (made on first use)."""
        got = plan.__dict__.get("_fast_carry")
        if got is None:
            got = plan.__dict__["_fast_carry"] = Carry()
        return got

    def keep(self, lanes: list[int], qfirst: np.ndarray, qlen: np.ndarray, qepoch: np.ndarray, qdata: np.ndarray,
             pieces: np.ndarray, counts: np.ndarray) -> None:
        """Keep a call's queues (as the walk left them) and each lane's last piece's document."""
        self.queues = {}
        for i, s in zip(*(a.tolist() for a in np.nonzero(qlen))):
            self.queues[(lanes[i], s)] = (int(qepoch[i, s]), int(qfirst[i, s]), qdata[i, s, :int(qlen[i, s])])
        self.docs = {}
        for i, c in enumerate(counts.tolist()):
            if c:
                s, e, idx, o, r, a, nt = pieces[i, c - 1, :7].tolist()
                self.docs[(s, e, idx)] = (o, r, a, nt)


def queues(plan: Plan, shards: Shards, lanes: list[int], lstates: list[Any], want: int,
           carry: Carry) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per lane and live source, the positions the call is expected to draw (from its open document or its
    cursor, about `want` draws times the source's share of the lane's live weight, with a margin): (qfirst,
    qlen, qepoch, qdata) as `jitkernels.walk` takes them, from `carry` where it covers them, else located
    (`AHEAD` times as far, one `locate` per source)."""
    P, S = len(lanes), len(plan.weights)
    weights = plan.weights
    qfirst, qlen, qepoch = (np.zeros((P, S), dtype=np.int64) for _ in range(3))
    rows: dict[tuple[int, int], np.ndarray] = {}
    fresh: dict[int, list[tuple[int, int, int, int]]] = {}  # s -> (lane index, epoch, lo, hi) to locate
    for i, (lane, ls) in enumerate(zip(lanes, lstates)):
        live_w = sum(w for w, c in zip(weights, ls.sources) if w and c.active)
        if not live_w:
            continue
        shares = plan.lane_shares(lane)
        for s, w in enumerate(weights):
            c = ls.sources[s]
            if not w or not c.active:
                continue
            lo = c.taken - 1 if c.open and c.taken > 0 else c.taken
            hi = min(shares[s], c.taken + MIN_BATCH // 2 + (want * w * 3) // (2 * live_w))
            if hi <= lo:
                continue
            kept = carry.queues.get((lane, s))
            if kept is not None and kept[0] == c.epoch and kept[1] <= lo and hi <= kept[1] + len(kept[2]):
                rows[(i, s)] = kept[2][lo - kept[1]:]
                qfirst[i, s], qepoch[i, s] = lo, c.epoch
            else:
                fresh.setdefault(s, []).append((i, c.epoch, lo, min(shares[s], lo + AHEAD * (hi - lo))))
    for s, where in fresh.items():
        parts = [plan.lane_samples(s, e, lanes[i], lo, hi) for i, e, lo, hi in where]
        idx = np.concatenate(parts) if len(parts) > 1 else parts[0]
        got = np.stack([idx, *shards.arrays(s, idx, False)], axis=1)
        at = 0
        for i, e, lo, hi in where:
            rows[(i, s)] = got[at:at + hi - lo]
            at += hi - lo
            qfirst[i, s], qepoch[i, s] = lo, e
    width = max([len(r) for r in rows.values()] + [MIN_BATCH])
    qdata = np.zeros((P, S, width, 5), dtype=np.int64)
    for (i, s), r in rows.items():
        qdata[i, s, :len(r)] = r
        qlen[i, s] = len(r)
    return qfirst, qlen, qepoch, qdata


def ensure_mapped(shards: Shards, objects: list[tuple[int, int]]) -> None:
    """Map the (source, object)s a call reads that it has not mapped yet (the kept queues' and documents'),
    one `docs.mapped` per source; `Aside` where one is not mapped (the per-document read starts it)."""
    missing: dict[int, list[int]] = {}
    for s, o in objects:
        if o not in shards.maps[s]:
            missing.setdefault(s, []).append(o)
    for s, objs in missing.items():
        got = shards.docs.mapped(s, objs)
        if got is None:
            raise Aside
        shards.maps[s].update(got)
