"""A manifest's sources and their objects: `Source` (a named stream of records, its format and mixture
terms) and `ObjectRecord` (one immutable object of it, bound to its digest), each validating its own
fields in `from_obj` and naming the field on error.

Sample IDs: a record is identified by ``(object digest, record index)``, written
``b3:<hex>:<index>``. For a derived (pre-tokenized) object made 1:1 from a raw
object, the sample key is the raw object's digest, so a document keeps its
identity across pre-tokenization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.errors import ManifestError
from sluice.manifest.fields import choice as _choice, digest as _digest, lineage as _lineage
from sluice.manifest.fields import location as _location, nonneg as _nonneg, normalize_weight
from sluice.manifest.fields import opt as _opt, refuse_unknown as _known, req as _req, str_list as _str_list

FORMATS = ("jsonl", "parquet", "webdataset", "tokens")
COMPRESSIONS = ("none", "gzip", "zstd")
EXHAUSTION_RULES = ("stop", "repeat", "renormalize", "fail")

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
