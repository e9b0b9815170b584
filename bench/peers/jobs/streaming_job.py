"""mosaicml-streaming, pre-tokenized: MDSWriter writes concat-packed 2048-token
samples (prepare, untimed, once per corpus); the job reads
StreamingDataset(local=..., batch_size=8, shuffle=False) through
StreamingDataLoader(batch_size=8).

Restore: the loader's state_dict() at 90% of the measured stream; a new
dataset + loader, load_state_dict, first micro-batch.

Where torchvision does not load beside the CPU torch (PyPI's wheel links CUDA
torch), `import_streaming_without_vision` stands in for the two torchvision
names streaming's (unused) vision module imports.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import MICRO, SEQ, config, consume, emit, pack_concat, restore

cfg = config()
out = Path(cfg["peer_data"])


def import_streaming_without_vision() -> None:
    """Import `streaming` where torchvision cannot load. `import streaming` imports its vision datasets, and
    so torchvision; PyPI's torchvision wheel links the CUDA build of torch, so beside the CPU build the bench
    pins it fails ("operator torchvision::nms does not exist"). This job reads and writes MDS token rows
    only, so the two names streaming's vision module takes from torchvision are stand-ins that refuse use."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("streaming")
        return
    except RuntimeError as exc:
        if "torchvision" not in str(exc):
            raise
    for name in [m for m in sys.modules if m.split(".")[0] in ("torchvision", "streaming")]:
        del sys.modules[name]

    def unusable(*args, **kwargs):
        raise RuntimeError("torchvision is not loadable in this venv (the bench's streaming job reads text only)")

    mods = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                             "torchvision.transforms.functional")}
    mods["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {"__init__": unusable})
    mods["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {"__init__": unusable})
    mods["torchvision.transforms.functional"].to_tensor = unusable
    sys.modules.update(mods)
    importlib.import_module("streaming")


import_streaming_without_vision()


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
