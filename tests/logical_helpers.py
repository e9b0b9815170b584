"""Builders for logical-plane tests: manifests over synthetic objects, synthetic tokens.

The logical plane sees token data only through its `docs` callback, so these
tests drive it with a deterministic function of the sample ID (its length and
ids come from BLAKE3 of the ID). The physical plane's real callbacks are tested
with real files elsewhere.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import blake3
import numpy as np

from sluice.manifest.model import Manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source
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


@functools.cache
def uncompiled_face():
    """A loaded `KernelLoader`'s face (``.kernel``) over `jit.uncompiled()`, one a process; None without numba."""
    try:
        from sluice.loaderd.physical.jitload import uncompiled

        return SimpleNamespace(kernel=uncompiled())
    except ImportError:
        return None


def fast_kernel():
    """The kernel the fast-tier tests hand `fast_steps`: the kernels' source uncompiled (None without numba)."""
    face = uncompiled_face()
    return None if face is None else face.kernel


class StandIn:
    """The rest of what the producer (`StepMaker`) calls on a `DocSource`, for a documents stand-in: nothing
    fills, no kernel, nothing to verify; announcements are taken and change nothing."""

    filling = False
    making = False
    jit = None

    def all_done(self) -> bool:
        return False

    def prefetch(self, refs, only_if_settled: bool = False) -> None:
        pass

    def begin_reads(self) -> None:
        pass

    def check_reads(self) -> bool:
        return True

    def restored(self, caller: int) -> None:  # (a RESTORE: nothing announced to drop)
        pass


class MappedDocs(StandIn):
    """DocTokens with `DocSource`'s mapped-shard lookup (`mapped`, `count`), over synthetic shards.

    Each object is one token array with record offsets, as a memory-mapped
    token shard; a document is the same ids `fake_docs` gives, except that
    every record with ``record % empty_every == empty_every - 1`` is empty (to
    exercise empty documents). Objects with ``(source + object) % 3 ==
    unmapped`` are never "mapped" (`mapped` returns None for any call naming
    one), so the fast path stands aside and `Plan.step` reads them. `calls` counts
    documents handed out either way, as DocSource does.
    """

    def __init__(self, plan, max_len: int = 40, *, empty_every: int = 0, unmapped: int = -1) -> None:
        # the producer's kernel face (`KernelLoader`'s `kernel`): the kernels' source run uncompiled, so a
        # `StepMaker` over these documents takes the fast path without a compile (None without numba)
        self.jit = uncompiled_face()
        self.plan, self.unmapped, self.calls = plan, unmapped, 0
        self.fake, self.fake_max, self.empty_every = fake_docs(max_len), max_len, empty_every
        self.shards: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]] = {}

    def _shard(self, s: int, o: int) -> tuple[np.ndarray, np.ndarray, int]:
        got = self.shards.get((s, o))
        if got is None:
            obj = self.plan.manifest.sources[s].objects[o]
            docs = []
            for rec in range(obj.records):
                empty = self.empty_every and rec % self.empty_every == self.empty_every - 1
                ref = self.plan.ref(s, 0, obj.start + rec)
                docs.append(np.zeros(0, dtype=np.uint32) if empty else self.fake(ref))
            offsets = np.zeros(len(docs) + 1, dtype="<u8")
            offsets[1:] = np.cumsum([len(d) for d in docs])
            got = self.shards[(s, o)] = (offsets, np.concatenate(docs).astype(np.uint32), len(docs))
        return got

    def __call__(self, ref) -> np.ndarray:
        self.calls += 1
        offsets, tokens, _ = self._shard(ref.source, ref.obj)
        return tokens[int(offsets[ref.record]):int(offsets[ref.record + 1])]

    def mapped(self, source: int, objs: list[int]):
        if any((source + o) % 3 == self.unmapped for o in objs):
            return None
        return {o: self._shard(source, o) for o in set(objs)}

    def count(self, source: int, n: int) -> None:
        self.calls += n
