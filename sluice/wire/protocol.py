"""What a wire message is: the protocol version, the message kinds, the header's fields, the dtypes and
the BATCH arrays, the receiver's limits, and the `Header` and `Message` types (docs/protocol.md).

`encoding` writes messages of these types, `decoding` reads and checks them; `errorcodes` holds the
ERROR reply's codes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sluice import batcharrays

PROTOCOL_VERSION = 1

# Message kinds. Client -> daemon requests and the daemon's replies.
HELLO = "HELLO"
HELLO_OK = "HELLO_OK"
GET = "GET"
BATCH = "BATCH"
RESTORE = "RESTORE"
RESTORE_OK = "RESTORE_OK"
COMMIT = "COMMIT"
COMMIT_OK = "COMMIT_OK"
STATS = "STATS"
STATS_OK = "STATS_OK"
ERROR = "ERROR"
RING = "RING"  # a new ring for this connection, sent before the BATCH that uses it (docs/protocol.md, "Ring")

REQUEST_KINDS = (HELLO, GET, RESTORE, COMMIT, STATS)
REPLY_KINDS = (HELLO_OK, BATCH, RESTORE_OK, COMMIT_OK, STATS_OK, ERROR, RING)
KINDS = REQUEST_KINDS + REPLY_KINDS

# The only dtypes on the wire (numpy dtype strings, explicitly little-endian).
DTYPES = ("<i4", "<u4", "<i8", "<u2", "|u1", "<f4")

HEADER_KEYS = (
    "proto", "kind", "run_id", "dataset_id", "generation", "replica", "step", "micro",
    "request_id", "instance", "arrays", "body",
)

# The arrays of a BATCH, in order, and those of the step digest, in its order: declared in sluice/batcharrays.py.
BATCH_ARRAYS = batcharrays.NAMES
ARRAY_ORDER = batcharrays.DIGESTED


def arrays_digest(arrays_in_order: Sequence[Mapping[str, Any]]) -> str:
    """Hex BLAKE3 over each mapping's arrays in ARRAY_ORDER, as little-endian int32.

    The micro-batches digest that `sluice plan`, `sluice peek` and the tests
    compare (docs/protocol.md).
    """
    import blake3

    h = blake3.blake3()
    for arrays in arrays_in_order:
        for name in ARRAY_ORDER:
            h.update(np.ascontiguousarray(arrays[name], dtype="<i4").tobytes())
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Receiver-side bounds; anything beyond them is refused before parsing.

    Defaults fit the daemon receiving requests (headers only; RESTORE carries
    lane states in its header). Clients use `Limits.for_client()`.
    """

    max_header_bytes: int = 4 << 20
    max_frames: int = 8
    max_frame_bytes: int = 4 << 20

    @classmethod
    def for_client(cls) -> Limits:
        return cls(max_header_bytes=16 << 20, max_frames=16, max_frame_bytes=1 << 31)


@dataclass(frozen=True, kw_only=True)
class Header:
    """The parsed frame-0 header; `body` holds the kind-specific fields."""

    kind: str
    run_id: str = ""
    dataset_id: str = ""
    generation: int = 0
    replica: int = -1
    step: int = -1
    micro: int = -1
    request_id: int = 0
    instance: str = ""
    body: Mapping[str, Any] = field(default_factory=dict)
    arrays: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def to_obj(self) -> dict[str, Any]:
        return {
            "proto": PROTOCOL_VERSION,
            "kind": self.kind,
            "run_id": self.run_id,
            "dataset_id": self.dataset_id,
            "generation": self.generation,
            "replica": self.replica,
            "step": self.step,
            "micro": self.micro,
            "request_id": self.request_id,
            "instance": self.instance,
            "arrays": [{"name": n, "dtype": d, "shape": list(s)} for n, d, s in self.arrays],
            "body": dict(self.body),
        }


@dataclass(frozen=True)
class Message:
    """A received message: its header and numpy views on the array frames."""

    header: Header
    arrays: dict[str, np.ndarray]

    @property
    def kind(self) -> str:
        return self.header.kind

    @property
    def body(self) -> Mapping[str, Any]:
        return self.header.body
