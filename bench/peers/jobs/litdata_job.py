"""LitData, pre-tokenized: `litdata.optimize` writes every document's ids (+ eos)
with TokensLoader chunks (prepare, untimed, once per corpus); the job reads
StreamingDataset(item_loader=TokensLoader(block_size=2048)) -> concat-packed
2048-token rows, StreamingDataLoader(batch_size=8).

Restore: the loader's state_dict() at 90% of the measured stream; a new
dataset + loader, load_state_dict, first micro-batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import MICRO, SEQ, config, consume, emit, restore

cfg = config()
out = Path(cfg["peer_data"])


def tokenize_shard(shard: str):
    import torch
    import zstandard
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(cfg["tokenizer"])
    eos = tok.token_to_id("<|endoftext|>")
    with open(shard, "rb") as f:
        body = zstandard.ZstdDecompressor().stream_reader(f).read()
    texts = [json.loads(line)["text"] for line in body.splitlines() if line]
    for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
        yield torch.tensor(enc.ids + [eos], dtype=torch.int32)


def loader():
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    ds = StreamingDataset(str(out), item_loader=TokensLoader(block_size=SEQ), shuffle=False)
    return StreamingDataLoader(ds, batch_size=MICRO, num_workers=1, drop_last=True)


if __name__ == "__main__":
    if cfg.get("prepare_only"):
        if not (out / "index.json").exists():
            from litdata import TokensLoader, optimize

            optimize(fn=tokenize_shard, inputs=cfg["shards"], output_dir=str(out), chunk_bytes="64MB",
                     item_loader=TokensLoader(), num_workers=1)
        print(json.dumps({"prepared": str(out)}))
    else:
        dl = loader()

        def endless():
            while True:
                yield from dl

        result = consume(endless(), cfg["batches"], at=int(cfg["batches"] * 0.9), on_at=lambda i: dl.state_dict())
        state = result["saved"]
        box = []

        def restored():
            fresh = loader()
            fresh.load_state_dict(state)
            box.append(fresh)
            return fresh

        restore(result, restored, "StreamingDataLoader load_state_dict")
        emit(result)
