"""The bounded step queue of one replica, and what it holds.

A `StepEntry` is what the daemon serves for one (replica, step): the
micro-batches (or a terminal error) and the data state after the step. The
`StepQueue` holds the entries a producer made ahead of the consumer, bounded by
bytes and by steps; the producer blocks at the bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepEntry:
    """What the daemon serves for one (replica, step): micro-batches or a terminal error."""

    step: int
    micros: list[dict[str, np.ndarray]]
    samples: list[list[str]]
    state: dict[str, Any] | None  # DataState.subset(lanes).state_dict() after this step
    nbytes: int
    created: float
    error: tuple[str, str, dict[str, Any]] | None = None  # (code, message, extra body fields)
    delivered: list[set[bytes]] = field(default_factory=list)
    # Pre-encoded header parts (wire.json_bytes), made by the producer so the IO
    # thread never re-encodes them per message: the state once per step, the
    # samples once per micro-batch.
    state_json: bytes | None = None
    samples_json: list[bytes] = field(default_factory=list)

    def encode_json(self) -> StepEntry:
        """Fill `state_json` and `samples_json` (call where the entry is made, off the IO thread)."""
        from sluice.wire import json_bytes

        if self.state is not None:
            self.state_json = json_bytes(self.state)
        self.samples_json = [json_bytes(s) for s in self.samples]
        return self

    def released(self, peers: int) -> bool:
        return self.error is None and all(len(d) >= peers for d in self.delivered)


class StepQueue:
    """Assembled steps of one replica, bounded in bytes and in steps (thread-safe).

    Policy at the high watermark: the producer blocks (`wait_room`) until the
    IO thread releases entries or a reset happens. A single entry larger than
    the byte bound is still admitted when the queue is empty, so a too-small
    bound slows the daemon down instead of deadlocking it.
    """

    def __init__(self, max_bytes: int, max_steps: int) -> None:
        self.max_bytes = max_bytes
        self.max_steps = max_steps
        self.entries: OrderedDict[int, StepEntry] = OrderedDict()
        self.nbytes = 0
        self.floor = 0  # lowest step not yet released (the consumer position)
        self.cond = threading.Condition()

    def room_for(self, step: int) -> bool:
        if not self.entries:
            return True
        return self.nbytes < self.max_bytes and step < self.floor + self.max_steps

    def put(self, entry: StepEntry) -> None:
        self.entries[entry.step] = entry
        self.nbytes += entry.nbytes

    def release_upto(self, peers: int) -> int:
        """Drop leading entries that every peer has received; returns how many were dropped."""
        n = 0
        while self.entries:
            step, entry = next(iter(self.entries.items()))
            if not entry.released(peers):
                break
            del self.entries[step]
            self.nbytes -= entry.nbytes
            self.floor = step + 1
            n += 1
        if n:
            self.cond.notify_all()
        return n

    def clear(self, floor: int) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.floor = floor
        self.cond.notify_all()
