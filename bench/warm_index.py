"""What storing line indexes adds to `sluice cache warm`, per plain jsonl object.

`sluice cache warm` stores the line index of every plain jsonl object
(sluice/cache/cli.py `_fetch`, `LineIndexes.ensure`): a fill feeds a
`StagedIndexer` as its observer; an object found cached without an index
costs one pass over the cached file. Per round, on one generated object
(`--mb` MB of short jsonl records, in a temporary folder):

1. fill: a fresh node cache, `NodeCache.fetch` alone (the warm before);
2. fill + index: a fresh node cache, the fetch with the observer, then the
   index stored (the warm now, for an object it fills);
3. present: the cache of (1), whose object has no index: the hit, one pass
   over the file, the index stored (the warm now, for an object cached before).

    .venv/bin/python bench/warm_index.py --mb 200 --rounds 3

Prints one line per round. Not a test: figures depend on the machine, its
load and the page cache (the generated file is read once before round 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow the standard library's.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]


def _object(folder: str, mb: int) -> tuple[str, object]:
    import blake3

    from sluice.manifest.sources import ObjectRecord

    path = os.path.join(folder, "o.jsonl")
    block = "".join(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (i % 40)}) + "\n" for i in range(20000))
    with open(path, "w") as f:
        for _ in range(max(1, mb * 1_000_000 // len(block))):
            f.write(block)
    h = blake3.blake3()
    records = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            records += chunk.count(b"\n")
    return path, ObjectRecord(location=path, digest="b3:" + h.hexdigest(), size=os.path.getsize(path),
                              records=records, start=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from sluice.cache import NodeCache
    from sluice.loaderd.physical.lineindexes import LineIndexes
    from sluice.tokenize.lineindex import StagedIndexer

    with tempfile.TemporaryDirectory() as d:
        path, obj = _object(d, args.mb)
        for rnd in range(args.rounds):
            plain_dir, indexed_dir = os.path.join(d, f"plain-{rnd}"), os.path.join(d, f"indexed-{rnd}")
            with NodeCache(plain_dir, 1 << 40) as cache:
                t = time.perf_counter()
                cache.fetch(obj, path).close()
                fill = time.perf_counter() - t
            with NodeCache(indexed_dir, 1 << 40) as cache:
                t = time.perf_counter()
                indexer = StagedIndexer()
                pin = cache.fetch(obj, path, observe=indexer.feed)
                indexer.close()
                with pin:
                    LineIndexes(cache).ensure(obj, str(pin.path), indexer.finish(obj.digest, obj.size))
                fill_index = time.perf_counter() - t
            with NodeCache(plain_dir, 1 << 40) as cache:
                indexes = LineIndexes(cache)
                t = time.perf_counter()
                with cache.fetch(obj, path) as pin:
                    indexes.ensure(obj, str(pin.path))
                present = time.perf_counter() - t
                assert (indexes.built, indexes.stored) == (1, 1)
            print(f"round {rnd}: {obj.size / 1e6:.0f} MB, {obj.records} records: fill {fill:.3f} s, "
                  f"fill + index {fill_index:.3f} s, present (hit + one pass + store) {present:.3f} s", flush=True)


if __name__ == "__main__":
    main()
