"""Baseline, not a loader: the raw `tokenizers` pool alone on the same cores.

Reads the jsonl.zst shards, encodes 256 documents per `encode_batch_fast` call
(the library's own Rust thread pool, all cores), concat-packs in Python. The
issue's target compares sluice on the fly with this (>= 0.8x). No resume.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from common import config, consume, emit, pack_concat

import zstandard
from tokenizers import Tokenizer

cfg = config()
tok = Tokenizer.from_file(cfg["tokenizer"])
eos = tok.token_to_id("<|endoftext|>")


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
                        yield from (e.ids for e in tok.encode_batch_fast(texts[:256], add_special_tokens=False))
                        del texts[:256]
                yield from (e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False))


result = consume(pack_concat(token_lists(), eos), cfg["batches"])
result["restore_note"] = "baseline: no resume"
emit(result)
