"""Baseline, not a loader: the raw `tokenizers` pool alone on the same cores.

Reads the jsonl.zst shards, encodes 256 documents per `encode_batch_fast` call
(the library's own Rust thread pool, all cores), concat-packs in Python. The
issue's target compares sluice on the fly with this (>= 0.8x). No resume.

cfg["backend"] == "tiktoken": the same with tiktoken's `encode_ordinary_batch`
(its own thread pool, one thread per core) on the encoding sluice builds from
the same tokenizer.json (`sluice.tokenize.fast.build_encoding`; same ids,
checked by `sluice tokenize check` when the bench prepares the corpus).
cfg["backend"] == "fastokens": the same with fastokens' `encode_batch_flat` (its own
pool, one thread per core) on the same tokenizer.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import os
import sys

from common import config, consume, emit, pack_concat

import zstandard
from tokenizers import Tokenizer

cfg = config()
tok = Tokenizer.from_file(cfg["tokenizer"])
eos = tok.token_to_id("<|endoftext|>")
if cfg.get("backend") == "tiktoken":
    sys.path.insert(0, cfg["repo"])
    from sluice.tokenize.fast import build_encoding  # noqa: E402

    with open(cfg["tokenizer"], encoding="utf-8") as f:
        encoding = build_encoding(json.load(f), cfg["tokenizer"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def encode(texts: list[str]) -> list[list[int]]:
        return encoding.encode_ordinary_batch(texts, num_threads=cores)
elif cfg.get("backend") == "fastokens":
    import fastokens
    import numpy as np

    fast = fastokens.Tokenizer.from_file(cfg["tokenizer"])

    def encode(texts: list[str]) -> list[list[int]]:
        ids, offsets = fast.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=True)
        flat = np.frombuffer(ids, dtype="<u4").tolist()  # lists, as the other backends give (one conversion)
        ends = np.frombuffer(offsets, dtype="<u8").tolist()
        return [flat[a:b] for a, b in zip(ends, ends[1:])]
else:
    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def token_lists() -> Iterator[list[int]]:
    for epoch in range(1000):
        for shard in cfg["shards"]:
            with open(shard, "rb") as f:
                reader = zstandard.ZstdDecompressor().stream_reader(f)
                buf = b""
                texts: list[str] = []
                while chunk := reader.read(1 << 20):
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    texts.extend(json.loads(line)["text"] for line in lines if line)
                    while len(texts) >= 256:
                        yield from encode(texts[:256])
                        del texts[:256]
                yield from encode(texts)


result = consume(pack_concat(token_lists(), eos), cfg["batches"])
result["restore_note"] = "baseline: no resume"
emit(result)
