"""Grain, on the fly: the jsonl.zst documents read into a MapDataset source
(random access is what Grain's sources need; the read counts in the first-batch
time), a map that tokenizes each document (tokenizers), to_iter_dataset with 2
read threads, ConcatThenSplitIterDataset (concat-pack 2048, residual carried),
.batch(8), repeated.

Restore: the iterator's get_state() at 90% of the measured stream; a new
pipeline, set_state, first micro-batch.
"""

from __future__ import annotations

import json

from common import MICRO, SEQ, config, consume, emit, restore

import grain
import numpy as np
import zstandard
from grain.experimental import ConcatThenSplitIterDataset
from tokenizers import Tokenizer

cfg = config()
tok = Tokenizer.from_file(cfg["tokenizer"])
eos = tok.token_to_id("<|endoftext|>")
texts = []
for shard in cfg["shards"]:
    with open(shard, "rb") as f:
        body = zstandard.ZstdDecompressor().stream_reader(f).read()
    texts.extend(json.loads(line)["text"] for line in body.splitlines() if line)


def encode(text: str) -> dict:
    return {"input_ids": np.asarray(tok.encode(text, add_special_tokens=False).ids + [eos], dtype=np.int32)}


def pipeline():
    ds = grain.MapDataset.source(texts).repeat(1000).map(encode)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=256))
    return ConcatThenSplitIterDataset(it, length_struct={"input_ids": SEQ}).batch(MICRO)


it = iter(pipeline())
result = consume(it, cfg["batches"], at=int(cfg["batches"] * 0.9), on_at=lambda i: it.get_state())
state = result["saved"]


def restored():
    fresh = iter(pipeline())
    fresh.set_state(state)
    return fresh


restore(result, restored, "iterator set_state")
emit(result)
