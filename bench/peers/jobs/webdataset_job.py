"""WebDataset, on the fly: tar shards of .txt members -> tokenizers (batches of 256) -> concat-pack.

One process (no torch DataLoader workers: the venv has no torch), as a user's
plain WebDataset loop. WebDataset has no resume of a stream position, so no
restore figure.
"""

from __future__ import annotations

from collections.abc import Iterator

from common import MICRO, SEQ, config, consume, emit, pack_concat

import webdataset as wds
from tokenizers import Tokenizer

cfg = config()
tok = Tokenizer.from_file(cfg["tokenizer"])
eos = tok.token_to_id("<|endoftext|>")


def token_lists() -> Iterator[list[int]]:
    texts: list[str] = []
    for epoch in range(1000):
        for sample in wds.WebDataset(cfg["tars"], shardshuffle=False):
            texts.append(sample["txt"].decode("utf-8"))
            if len(texts) == 256:
                yield from (e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False))
                texts = []


assert MICRO and SEQ
result = consume(pack_concat(token_lists(), eos), cfg["batches"])
result["restore_note"] = "no resume API"
emit(result)
