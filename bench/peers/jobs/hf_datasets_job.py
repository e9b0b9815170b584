"""HF datasets, on the fly: streaming load_dataset("json") of the jsonl.zst shards,
a batched map that tokenizes (tokenizers, 256 documents), a batched map that
concat-packs into 2048-token rows (the library's own group_texts recipe: the
residual of each map batch is dropped), .batch(8).

Restore: IterableDataset.state_dict() taken at 90% of the measured stream; a
new pipeline, load_state_dict, first micro-batch.
"""

from __future__ import annotations

from common import MICRO, SEQ, config, consume, emit, restore

from datasets import load_dataset
from tokenizers import Tokenizer

cfg = config()
tok = Tokenizer.from_file(cfg["tokenizer"])
eos = tok.token_to_id("<|endoftext|>")


def tokenize(batch: dict) -> dict:
    return {"ids": [e.ids + [eos] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}


def group(batch: dict) -> dict:
    flat = [t for ids in batch["ids"] for t in ids]
    n = len(flat) // SEQ * SEQ
    return {"input_ids": [flat[i:i + SEQ] for i in range(0, n, SEQ)]}


def pipeline():
    ds = load_dataset("json", data_files=cfg["shards"], split="train", streaming=True)
    ds = ds.map(tokenize, batched=True, batch_size=256, remove_columns=ds.column_names)
    ds = ds.map(group, batched=True, batch_size=256, remove_columns=["ids"])
    return ds.repeat(1000).batch(MICRO, drop_last_batch=True) if hasattr(ds, "repeat") else ds.batch(MICRO, drop_last_batch=True)


ds = pipeline()
at = int(cfg["batches"] * 0.9)
result = consume(ds, cfg["batches"], at=at, on_at=lambda i: ds.state_dict())
state = result["saved"]


def restored():
    fresh = pipeline()
    fresh.load_state_dict(state)
    return fresh


restore(result, restored, "new pipeline + load_state_dict")
emit(result)
