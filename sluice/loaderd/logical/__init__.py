"""Logical plane: what is served, as pure functions (no threads, sockets or timing)."""

from sluice.loaderd.logical.batch import MicroBatch, micro_batches_digest, samples_of
from sluice.loaderd.logical.plan import DocRef, DocTokens, Plan, StepBatch
from sluice.loaderd.logical.state import DataState, LaneState

__all__ = [
    "DataState",
    "DocRef",
    "DocTokens",
    "LaneState",
    "MicroBatch",
    "Plan",
    "StepBatch",
    "micro_batches_digest",
    "samples_of",
]
