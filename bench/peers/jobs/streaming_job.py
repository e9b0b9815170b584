"""mosaicml-streaming, pre-tokenized: MDSWriter writes concat-packed 2048-token
samples (prepare, untimed, once per corpus); the job reads
StreamingDataset(local=..., batch_size=8, shuffle=False) through
StreamingDataLoader(batch_size=8).

Restore: the loader's state_dict() at 90% of the measured stream; a new
dataset + loader, load_state_dict, first micro-batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import MICRO, SEQ, config, consume, emit, pack_concat, restore

cfg = config()
out = Path(cfg["peer_data"])


def loader():
    from streaming import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(local=str(out), batch_size=MICRO, shuffle=False)
    return StreamingDataLoader(ds, batch_size=MICRO, num_workers=1, drop_last=True)


def prepare() -> None:
    import numpy as np
    import zstandard
    from streaming import MDSWriter
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(cfg["tokenizer"])
    eos = tok.token_to_id("<|endoftext|>")

    def ids():
        for shard in cfg["shards"]:
            with open(shard, "rb") as f:
                body = zstandard.ZstdDecompressor().stream_reader(f).read()
            texts = [json.loads(line)["text"] for line in body.splitlines() if line]
            for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
                yield enc.ids

    with MDSWriter(out=str(out), columns={"input_ids": "ndarray:int32"}) as writer:
        for rows in pack_concat(ids(), eos):
            for row in rows:
                writer.write({"input_ids": np.asarray(row, dtype=np.int32)})


if __name__ == "__main__":
    if cfg.get("prepare_only"):
        if not (out / "index.json").exists():
            prepare()
        print(json.dumps({"prepared": str(out), "seq": SEQ}))
    else:
        dl = loader()

        def endless():
            while True:
                yield from dl

        result = consume(endless(), cfg["batches"], at=int(cfg["batches"] * 0.9),
                         on_at=lambda i: dl.state_dict())
        state = result["saved"]

        def restored():
            fresh = loader()
            fresh.load_state_dict(state)
            return fresh

        restore(result, restored, "StreamingDataLoader load_state_dict")
        emit(result)
