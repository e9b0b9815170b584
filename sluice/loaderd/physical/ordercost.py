"""Is the run's order affordable over raw objects? Estimated at start, refused with the numbers if not.

A global (Feistel) order draws every document of a step from anywhere in the
source, so over raw compressed objects (jsonl.zst, parquet, tar) a window of
steps touches many objects, and each touched object must be read, decoded and
tokenized while its documents are needed. When those objects do not fit the
decode budget (`--decoded-bytes`), every step decodes objects again and the
daemon thrashes instead of serving. This module estimates that at start:

    documents per lane-step  ~ per_lane * seq_len / (tokens per document) + 1
        tokens per document  ~ object bytes per record / BYTES_PER_TOKEN (compressed bytes: an
                               underestimate of the text, so more documents, so more objects)
    objects touched          = the distinct objects of the documents the window's positions of the
                               epoch-0 order hold (computed exactly from the order, per lane and source,
                               sources in proportion to their weights)
    bytes to decode          ~ sum of those objects' sizes (tokens take about as many bytes as
                               the text they came from; compressed objects decode to more)

and refuses with `OrderCostError` naming the numbers and the two ways out when
the bytes exceed the budget. Objects whose tokens are already in the node cache
cost nothing to decode and are not counted; pre-tokenized sources, `order =
"block"` and `order = "none"` are never refused. docs/logical.md says which
order to choose for which corpus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.errors import OrderCostError
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.order import lane_share
from sluice.npsets import sorted_unique

BYTES_PER_TOKEN = 4.0
SAMPLE_LIMIT = 1 << 16  # positions evaluated per (lane, source) at most: the estimate stays cheap


@dataclass(frozen=True)
class OrderCost:
    """What a window of `window_steps` steps reads under the run's order."""

    window_steps: int
    objects: int  # distinct raw objects touched whose tokens are not cached
    bytes: int  # their total size
    per_source: tuple[tuple[str, int, int], ...]  # (source, objects touched, objects in source)

    def fits(self, budget: int) -> bool:
        return self.bytes <= budget


def estimate(plan: Plan, window_steps: int, cached: Any = None) -> OrderCost:
    """Objects (not token-cached) the first `window_steps` steps touch, from the epoch-0 order.

    `cached(s, o) -> bool` says whether object o of source s has its tokens in
    the node cache (those are read at memory speed and not counted).
    """
    m = plan.manifest
    spec = plan.spec
    L = m.packing.seq_len
    weights = [int(w) for w in plan.weights]
    total_w = sum(weights) or 1
    touched: dict[int, set[int]] = {}
    for s, src in enumerate(m.sources):
        if src.format == "tokens" or not weights[s] or not src.objects:
            continue
        records = max(1, plan.source_records[s])
        bytes_per_record = sum(o.size for o in src.objects) / records
        tokens_per_doc = max(1.0, bytes_per_record / BYTES_PER_TOKEN)
        docs = math.ceil((spec.per_lane * L / tokens_per_doc + 1) * window_steps * weights[s] / total_w)
        starts = np.asarray([o.start for o in src.objects], dtype=np.int64)
        seen = touched.setdefault(s, set())
        for lane in range(spec.lanes):
            share = lane_share(plan.source_records[s], spec.lanes, lane)
            n = min(docs, share, SAMPLE_LIMIT)
            if n <= 0:
                continue
            idx = plan.lane_samples(s, 0, lane, 0, n)
            objs = np.searchsorted(starts, idx, side="right") - 1
            seen.update(int(o) for o in sorted_unique(objs) if src.objects[int(o)].records)
            if len(seen) == len(src.objects):
                break
    objects = 0
    size = 0
    per_source = []
    for s, seen in touched.items():
        src = m.sources[s]
        cold = [o for o in seen if cached is None or not cached(s, o)]
        objects += len(cold)
        size += sum(src.objects[o].size for o in cold)
        per_source.append((src.name, len(cold), len(src.objects)))
    return OrderCost(window_steps, objects, size, tuple(per_source))


def check(plan: Plan, window_steps: int, budget: int, cached: Any = None) -> OrderCost | None:
    """Refuse (OrderCostError) a global order over raw objects whose window exceeds `budget`.

    Returns the estimate when one was made (global order with raw sources), else None.
    """
    if plan.spec.order != "global" or all(src.format == "tokens" for src in plan.manifest.sources):
        return None
    cost = estimate(plan, window_steps, cached)
    if not cost.fits(budget):
        # (the daemon's window is its step lead: a shorter lead is a way out too; `sluice plan` checks one step)
        lead = "" if cost.window_steps <= 1 else \
            f", or a smaller loaderd --lead-steps (the window; now {cost.window_steps})"
        worst = ", ".join(f"{name!r} {n} of {total}" for name, n, total in cost.per_source if n)
        raise OrderCostError(
            f'order = "global" over raw objects: a window of {cost.window_steps} step(s) touches about '
            f"{cost.objects} objects ({worst}; {_size(cost.bytes)} to read, decode and tokenize), more than the "
            f"decode budget of {_size(budget)} (loaderd --decoded-bytes); every step would decode objects again. Either "
            f"put the tokens in the node cache first (`sluice cache warm --tokens MANIFEST CACHE_DIR`, or ship "
            f'pre-tokenized shards with `sluice tokenize pretokenize`), or set order = "block" in the run spec '
            f"(reads block_window objects at a time){lead}. docs/logical.md: which order for which corpus."
        )
    return cost


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
