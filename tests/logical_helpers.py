"""Builders for logical-plane tests: manifests over synthetic objects, synthetic tokens.

The logical plane sees token data only through its `docs` callback, so these
tests drive it with a deterministic function of the sample ID (its length and
ids come from BLAKE3 of the ID). The physical plane's real callbacks are tested
with real files elsewhere.
"""

from __future__ import annotations

import blake3
import numpy as np

from sluice.manifest.model import Manifest, MixturePolicy, ObjectRecord, PackingPolicy, Source, TokenizerRef
from sluice.runspec import RunSpec


def fake_digest(text: str) -> str:
    return "b3:" + blake3.blake3(text.encode()).hexdigest()


def make_manifest(
    sources: list[tuple[str, list[int], str, str]],
    *,
    seq_len: int = 16,
    algorithm: str = "concat",
    policy: str = "quota",
    unit: str = "documents",
    window: int = 4,
    separator: str = "eos",
    loss_mask: str = "all",
    piece_tokens: int | None = None,
) -> Manifest:
    """sources: (name, records per object, weight, exhaustion); `piece_tokens` turns piece draws on."""
    srcs = []
    for name, counts, weight, exhaustion in sources:
        objs, start = [], 0
        for i, c in enumerate(counts):
            objs.append(
                ObjectRecord(location=f"{name}/{i}.jsonl", digest=fake_digest(f"{name}/{i}"), size=100 * c, records=c, start=start)
            )
            start += c
        srcs.append(
            Source(name=name, format="jsonl", text_field="text", weight=weight, exhaustion=exhaustion, paths=(f"{name}/*",), objects=tuple(objs))
        )
    return Manifest(
        name="t",
        tokenizer=TokenizerRef(location="tok.json", digest=fake_digest("tok"), version="1.0", vocab_size=1000),
        packing=PackingPolicy(seq_len=seq_len, algorithm=algorithm, eos_id=0, bos_id=2, pad_id=1, separator=separator, window=window, loss_mask=loss_mask),
        mixture=MixturePolicy(policy=policy, unit=unit, piece_tokens=piece_tokens),
        sources=tuple(srcs),
    )


def make_spec(lanes: int = 8, global_batch: int = 16, micro_batch: int = 4, seed: int = 1234, order: str = "global", **kw) -> RunSpec:
    return RunSpec(run_id="r1", seed=seed, lanes=lanes, global_batch=global_batch, micro_batch=micro_batch, order=order, **kw)


def fake_docs(max_len: int = 40):
    """DocTokens: ids and length derived from the sample ID (deterministic)."""

    def docs(ref) -> np.ndarray:
        h = blake3.blake3(ref.sample_id.encode()).digest(length=4 + 2 * max_len)
        n = 1 + h[0] % max_len
        ids = np.frombuffer(h[4 : 4 + 2 * n], dtype="<u2").astype(np.uint32) % 997 + 3
        return ids

    return docs
