"""The fast path's view of the mapped token shards: where a sample lies, and `Aside`.

`Shards.locate` / `arrays` answer, for a source's sample indices, the
object, record, first token and token count of each (one `searchsorted` a
batch over the plan's object starts, then the mapped shards' offsets), mapping
the objects they touch through the documents callback (`docs.mapped`). The
kernels' walks take these located positions as their queues
(`located.queues`, `fusedmix.refill`). Where an object is not mapped (its
tokens are being made from text, or failed) or a record lies past its shard,
`Aside` is raised: the fast path stands aside and `Plan.step` meets the case
with its own error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import Plan

MIN_BATCH = 8  # positions a queue's refill locates at least
REFILL_MAX = 1024  # positions a refill of a lane's queue locates at most (`fusedmix.refill`)


class Aside(Exception):
    """The call cannot be computed on the fast path: `Plan.step` takes it (internal to the fast path's modules;
    `fast.fast_steps` never lets it out)."""


class Shards:
    """The call's view of the mapped shards: per source, object -> (offsets, tokens, records), and where a
    sample index lies (object, record, first token, token count)."""

    def __init__(self, plan: Plan, docs: Any) -> None:
        self.plan, self.docs = plan, docs
        self.maps: list[dict[int, Any]] = [{} for _ in plan.weights]

    def locate(self, s: int, idx: np.ndarray, check: bool = True) -> tuple[list[int], list[int], list[int], list[int]]:
        """(objects, records, first tokens, token counts) of source s's sample indices `idx` (int64; `check`:
        that they lie in the source, where they do not come from its order)."""
        return tuple(a.tolist() for a in self.arrays(s, idx, check))  # type: ignore[return-value]

    def arrays(self, s: int, idx: np.ndarray, check: bool = True) -> tuple[np.ndarray, ...]:
        """`locate` as int64 arrays."""
        if check and len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.plan.source_records[s]):
            raise Aside  # outside the source: Plan.step names it
        starts, ids = self.plan._starts_np[s]
        kk = starts.searchsorted(idx, side="right") - 1
        objs = ids[kk]
        recs = idx - starts[kk]
        maps = self.maps[s]
        k0, k1 = (int(kk.min()), int(kk.max())) if len(kk) > 64 else (0, 1 << 62)
        if k1 - k0 < 4096:  # (the objects present, from a count over the few they span: no list of every index)
            uniq = set(ids[np.flatnonzero(np.bincount(kk - k0)) + k0].tolist())
        else:
            uniq = set(objs.tolist())
        missing = [o for o in uniq if o not in maps]
        if missing:
            got = self.docs.mapped(s, missing)
            if got is None:
                raise Aside  # being made from text (or failed): the per-document read meets it
            maps.update(got)
        tstart = np.empty(len(idx), dtype=np.int64)
        ntok = np.empty(len(idx), dtype=np.int64)
        for o in uniq:
            offsets, _, records = maps[o]
            m = objs == o if len(uniq) > 1 else slice(None)
            r = recs[m]
            if len(r) and int(r.max()) >= records:
                raise Aside  # past the shard's end: the per-document read names it
            a = offsets[r].astype(np.int64)
            tstart[m] = a
            ntok[m] = offsets[r + 1].astype(np.int64) - a
        return objs, recs, tstart, ntok
