"""`DocRef`: a document's identity in the logical plane (a leaf module: plan.py and the physical plane's
readers use it without importing each other)."""

from __future__ import annotations

from typing import NamedTuple


class DocRef(NamedTuple):
    """A document's identity: where it sits in the order and in the manifest.

    A NamedTuple (immutable, and cheap to create once per document drawn).
    """

    source: int
    epoch: int
    index: int  # sample index within the source, [0, records)
    obj: int  # object index within the source
    record: int  # record index within the object
    sample_id: str
