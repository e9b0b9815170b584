"""The sluice wire format: the one package both loaderd and the client import.

Every message is a ZeroMQ multipart message (the daemon's ROUTER adds and strips
the peer identity frame; nothing else is added)::

    frame 0      header: UTF-8 JSON object, at most `Limits.max_header_bytes`
    frame 1..n   raw little-endian array bytes of header["arrays"], in that
                 order: one frame per entry, or several back to back in a
                 frame ("packed", for a client whose GET asks: `decode`
                 maps arrays to frames by their sizes)

The header (protocol `PROTOCOL_VERSION` = 1) always has these keys::

    {"proto": 1, "kind": "GET", "run_id": "r1", "dataset_id": "b3:...",
     "generation": 3, "replica": 0, "step": 12, "micro": 1, "request_id": 7,
     "instance": "", "arrays": [{"name": "input_ids", "dtype": "<i4",
     "shape": [4, 128]}], "body": {...kind-specific...}}

Arrays are sent with ``copy=False`` (ZeroMQ keeps a reference to the numpy
buffer) and received as numpy views on the received frames with
``np.frombuffer``: no byte is copied on either side after the kernel. Only the
dtypes in `DTYPES` exist on the wire; a frame's length must equal
``prod(shape) * itemsize`` exactly.

Nothing here unpickles or evaluates anything: the header is parsed by
``json.loads`` and checked field by field (or, with msgspec installed, by one
typed decode that accepts exactly what those checks accept); arrays are raw
bytes with a whitelisted dtype. Every defect raises `WireError` carrying one of the codes in
`ERROR_CODES`, so the daemon can answer with an ERROR message and count it.
docs/protocol.md documents every kind, field and code; tests/test_wire.py holds
golden header fixtures so a format change cannot slip through.

The modules, one job each:

    protocol     what a message is: version, kinds, header keys, dtypes, BATCH arrays, `Limits`,
                 `Header`, `Message`, and `arrays_digest` over a step's micro-batches
    errorcodes   the ERROR codes, code <-> exception, `error_reply`
    encoding     the sending side: `encode`, `encode_header`, `json_bytes`, `HeaderWriter`, `BatchHeaders`
    decoding     the receiving side: `decode`, `parse_header`, `to_tensors`
    runtoken     the run token: `check_token`, `read_token_file`, `token_matches`

This package itself re-exports what the docs and examples name: `arrays_digest`,
`BATCH_ARRAYS` and `json_bytes`.
"""

from __future__ import annotations

from sluice.wire.encoding import json_bytes
from sluice.wire.protocol import BATCH_ARRAYS, arrays_digest

__all__ = ["BATCH_ARRAYS", "arrays_digest", "json_bytes"]
