"""The dataset spec (TOML): what to freeze into a manifest.

```toml
name = "demo"
tokenizer = "tokenizer.json"      # relative paths resolve against this file's folder
# tokenizer_backend = "auto"  # or "fastokens", "tokie", "tiktoken"; default "hf" (tokenizers); see docs/tokenize.md
access = "internal"               # free-form access scope, recorded in the manifest
[notes]                           # free provenance notes (strings)
origin = "stdlib sources"
[packing]
seq_len = 512
algorithm = "concat"              # or "bestfit"
eos = "<|endoftext|>"             # token string (needs the tokenizer) ...
# eos_id = 0                      # ... or integer id (same for bos/bos_id, pad/pad_id)
separator = "eos"                 # eos | bos | bos_eos | none
window = 8                        # open bins for bestfit
loss_mask = "all"                 # all | exclude_separator
[mixture]
policy = "quota"                  # or "categorical"
unit = "tokens"                   # documents | tokens | loss_tokens | sequences
# piece_tokens = 512              # token units: tokens per draw at most (default seq_len; 0 = whole documents)
[[sources]]
name = "code"
paths = ["shards/code-*.jsonl.zst"]
format = "jsonl"                  # jsonl (.gz/.zst by suffix) | parquet | webdataset | tokens
text_field = "text"               # column for parquet, member suffix for webdataset
weight = "0.7"                    # decimal string
exhaustion = "repeat"             # stop | repeat | renormalize | fail
split = "train"
filters = ["lang=py"]
dedup = "none"
notes = "python files"
```

`load_dataset_spec` validates every key and names the file and the field on
error (SpecError). Token strings (eos = "...") stay strings here; `freeze`
resolves them to ids with the tokenizer (`packing_policy`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.errors import ManifestError, SpecError
from sluice.manifest.fields import normalize_weight
from sluice.manifest.inputs import MAX_SPEC_BYTES, parse_toml, read_input
from sluice.manifest.policies import PIECE_UNITS, TOKENIZER_BACKENDS, MixturePolicy, PackingPolicy
from sluice.manifest.remote import check_url
from sluice.manifest.sources import EXHAUSTION_RULES, FORMATS
from sluice.manifest.storage import is_remote

# Default text field per format: a JSON key / parquet column / tar member suffix.
DEFAULT_TEXT_FIELD = {"jsonl": "text", "parquet": "text", "webdataset": "txt", "tokens": ""}

_TOP_KEYS = {"name", "tokenizer", "tokenizer_backend", "access", "notes", "packing", "mixture", "sources"}
_SOURCE_KEYS = {
    "name", "paths", "format", "text_field", "weight", "exhaustion", "split", "filters", "dedup", "notes",
}
_PACKING_KEYS = {
    "seq_len", "algorithm", "eos", "eos_id", "bos", "bos_id", "pad", "pad_id", "separator", "window", "loss_mask",
}
_MIXTURE_KEYS = {"policy", "unit", "piece_tokens"}


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """One `[[sources]]` entry. `paths` are as written (the aliases); `resolved`
    are the same paths made absolute against the spec's folder (URIs kept, checked: remote.check_url)."""

    name: str
    paths: tuple[str, ...]
    resolved: tuple[str, ...]
    format: str
    text_field: str
    weight: str
    exhaustion: str
    split: str = "train"
    filters: tuple[str, ...] = ()
    dedup: str = "none"
    notes: str = ""


@dataclass(frozen=True, kw_only=True)
class PackingSpec:
    """The `[packing]` table; special tokens as ids (int) or token strings (str)."""

    seq_len: int
    algorithm: str = "concat"
    eos: int | str | None = None
    bos: int | str | None = None
    pad: int | str | None = None
    separator: str | None = None  # None: derived from which of eos/bos are given
    window: int = 8
    loss_mask: str = "all"

    @property
    def needs_tokenizer(self) -> bool:
        return any(isinstance(v, str) for v in (self.eos, self.bos, self.pad))


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    path: str
    name: str
    tokenizer: str | None  # absolute path
    packing: PackingSpec
    mixture: MixturePolicy
    sources: tuple[SourceSpec, ...]
    access: str = "private"
    notes: dict[str, str] = field(default_factory=dict)
    # part of the tokenizer identity (TokenizerRef.backend); "auto": freeze records the fastest proven one
    tokenizer_backend: str = "hf"

    @property
    def base_dir(self) -> str:
        return str(Path(self.path).parent)


def _fail(path: str, where: str, message: str) -> SpecError:
    return SpecError(f"dataset spec {path}: {where}: {message}")


def _get(table: dict[str, Any], key: str, typ: type, path: str, where: str, default: Any = ...) -> Any:
    if key not in table:
        if default is ...:
            raise _fail(path, f"{where}{key}", "missing (required)")
        return default
    value = table[key]
    if isinstance(value, bool) and typ is not bool:
        raise _fail(path, f"{where}{key}", f"expected {typ.__name__}, got boolean {value!r}")
    if not isinstance(value, typ):
        raise _fail(path, f"{where}{key}", f"expected {typ.__name__}, got {type(value).__name__} {value!r:.80}")
    return value


def _unknown(table: dict[str, Any], known: set[str], path: str, where: str) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise _fail(path, where or "top level", f"unknown key(s) {extra}; known: {sorted(known)}")


def _resolve_path(raw: str, base: Path) -> str:
    if is_remote(raw):
        return raw
    p = Path(os.path.expanduser(raw))
    # No os.path.realpath here: symlinks and pointer files are resolved (and
    # recorded) by freeze, which must see the alias itself.
    return os.path.normpath(p if p.is_absolute() else base / p)


def _special(table: dict[str, Any], name: str, path: str) -> int | str | None:
    has_str, has_id = name in table, f"{name}_id" in table
    if has_str and has_id:
        raise _fail(path, f"packing.{name}", f"give either {name} (token string) or {name}_id (integer), not both")
    if has_id:
        value = _get(table, f"{name}_id", int, path, "packing.")
        if value < 0:
            raise _fail(path, f"packing.{name}_id", f"must be >= 0, got {value}")
        return value
    if has_str:
        value = table[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _fail(path, f"packing.{name}", f"expected a token string or integer id, got {value!r}")
        if isinstance(value, str) and not value:
            raise _fail(path, f"packing.{name}", "empty token string")
        return value
    return None


def _mixture(mix: dict[str, Any], seq_len: int, where: str) -> MixturePolicy:
    """The `[mixture]` table. Token units default to piece draws of seq_len tokens (`piece_tokens`; 0 = whole
    documents): the quota then holds every source within one row's tokens of its share (docs/logical.md)."""
    _unknown(mix, _MIXTURE_KEYS, where, "mixture")
    unit = _get(mix, "unit", str, where, "mixture.", "documents")
    pieces = _get(mix, "piece_tokens", int, where, "mixture.", seq_len if unit in PIECE_UNITS else 0)
    if pieces == 0:
        pieces = None
    try:
        return MixturePolicy(policy=_get(mix, "policy", str, where, "mixture.", "quota"), unit=unit,
                             piece_tokens=pieces)
    except ManifestError as exc:
        raise SpecError(f"dataset spec {where}: {exc}") from exc


def _packing(table: Any, path: str) -> PackingSpec:
    if not isinstance(table, dict):
        raise _fail(path, "packing", "missing [packing] table (seq_len is required)")
    _unknown(table, _PACKING_KEYS, path, "packing")
    spec = PackingSpec(
        seq_len=_get(table, "seq_len", int, path, "packing."),
        algorithm=_get(table, "algorithm", str, path, "packing.", "concat"),
        eos=_special(table, "eos", path),
        bos=_special(table, "bos", path),
        pad=_special(table, "pad", path),
        separator=_get(table, "separator", str, path, "packing.", None),
        window=_get(table, "window", int, path, "packing.", 8),
        loss_mask=_get(table, "loss_mask", str, path, "packing.", "all"),
    )
    # Validate choices and ranges now (before any hashing) with placeholder ids.
    packing_policy(spec, lambda _s: 0, path)
    return spec


def packing_policy(spec: PackingSpec, token_to_id: Callable[[str], int | None], path: str) -> PackingPolicy:
    """Build the manifest's PackingPolicy, resolving token strings with `token_to_id`.

    Separator default: "bos_eos" if both eos and bos are given, "eos" if only eos,
    "bos" if only bos, "none" otherwise.
    """
    ids: dict[str, int | None] = {}
    for name in ("eos", "bos", "pad"):
        value = getattr(spec, name)
        if isinstance(value, str):
            tid = token_to_id(value)
            if tid is None:
                raise _fail(path, f"packing.{name}", f"token {value!r} is not in the tokenizer's vocabulary")
            value = tid
        ids[name] = value
    separator = spec.separator
    if separator is None:
        eos, bos = ids["eos"] is not None, ids["bos"] is not None
        separator = "bos_eos" if eos and bos else "eos" if eos else "bos" if bos else "none"
    try:
        return PackingPolicy(
            seq_len=spec.seq_len,
            algorithm=spec.algorithm,
            eos_id=ids["eos"],
            bos_id=ids["bos"],
            pad_id=ids["pad"] if ids["pad"] is not None else 0,
            separator=separator,
            window=spec.window,
            loss_mask=spec.loss_mask,
        )
    except ManifestError as exc:
        raise SpecError(f"dataset spec {path}: {exc}") from exc


def _source(i: int, table: Any, path: str, base: Path) -> SourceSpec:
    where = f"sources[{i}]"
    if not isinstance(table, dict):
        raise _fail(path, where, "each [[sources]] entry must be a table")
    name = _get(table, "name", str, path, f"{where}.")
    if not name:
        raise _fail(path, f"{where}.name", "empty")
    where = f"sources[{i}]({name})"
    _unknown(table, _SOURCE_KEYS, path, where)
    raw_paths = table.get("paths")
    if isinstance(raw_paths, str):
        raw_paths = [raw_paths]
    if not isinstance(raw_paths, list) or not raw_paths or not all(isinstance(p, str) and p for p in raw_paths):
        raise _fail(path, f"{where}.paths", f"expected a non-empty list of path strings, got {raw_paths!r}")
    for raw in raw_paths:
        if not raw.startswith("s3://") and is_remote(raw):
            check_url(raw, f"dataset spec {path}: {where}.paths", SpecError)
    fmt = _get(table, "format", str, path, f"{where}.")
    if fmt not in FORMATS:
        raise _fail(path, f"{where}.format", f"unknown format {fmt!r}; known: {', '.join(FORMATS)} "
                    "(compression of jsonl is taken from the .gz/.zst suffix)")
    weight = table.get("weight", "1")
    if isinstance(weight, int) and not isinstance(weight, bool):
        weight = str(weight)  # TOML integer 1 is exact; floats are refused by normalize_weight
    try:
        weight = normalize_weight(weight, f"{where}.weight")
    except ManifestError as exc:
        raise SpecError(f"dataset spec {path}: {exc}") from exc
    exhaustion = _get(table, "exhaustion", str, path, f"{where}.", "stop")
    if exhaustion not in EXHAUSTION_RULES:
        raise _fail(path, f"{where}.exhaustion", f"{exhaustion!r} is not one of {', '.join(EXHAUSTION_RULES)}")
    filters = _get(table, "filters", list, path, f"{where}.", [])
    if not all(isinstance(f, str) for f in filters):
        raise _fail(path, f"{where}.filters", "expected a list of strings")
    return SourceSpec(
        name=name,
        paths=tuple(raw_paths),
        resolved=tuple(_resolve_path(p, base) for p in raw_paths),
        format=fmt,
        text_field=_get(table, "text_field", str, path, f"{where}.", DEFAULT_TEXT_FIELD[fmt]),
        weight=weight,
        exhaustion=exhaustion,
        split=_get(table, "split", str, path, f"{where}.", "train"),
        filters=tuple(filters),
        dedup=_get(table, "dedup", str, path, f"{where}.", "none"),
        notes=_get(table, "notes", str, path, f"{where}.", ""),
    )


def load_dataset_spec(path: str | os.PathLike[str]) -> DatasetSpec:
    """Read and validate a dataset spec; raises SpecError naming file and field."""
    p = Path(path)
    where = str(p)
    doc = parse_toml(read_input(p, "dataset spec", MAX_SPEC_BYTES, SpecError), f"dataset spec {where}", SpecError)
    base = p.resolve().parent
    _unknown(doc, _TOP_KEYS, where, "")
    name = _get(doc, "name", str, where, "")
    tok = _get(doc, "tokenizer", str, where, "", None)
    backend = _get(doc, "tokenizer_backend", str, where, "", "hf")
    if backend not in (*TOKENIZER_BACKENDS, "auto"):
        raise _fail(where, "tokenizer_backend", f"{backend!r} is not one of {', '.join(TOKENIZER_BACKENDS)}, auto")
    if tok is not None and is_remote(tok):
        raise _fail(where, "tokenizer", f"{tok!r:.200} is a URL; the tokenizer must be a local file "
                    "(its digest is checked against the file sluice loads)")
    if backend != "hf" and tok is None:
        raise _fail(where, "tokenizer_backend", "a backend needs a `tokenizer`")
    notes = _get(doc, "notes", dict, where, "", {})
    for k, v in notes.items():
        if not isinstance(v, str):
            raise _fail(where, f"notes.{k}", f"expected a string, got {v!r}")
    packing = _packing(doc.get("packing"), where)
    mixture = _mixture(_get(doc, "mixture", dict, where, "", {}), packing.seq_len, where)
    if packing.needs_tokenizer and tok is None:
        raise _fail(where, "packing", "special tokens given as strings need a `tokenizer` to resolve them")
    raw_sources = doc.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise _fail(where, "sources", "at least one [[sources]] entry is required")
    sources = tuple(_source(i, s, where, base) for i, s in enumerate(raw_sources))
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _fail(where, "sources", f"duplicate source name(s) {dupes}")
    if all(Decimal(s.weight) == 0 for s in sources):
        raise _fail(where, "sources[*].weight", "all weights are zero; at least one must be positive")
    return DatasetSpec(
        path=str(p.resolve()),
        name=name,
        tokenizer=_resolve_path(tok, base) if tok is not None else None,
        packing=packing,
        mixture=mixture,
        sources=sources,
        access=_get(doc, "access", str, where, "", "private"),
        notes=dict(notes),
        tokenizer_backend=backend,
    )
