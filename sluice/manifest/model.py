"""The frozen dataset manifest: what a run reads, bound to exact bytes.

A manifest is a tree of frozen dataclasses with a lossless mapping to the
canonical JSON documented in docs/manifest.md. `Manifest.from_obj` validates
every field and names it on error; `Manifest.to_obj` produces the dict whose
canonical bytes define the dataset ID.

The manifest's parts live next to it: its sources and their objects in
sources.py, the tokenizer, packing and mixture terms in policies.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sluice.errors import ManifestError
from sluice.manifest.canonical import CANONICAL_ENCODING, canonical_bytes, digest_id, parse_json
from sluice.manifest.fields import refuse_unknown as _known, req as _req
from sluice.manifest.inputs import MAX_MANIFEST_BYTES, not_json_hint, read_input
from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
from sluice.manifest.sources import Source

__all__ = ["MANIFEST_SCHEMA", "SAMPLE_ID_RULE", "Manifest", "load_manifest"]

MANIFEST_SCHEMA = "sluice.manifest/1"
SAMPLE_ID_RULE = "object-digest:record-index/v1"


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
