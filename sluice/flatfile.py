"""The framing of sluice's flat binary files (derived node-cache objects): a magic, a JSON header, arrays.

Layout, all little-endian::

    magic (8 bytes)  u32 header length  header JSON (UTF-8)  zero pad to 8  payload

The payload (the arrays) starts 8-byte aligned, so readers take numpy views
of it without a copy. Nothing is ever unpickled: the header is JSON checked
field by field against a declared shape, the payload raw numbers. Used by the
cached tiktoken encoding (tokenize/fastcache.py) and the stored line index
(tokenize/lineindexfile.py); each checks its own payload's sizes and digests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_flat(path: str | Path, magic: bytes, header: dict[str, Any], payload: Iterable[bytes]) -> None:
    """Write `header` (compact-enough JSON, sorted keys) and the `payload` parts after it, 8-aligned."""
    body = json.dumps(header, sort_keys=True).encode()
    head = magic + struct.pack("<I", len(body)) + body
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % 8))
        for part in payload:
            f.write(part)


def read_flat(data: bytes, magic: bytes, shape: dict[str, type], *, where: str, fmt: str, max_header: int,
              error: type[Exception]) -> tuple[dict[str, Any], int]:
    """(header, payload offset) of a file `write_flat` wrote, whose header holds exactly the fields of
    `shape` with exactly those types (bool is not int). Raises `error("<where>: ...")` naming what is
    wrong: the magic, a header length past the file or `max_header`, a header that is not JSON, its
    fields. The caller checks the header's values and the payload's length."""
    if data[:8] != magic or len(data) < 12:
        raise error(f"{where}: not a {fmt} file (bad magic)")
    (hlen,) = struct.unpack_from("<I", data, 8)
    if hlen > max_header or 12 + hlen > len(data):
        raise error(f"{where}: header length {hlen} exceeds the file or the limit ({max_header})")
    try:
        header = json.loads(data[12 : 12 + hlen].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise error(f"{where}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict) or set(header) != set(shape) or any(
            type(header[k]) is not t for k, t in shape.items()):
        raise error(f"{where}: header fields are not {sorted(shape)} of the expected types")
    return header, 12 + hlen + (-(12 + hlen) % 8)
