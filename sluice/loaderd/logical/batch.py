"""Micro-batches: the arrays a replica trains on for one step, and their digest.

Digest (``micro_batches_digest``): hex BLAKE3 over, for each micro-batch in
order, the little-endian int32 bytes of input_ids, labels, position_ids and
cu_seqlens, in that order. `sluice plan`, `sluice peek` and the tests compare
these digests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice.batcharrays import PACKED
from sluice.loaderd.logical.packing import Row
from sluice.wire.protocol import ARRAY_ORDER, arrays_digest  # one definition, shared with the client

__all__ = ["ARRAY_ORDER", "MicroBatch", "arrays_digest", "micro_batches_digest", "samples_of"]


@dataclass(frozen=True)
class MicroBatch:
    step: int
    replica: int
    micro: int
    input_ids: np.ndarray  # int32 [micro_batch, seq_len]
    labels: np.ndarray  # int32 [micro_batch, seq_len], pre-shifted targets, -100 = no loss
    position_ids: np.ndarray  # int32 [micro_batch, seq_len]
    cu_seqlens: np.ndarray  # int32 [segments + 1], offsets into the flattened micro-batch
    segments: tuple[tuple[tuple[str, int, int], ...], ...]  # per row: (sample_id, start, end)

    @property
    def samples(self) -> tuple[str, ...]:
        """Sample IDs in order of first appearance."""
        seen: dict[str, None] = {}
        for row in self.segments:
            for sid, _, _ in row:
                seen.setdefault(sid, None)
        return tuple(seen)

    def arrays(self) -> dict[str, np.ndarray]:
        """The packer's arrays (`batcharrays.PACKED`) by name; the producer adds the derived ones."""
        return {name: getattr(self, name) for name in PACKED}

    @classmethod
    def from_rows(cls, step: int, replica: int, micro: int, rows: list[Row]) -> MicroBatch:
        """The micro-batch of `rows` (their arrays stacked)."""
        seqlens = [n for r in rows for n in r.seqlens]
        cu = np.zeros(len(seqlens) + 1, dtype=np.int32)
        np.cumsum(seqlens, out=cu[1:])
        return cls(
            step=step,
            replica=replica,
            micro=micro,
            input_ids=np.stack([r.input_ids for r in rows]),
            labels=np.stack([r.labels for r in rows]),
            position_ids=np.stack([r.position_ids for r in rows]),
            cu_seqlens=cu,
            segments=tuple(r.segments for r in rows),
        )


def micro_batches(step: int, replica: int, rows: list[Row], micro_batch: int) -> list[MicroBatch]:
    """`rows` cut into micro-batches of `micro_batch` rows."""
    return [MicroBatch.from_rows(step, replica, i, rows[j:j + micro_batch])
            for i, j in enumerate(range(0, len(rows), micro_batch))]


def micro_batches_digest(mbs: list[MicroBatch]) -> str:
    return arrays_digest([m.arrays() for m in mbs])


def samples_of(mbs: list[MicroBatch]) -> list[str]:
    """Sample IDs of a replica's step in order of first appearance."""
    seen: dict[str, None] = {}
    for m in mbs:
        for sid in m.samples:
            seen.setdefault(sid, None)
    return list(seen)
