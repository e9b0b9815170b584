"""The frozen dataset manifest: what a run reads, bound to exact bytes.

A manifest is a tree of frozen dataclasses with a lossless mapping to the
canonical JSON documented in docs/manifest.md. `Manifest.from_obj` validates
every field and names it on error; `Manifest.to_obj` produces the dict whose
canonical bytes define the dataset ID.

Sample IDs: a record is identified by ``(object digest, record index)``, written
``b3:<hex>:<index>``. For a derived (pre-tokenized) object made 1:1 from a raw
object, the sample key is the raw object's digest, so a document keeps its
identity across pre-tokenization.

Why over 450 lines: this is the whole manifest schema, one dataclass per JSON
object, each validating its own fields in `from_obj`; field parsers and
bounds already live in fields.py, and splitting the classes would scatter one
schema across modules a reader must then reassemble.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.errors import ManifestError
from sluice.manifest.canonical import CANONICAL_ENCODING, canonical_bytes, digest_id, parse_json
from sluice.manifest.inputs import MAX_MANIFEST_BYTES, not_json_hint, read_input
# Bounds, is_digest and normalize_weight are re-exported (spec, freeze and plan_cli import them from here).
from sluice.manifest.fields import MAX_COUNT, MAX_SEQ_LEN, MAX_TOKEN_ID, MAX_WEIGHT_CHARS, MAX_WINDOW  # noqa: F401
from sluice.manifest.fields import choice as _choice, digest as _digest, is_digest, lineage as _lineage  # noqa: F401
from sluice.manifest.fields import location as _location  # noqa: F401
from sluice.manifest.fields import nonneg as _nonneg, normalize_weight, opt as _opt, req as _req  # noqa: F401
from sluice.manifest.fields import refuse_unknown as _known, str_list as _str_list

MANIFEST_SCHEMA = "sluice.manifest/1"
SAMPLE_ID_RULE = "object-digest:record-index/v1"

FORMATS = ("jsonl", "parquet", "webdataset", "tokens")
COMPRESSIONS = ("none", "gzip", "zstd")
EXHAUSTION_RULES = ("stop", "repeat", "renormalize", "fail")
MIXTURE_POLICIES = ("quota", "categorical")
MIXTURE_UNITS = ("documents", "tokens", "loss_tokens", "sequences")
PIECE_UNITS = ("tokens", "loss_tokens")  # units whose quota piece draws make exact in tokens
PACKING_ALGORITHMS = ("concat", "bestfit")
SEPARATORS = ("eos", "bos", "bos_eos", "none")
LOSS_MASKS = ("all", "exclude_separator")

_OBJECT_KEYS = ("location", "digest", "size", "records", "start", "compression", "alias", "etag", "version", "lineage")
_SOURCE_KEYS = ("name", "format", "text_field", "weight", "exhaustion", "paths", "split", "filters", "dedup", "notes",
                "records", "bytes", "objects")


@dataclass(frozen=True, kw_only=True)
class ObjectRecord:
    """One immutable object of a source, as it was at freeze time.

    `location` is a POSIX path relative to the manifest's folder, an absolute
    path, or a URI (`s3://`, `gs://`, `az://`, `abfs://`, `hf://`, `http(s)://`).
    Records `[start, start + records)` of the source live in this object, in
    record order.
    """

    location: str
    digest: str
    size: int
    records: int
    start: int
    compression: str = "none"
    alias: str = ""
    etag: str | None = None
    version: str | None = None
    lineage: dict[str, Any] | None = None

    @property
    def sample_key(self) -> str:
        """Digest that sample IDs of this object use (the raw one for 1:1 derived objects)."""
        if self.lineage and isinstance(self.lineage.get("raw"), str):
            return self.lineage["raw"]
        return self.digest

    def sample_id(self, record: int) -> str:
        return f"{self.sample_key}:{record}"

    def to_obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "location": self.location,
            "digest": self.digest,
            "size": self.size,
            "records": self.records,
            "start": self.start,
            "compression": self.compression,
            "alias": self.alias,
        }
        for key in ("etag", "version", "lineage"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> ObjectRecord:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object, got {obj!r:.80}")
        _known(obj, _OBJECT_KEYS, where)
        return cls(
            location=_location(_req(obj, "location", str, where), f"{where}.location"),
            digest=_digest(_req(obj, "digest", str, where), f"{where}.digest"),
            size=_nonneg(_req(obj, "size", int, where), f"{where}.size"),
            records=_nonneg(_req(obj, "records", int, where), f"{where}.records"),
            start=_nonneg(_req(obj, "start", int, where), f"{where}.start"),
            compression=_choice(_req(obj, "compression", str, where), COMPRESSIONS, f"{where}.compression"),
            alias=_req(obj, "alias", str, where),
            etag=_opt(obj, "etag", str, where),
            version=_opt(obj, "version", str, where),
            lineage=_lineage(_opt(obj, "lineage", dict, where), f"{where}.lineage"),
        )


@dataclass(frozen=True, kw_only=True)
class Source:
    """A named stream of records: its objects, format and mixture terms."""

    name: str
    format: str
    text_field: str
    weight: str
    exhaustion: str
    paths: tuple[str, ...]
    objects: tuple[ObjectRecord, ...]
    split: str = "train"
    filters: tuple[str, ...] = ()
    dedup: str = "none"
    notes: str = ""

    @property
    def records(self) -> int:
        return sum(o.records for o in self.objects)

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def locate(self, position: int) -> tuple[ObjectRecord, int]:
        """Map a record position in [0, records) to (object, record index in it)."""
        i, record = self.locate_index(position)
        return self.objects[i], record

    def locate_index(self, position: int) -> tuple[int, int]:
        """Map a record position in [0, records) to (object index, record index in it)."""
        if not 0 <= position < self.records:
            raise ManifestError(f"source {self.name!r}: record position {position} outside [0, {self.records})")
        lo, hi = 0, len(self.objects)
        while lo < hi:  # objects are sorted by start; binary search, O(log n)
            mid = (lo + hi) // 2
            obj = self.objects[mid]
            if position < obj.start:
                hi = mid
            elif position >= obj.start + obj.records:
                lo = mid + 1
            else:
                return mid, position - obj.start
        raise ManifestError(f"source {self.name!r}: no object holds record {position}")

    def to_obj(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "format": self.format,
            "text_field": self.text_field,
            "weight": self.weight,
            "exhaustion": self.exhaustion,
            "paths": list(self.paths),
            "split": self.split,
            "filters": list(self.filters),
            "dedup": self.dedup,
            "notes": self.notes,
            "records": self.records,
            "bytes": self.bytes,
            "objects": [o.to_obj() for o in self.objects],
        }

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> Source:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object, got {obj!r:.80}")
        name = _req(obj, "name", str, where)
        where = f"{where}({name:.80})"
        _known(obj, _SOURCE_KEYS, where)
        objects = tuple(
            ObjectRecord.from_obj(o, f"{where}.objects[{i}]")
            for i, o in enumerate(_req(obj, "objects", list, where))
        )
        expected = 0
        for i, o in enumerate(objects):
            if o.start != expected:
                raise ManifestError(f"{where}.objects[{i}].start: expected {expected}, got {o.start}")
            expected += o.records
        src = cls(
            name=name,
            format=_choice(_req(obj, "format", str, where), FORMATS, f"{where}.format"),
            text_field=_req(obj, "text_field", str, where),
            weight=normalize_weight(_req(obj, "weight", str, where), f"{where}.weight"),
            exhaustion=_choice(_req(obj, "exhaustion", str, where), EXHAUSTION_RULES, f"{where}.exhaustion"),
            paths=_str_list(obj, "paths", where),
            objects=objects,
            split=_req(obj, "split", str, where),
            filters=_str_list(obj, "filters", where),
            dedup=_req(obj, "dedup", str, where),
            notes=_req(obj, "notes", str, where),
        )
        if _req(obj, "records", int, where) != src.records:
            raise ManifestError(f"{where}.records: {obj['records']} != sum of object records {src.records}")
        if _req(obj, "bytes", int, where) != src.bytes:
            raise ManifestError(f"{where}.bytes: {obj['bytes']} != sum of object sizes {src.bytes}")
        return src


TOKENIZER_BACKENDS = ("hf", "tiktoken", "fastokens", "tokie")  # sluice.tokenize.fast.BACKENDS; "hf" is never written


@dataclass(frozen=True, kw_only=True)
class TokenizerRef:
    """Tokenizer identity: BLAKE3 of the tokenizer.json bytes, the backend that encodes, where it was.

    `backend` is "hf" (`tokenizers`; not written, so manifests from before the
    field keep their bytes and ID) or "tiktoken", "fastokens", "tokie" (written:
    another dataset ID).
    """

    location: str
    digest: str
    version: str
    vocab_size: int
    backend: str = "hf"

    def to_obj(self) -> dict[str, Any]:
        obj = {"location": self.location, "digest": self.digest, "version": self.version, "vocab_size": self.vocab_size}
        if self.backend != "hf":
            obj["backend"] = self.backend
        return obj

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> TokenizerRef:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object")
        _known(obj, ("location", "digest", "version", "vocab_size", "backend"), where)
        backend = obj.get("backend", "hf")
        if backend not in TOKENIZER_BACKENDS or backend == "hf" and "backend" in obj:
            raise ManifestError(f"{where}.backend: {backend!r} is not one of {', '.join(TOKENIZER_BACKENDS[1:])} "
                                "(absent means hf)")
        return cls(
            location=_location(_req(obj, "location", str, where), f"{where}.location"),
            digest=_digest(_req(obj, "digest", str, where), f"{where}.digest"),
            version=_req(obj, "version", str, where),
            vocab_size=_nonneg(_req(obj, "vocab_size", int, where), f"{where}.vocab_size", MAX_TOKEN_ID + 1),
            backend=backend,
        )


@dataclass(frozen=True, kw_only=True)
class PackingPolicy:
    """How documents become fixed-length sequences.

    `separator` says which special tokens frame each document (`eos` appends
    eos_id, `bos` prepends bos_id, `bos_eos` both, `none` neither). `pad_id` fills
    bestfit bins; padded positions carry label -100. `window` is the number of
    open bins bestfit keeps. `loss_mask`: `all` trains on every real token,
    `exclude_separator` masks the separator tokens.
    """

    seq_len: int
    algorithm: str = "concat"
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int = 0
    separator: str = "eos"
    window: int = 8
    loss_mask: str = "all"

    def __post_init__(self) -> None:
        for name, lo, hi in (("seq_len", 2, MAX_SEQ_LEN), ("window", 1, MAX_WINDOW)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ManifestError(f"packing.{name}: must be an integer in [{lo}, {hi}], got {value!r:.80}")
        for name in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, name)
            if value is None and name != "pad_id":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_ID:
                raise ManifestError(f"packing.{name}: must be a token id in [0, {MAX_TOKEN_ID}], got {value!r:.80}")
        _choice(self.algorithm, PACKING_ALGORITHMS, "packing.algorithm")
        _choice(self.separator, SEPARATORS, "packing.separator")
        _choice(self.loss_mask, LOSS_MASKS, "packing.loss_mask")
        if self.separator in ("eos", "bos_eos") and self.eos_id is None:
            raise ManifestError("packing.eos_id: required when packing.separator frames documents with eos")
        if self.separator in ("bos", "bos_eos") and self.bos_id is None:
            raise ManifestError("packing.bos_id: required when packing.separator frames documents with bos")

    def check_vocabulary(self, vocab_size: int, where: str) -> None:
        """Raise ManifestError unless every special token id is below `vocab_size` (ids 0..vocab_size-1)."""
        for name in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and value >= vocab_size:
                raise ManifestError(
                    f"{where}packing.{name}: {value} is outside the tokenizer's vocabulary "
                    f"({vocab_size} ids: 0..{vocab_size - 1})"
                )

    def to_obj(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "algorithm": self.algorithm,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "separator": self.separator,
            "window": self.window,
            "loss_mask": self.loss_mask,
        }

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> PackingPolicy:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object")
        _known(obj, ("seq_len", "algorithm", "bos_id", "eos_id", "pad_id", "separator", "window", "loss_mask"), where)
        return cls(
            seq_len=_req(obj, "seq_len", int, where),
            algorithm=_req(obj, "algorithm", str, where),
            bos_id=_opt(obj, "bos_id", int, where),
            eos_id=_opt(obj, "eos_id", int, where),
            pad_id=_req(obj, "pad_id", int, where),
            separator=_req(obj, "separator", str, where),
            window=_req(obj, "window", int, where),
            loss_mask=_req(obj, "loss_mask", str, where),
        )


@dataclass(frozen=True, kw_only=True)
class MixturePolicy:
    """How sources are mixed: policy, unit and (token units) the piece-draw bound.

    `piece_tokens` = B: a draw takes at most B framed tokens of a document (the
    next piece of the source's open document, else its next document), so
    ``quota`` keeps every source within B tokens of its target share at every
    prefix (docs/logical.md). None (the field absent from the canonical JSON)
    draws whole documents, which keeps every manifest frozen before the field
    existed byte-identical.
    """

    policy: str = "quota"
    unit: str = "documents"
    piece_tokens: int | None = None

    def __post_init__(self) -> None:
        _choice(self.policy, MIXTURE_POLICIES, "mixture.policy")
        _choice(self.unit, MIXTURE_UNITS, "mixture.unit")
        b = self.piece_tokens
        if b is None:
            return
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_COUNT:
            raise ManifestError(f"mixture.piece_tokens: must be an integer in [1, {MAX_COUNT}] (tokens per draw), "
                                f"got {b!r:.80}")
        if self.unit not in PIECE_UNITS:
            raise ManifestError(f"mixture.piece_tokens: {b} needs a token unit ({' or '.join(PIECE_UNITS)}); "
                                f"mixture.unit is {self.unit!r}, which counts whole documents or rows")

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"policy": self.policy, "unit": self.unit}
        if self.piece_tokens is not None:  # absent = whole documents: older manifests keep their bytes
            obj["piece_tokens"] = self.piece_tokens
        return obj

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> MixturePolicy:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected an object")
        _known(obj, ("policy", "unit", "piece_tokens"), where)
        if "piece_tokens" in obj and obj["piece_tokens"] is None:
            raise ManifestError(f"{where}.piece_tokens: null; leave the field out to draw whole documents")
        return cls(policy=_req(obj, "policy", str, where), unit=_req(obj, "unit", str, where),
                   piece_tokens=_opt(obj, "piece_tokens", int, where))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A frozen dataset: its canonical bytes define `dataset_id`."""

    name: str
    tokenizer: TokenizerRef | None
    packing: PackingPolicy
    mixture: MixturePolicy
    sources: tuple[Source, ...]
    access: str = "private"
    notes: dict[str, str] = field(default_factory=dict)
    # Where the manifest file lives; relative object locations resolve against
    # it. Not part of the canonical content.
    base_dir: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ManifestError(f"sources: duplicate source names in {names}")
        if not self.sources:
            raise ManifestError("sources: a manifest needs at least one source")
        if all(Decimal(s.weight) == 0 for s in self.sources):
            raise ManifestError("sources: all weights are zero; at least one must be positive")
        if self.tokenizer is not None:
            self.packing.check_vocabulary(self.tokenizer.vocab_size, "")

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise ManifestError(f"manifest {self.name!r}: no source named {name!r}")

    def to_obj(self) -> dict[str, Any]:
        return {
            "schema": MANIFEST_SCHEMA,
            "encoding": CANONICAL_ENCODING,
            "name": self.name,
            "sample_id": SAMPLE_ID_RULE,
            "tokenizer": self.tokenizer.to_obj() if self.tokenizer else None,
            "packing": self.packing.to_obj(),
            "mixture": self.mixture.to_obj(),
            "access": self.access,
            "notes": dict(self.notes),
            "sources": [s.to_obj() for s in self.sources],
        }

    def canonical_bytes(self) -> bytes:
        return canonical_bytes(self.to_obj())

    @property
    def dataset_id(self) -> str:
        return digest_id(self.canonical_bytes())

    def resolve(self, location: str) -> str:
        """Turn an object or tokenizer location into a readable path or URI."""
        from sluice.manifest.storage import is_remote

        if is_remote(location) or os.path.isabs(location):
            return location
        return str(Path(self.base_dir or ".") / location)

    @classmethod
    def from_obj(cls, obj: Any, where: str = "manifest", base_dir: str = "") -> Manifest:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected a JSON object at the top")
        schema = _req(obj, "schema", str, where)
        if schema != MANIFEST_SCHEMA:
            raise ManifestError(f"{where}.schema: unsupported {schema!r}; this sluice reads {MANIFEST_SCHEMA!r}")
        enc = _req(obj, "encoding", str, where)
        if enc != CANONICAL_ENCODING:
            raise ManifestError(f"{where}.encoding: unsupported {enc!r}; expected {CANONICAL_ENCODING!r}")
        rule = _req(obj, "sample_id", str, where)
        if rule != SAMPLE_ID_RULE:
            raise ManifestError(f"{where}.sample_id: unsupported rule {rule!r}")
        notes = _req(obj, "notes", dict, where)
        for k, v in notes.items():
            if not isinstance(v, str):
                raise ManifestError(f"{where}.notes.{k:.80}: must be a string, got {v!r:.80}")
        tok = obj.get("tokenizer")
        _known(obj, ("schema", "encoding", "name", "sample_id", "tokenizer", "packing", "mixture", "access", "notes",
                     "sources"), where)
        try:
            return cls(
                name=_req(obj, "name", str, where),
                tokenizer=TokenizerRef.from_obj(tok, f"{where}.tokenizer") if tok is not None else None,
                packing=PackingPolicy.from_obj(obj.get("packing"), f"{where}.packing"),
                mixture=MixturePolicy.from_obj(obj.get("mixture"), f"{where}.mixture"),
                sources=tuple(
                    Source.from_obj(s, f"{where}.sources[{i}]")
                    for i, s in enumerate(_req(obj, "sources", list, where))
                ),
                access=_req(obj, "access", str, where),
                notes=notes,
                base_dir=base_dir,
            )
        except ManifestError as exc:
            if str(exc).startswith(where):
                raise
            raise ManifestError(f"{where}: {exc}") from exc

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest", base_dir: str = "") -> Manifest:
        return cls.from_obj(parse_json(data, where), where, base_dir)


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest file; relative locations resolve against its folder."""
    p = Path(path)
    data = read_input(p, "manifest", MAX_MANIFEST_BYTES, ManifestError)
    return Manifest.from_bytes(data, where=f"manifest {p}{not_json_hint(p, data)}", base_dir=str(p.resolve().parent))
