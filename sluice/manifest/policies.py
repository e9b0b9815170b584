"""How a manifest's records become batches: the tokenizer that encodes them (`TokenizerRef`), how
documents are packed into sequences (`PackingPolicy`) and how sources are mixed (`MixturePolicy`), each
validating its own fields and naming the field on error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.errors import ManifestError
from sluice.manifest.fields import MAX_COUNT, MAX_SEQ_LEN, MAX_TOKEN_ID, MAX_WINDOW
from sluice.manifest.fields import choice as _choice, digest as _digest, location as _location, nonneg as _nonneg
from sluice.manifest.fields import opt as _opt, refuse_unknown as _known, req as _req

MIXTURE_POLICIES = ("quota", "categorical")
MIXTURE_UNITS = ("documents", "tokens", "loss_tokens", "sequences")
PIECE_UNITS = ("tokens", "loss_tokens")  # units whose quota piece draws make exact in tokens
PACKING_ALGORITHMS = ("concat", "bestfit")
SEPARATORS = ("eos", "bos", "bos_eos", "none")
LOSS_MASKS = ("all", "exclude_separator")

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
