"""`sluice tokenize check`: prove a backend gives the same ids as `tokenizers` on a manifest.

Every text object of the manifest is fetched through a node cache (digest-
verified), streamed in bounded chunks, and each chunk is encoded by both the
`hf` encoder and the backend's; the ids of every document must be equal.
With `sample=N` only the first ceil(N / text objects) documents of each object
are compared (a sample stratified by object: every object, hence every source,
contributes); without it, every document. A difference is named by source,
object, record (the document) and the first token offset where the ids part.

    result = check_backend(manifest, "tiktoken", cache=NodeCache(dir, budget))
    result.equal            # True: same ids on every compared document
    result.mismatches[0]    # else: source, object, record, first differing position
    result.mismatches[0].describe(result.backend)   # "source 'docs' object a.jsonl record 1: token 4: ..."
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

_SHOWN = 10  # mismatches kept in the result (the count covers all)


@dataclass(frozen=True)
class Mismatch:
    source: str
    location: str
    record: int
    position: int  # first token index where the ids differ
    expected: tuple[int, ...]  # hf ids from `position` (a few)
    actual: tuple[int, ...]  # backend ids from `position`

    def describe(self, backend: str) -> str:
        """One line naming the document and the token offset: what `tokenize check` and freeze print."""
        return (f"source {self.source!r} object {self.location} record {self.record}: token {self.position}: "
                f"hf {list(self.expected)} vs {backend} {list(self.actual)}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "location": self.location, "record": self.record,
                "position": self.position, "expected": list(self.expected), "actual": list(self.actual)}


@dataclass(frozen=True)
class CheckResult:
    backend: str
    objects: int
    documents: int
    tokens: int
    mismatched: int  # documents whose ids differ
    mismatches: tuple[Mismatch, ...]  # the first few
    hf_seconds: float
    backend_seconds: float
    sample: int | None

    @property
    def equal(self) -> bool:
        return self.mismatched == 0

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "equal": self.equal, "objects": self.objects, "documents": self.documents,
                "tokens": self.tokens, "mismatched": self.mismatched, "sample": self.sample,
                "mismatches": [m.to_dict() for m in self.mismatches],
                "hf_seconds": round(self.hf_seconds, 3), "backend_seconds": round(self.backend_seconds, 3)}


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class LocalObjects:
    """`check_backend`'s object source at freeze: local objects read where they are, s3 objects skipped.

    Freeze has just hashed every local object; the check only compares two
    tokenizers on their text, so it reads them in place (no cache copy).
    """

    class _Pin:
        def __init__(self, path: str) -> None:
            self.path = path

        def close(self) -> None:
            pass

    def fetch(self, obj: Any, location: str) -> Any:
        from sluice.manifest.storage import is_remote

        return None if is_remote(location) else self._Pin(location)


def _within(texts: list[str], room: int, *, at_least: bool) -> tuple[list[str], bool]:
    """The leading texts whose lengths fit in `room` characters (one if `at_least`), and whether room ran out."""
    total = 0
    for i, t in enumerate(texts):
        total += len(t)
        if total > room:
            keep = max(i, 1) if at_least else i
            return texts[:keep], True
    return texts, False


def check_backend(manifest: Any, backend: str, *, cache: Any, sample: int | None = None,
                  other: Any = None, sample_chars: int | None = None) -> CheckResult:
    """Compare `backend` with `hf` on the manifest's documents (see the module docstring).

    `cache`: where objects come from (`NodeCache.fetch`: digest-verified; or
    `LocalObjects`; a None pin skips the object). `other`: an already built
    `Encoder` to compare instead of loading `backend` (its `backend` names it).
    `sample_chars`: with `sample`, also stop an object's sample once it holds
    ceil(sample_chars / text objects) characters (at least one document each).
    Raises TokenizerError (no tokenizer, or one the backend cannot represent,
    naming why) and the cache's errors for an unreadable or changed object.
    """
    from sluice.errors import TokenizerError
    from sluice.tokenize.chunks import iter_text_chunks
    from sluice.tokenize.encoder import load_tokenizer

    ref = manifest.tokenizer
    if ref is None:
        raise TokenizerError(f"manifest {manifest.name!r} names no tokenizer")
    if sample is not None and sample < 1:
        raise TokenizerError(f"--sample: expected a positive document count, got {sample}")
    location = manifest.resolve(ref.location)
    hf = load_tokenizer(location, ref.digest)
    if other is None:
        other = load_tokenizer(location, ref.digest, backend=backend)
    texts_objs = [(src, obj) for src in manifest.sources if src.format != "tokens" for obj in src.objects]
    quota = math.ceil(sample / max(1, len(texts_objs))) if sample is not None else None
    char_quota = math.ceil(sample_chars / max(1, len(texts_objs))) if sample is not None and sample_chars else None
    documents = tokens = mismatched = 0
    shown: list[Mismatch] = []
    t_hf = t_other = 0.0
    for src, obj in texts_objs:
        where = f"source {src.name!r} object {obj.location} ({obj.digest})"
        pin = cache.fetch(obj, manifest.resolve(obj.location))
        if pin is None:
            continue
        try:
            record = chars = 0
            for texts in iter_text_chunks(pin.path, src.format, obj.compression, src.text_field, where):
                if quota is not None:
                    texts = texts[: quota - record]
                if char_quota is not None:
                    texts, full = _within(texts, char_quota - chars, at_least=record == 0)
                    chars += sum(map(len, texts))
                t0 = time.perf_counter()
                want = hf.encode_batch(texts)
                t1 = time.perf_counter()
                got = other.encode_batch(texts)
                t_hf, t_other = t_hf + t1 - t0, t_other + time.perf_counter() - t1
                for i, (a, b) in enumerate(zip(want, got)):
                    tokens += a.size
                    if a.size != b.size or not np.array_equal(a, b):
                        mismatched += 1
                        if len(shown) < _SHOWN:
                            at = _first_difference(a, b)
                            shown.append(Mismatch(src.name, obj.location, record + i, at,
                                                  tuple(int(x) for x in a[at : at + 8]),
                                                  tuple(int(x) for x in b[at : at + 8])))
                record += len(texts)
                if quota is not None and record >= quota or char_quota is not None and full:
                    break
            documents += record
        finally:
            pin.close()
    return CheckResult(getattr(other, "backend", backend), len(texts_objs), documents, tokens, mismatched, tuple(shown), t_hf, t_other, sample)
