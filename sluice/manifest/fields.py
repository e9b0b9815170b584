"""Field validators of the manifest reader: types, ranges, digests, weights.

Every check names the field (`where`) and the bad value, and refuses rather
than guesses: unknown keys, loose digests, out-of-range numbers and inexact
weights are ManifestErrors. The bounds are stated here once.
"""

from __future__ import annotations

import re
from typing import Any

from sluice.errors import ManifestError

# Upper bounds, checked at freeze and at load (a typo must fail at once, not
# run out of memory or overflow an int32 later).
MAX_SEQ_LEN = 1 << 20  # tokens per packed sequence
MAX_WINDOW = 1 << 12  # open bestfit bins per lane
MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32
MAX_COUNT = 1 << 53  # sizes, record counts and offsets: exact in every JSON reader
MAX_WEIGHT_CHARS = 64  # a weight is exact or refused, never rounded
_HEX64 = re.compile(r"[0-9a-f]{64}")
_LINEAGE_KEYS = ("raw", "tokenizer", "transform")


def refuse_unknown(obj: dict[str, Any], known: tuple[str, ...] | set[str], where: str) -> None:
    """Refuse keys this reader does not know: dropping them would change what the bytes mean."""
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {str(unknown)[:200]} (written by a newer sluice?); known: {sorted(known)}")


def req(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) and typ is int:
        raise ManifestError(f"{where}.{key}: expected integer, got boolean")
    if not isinstance(value, typ):
        raise ManifestError(f"{where}.{key}: expected {getattr(typ, '__name__', typ)}, got {value!r:.80}")
    return value


def str_list(obj: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    items = req(obj, key, list, where)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ManifestError(f"{where}.{key}[{i}]: expected a string, got {item!r:.80}")
    return tuple(items)


def opt(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    if key not in obj or obj[key] is None:
        return default
    return req(obj, key, typ, where)


def choice(value: str, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise ManifestError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


def is_digest(value: Any) -> bool:
    """True for exactly `b3:` + 64 lowercase hex digits (no spaces, signs, `0x` or `_`)."""
    return isinstance(value, str) and len(value) == 67 and value.startswith("b3:") and _HEX64.fullmatch(value, 3) is not None


def digest(value: str, where: str) -> str:
    if not is_digest(value):
        raise ManifestError(f"{where}: {value!r:.80} is not a digest of the form b3:<64 lowercase hex>")
    return value


def location(value: str, where: str) -> str:
    """`value` if it can name a file or URI; a NUL cannot (the OS refuses such a path, and
    every reader of the object would fail with a bare ValueError): ManifestError naming `where`."""
    if "\x00" in value:
        raise ManifestError(f"{where}: {value!r:.120} contains a NUL character; no file or URI can be named so")
    return value


def nonneg(value: int, where: str, upper: int = MAX_COUNT) -> int:
    if not 0 <= value <= upper:
        raise ManifestError(f"{where}: must be in [0, {upper}], got {value}")
    return value


def lineage(value: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """A derived object's lineage: `tokenizer` and optional `raw` digests, a `transform` name."""
    if value is None:
        return None
    refuse_unknown(value, _LINEAGE_KEYS, where)
    for key in ("raw", "tokenizer"):
        if key in value and value[key] is not None:
            digest(value[key], f"{where}.{key}")
    if "transform" in value and not isinstance(value["transform"], str):
        raise ManifestError(f"{where}.transform: expected a string, got {value['transform']!r:.80}")
    return value


def normalize_weight(text: Any, where: str) -> str:
    """Validate a weight given as a decimal string and return its canonical form.

    "0.70" and "0.7" are the same weight and normalize to "0.7"; floats, negative
    values, exponents, NaN and infinity are refused. The normal form is computed
    on the digits themselves, so it is exact for any length (Decimal's context
    would round to 28 digits); weights longer than MAX_WEIGHT_CHARS are refused.
    """
    if not isinstance(text, str):
        raise ManifestError(
            f"{where}: weight must be a decimal string such as \"0.7\", got {text!r} "
            "(floats are not allowed: they do not hash the same everywhere)"
        )
    stripped = text.strip()
    if len(stripped) > MAX_WEIGHT_CHARS:
        raise ManifestError(
            f"{where}: weight {text:.40}... has {len(stripped)} characters, more than {MAX_WEIGHT_CHARS}"
        )
    if (not stripped or any(c not in "0123456789." for c in stripped) or stripped.count(".") > 1
            or stripped == "."):
        raise ManifestError(f"{where}: weight {text!r:.80} is not a plain non-negative decimal like \"0.25\"")
    whole, _, frac = stripped.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    return f"{whole}.{frac}" if frac else whole
