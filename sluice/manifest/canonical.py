"""Canonical encoding of manifests: the same logical manifest, the same bytes.

Encoding `sluice-canonical-json/1` (see docs/manifest.md):

* UTF-8 JSON with every non-ASCII character escaped as ``\\uXXXX`` (so the
  bytes are pure ASCII);
* object keys sorted by Unicode code point, no duplicate keys;
* separators ``,`` and ``:`` with no whitespace, no trailing newline;
* values are only objects, arrays, strings, booleans, null and integers in
  [-2**53, 2**53]; floats are refused (weights are decimal strings).

The dataset ID is ``"b3:" + blake3(canonical_bytes).hexdigest()``.
"""

from __future__ import annotations

import json
from typing import Any

import blake3

from sluice.errors import ManifestError

CANONICAL_ENCODING = "sluice-canonical-json/1"
_INT_LIMIT = 2**53


def _check(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -_INT_LIMIT <= value <= _INT_LIMIT:
            raise ManifestError(f"{where}: integer {value} outside the canonical range +-2**53")
        return
    if isinstance(value, float):
        raise ManifestError(
            f"{where}: float {value!r} is not allowed in canonical content; "
            "use a decimal string or an integer"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where}: object key {key!r} is not a string")
            _check(item, f"{where}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
        return
    raise ManifestError(f"{where}: value of type {type(value).__name__} cannot be encoded")


def canonical_bytes(obj: Any) -> bytes:
    """Encode `obj` canonically; raises ManifestError on floats or odd types."""
    _check(obj, "$")
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def digest_id(data: bytes) -> str:
    """`b3:` + hex BLAKE3 of `data`."""
    return "b3:" + blake3.blake3(data).hexdigest()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ManifestError(f"duplicate key {key!r} in manifest JSON")
        out[key] = value
    return out


def _refuse_float(text: str) -> Any:
    raise ManifestError(f"float {text} in manifest JSON; canonical content has no floats")


def parse_json(data: bytes, where: str) -> Any:
    """Parse manifest JSON strictly (no duplicate keys, no floats, no NaN)."""
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_float=_refuse_float,
            parse_constant=_refuse_float,
        )
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: not UTF-8 ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    except RecursionError as exc:
        raise ManifestError(f"{where}: JSON nested too deeply") from exc
    except ManifestError as exc:  # a duplicate key or a float, raised by the hooks
        raise ManifestError(f"{where}: {exc}") from exc
    except ValueError as exc:  # an integer beyond Python's 4300-digit conversion limit
        raise ManifestError(f"{where}: not valid JSON: {exc}") from exc
