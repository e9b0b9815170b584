"""Where a cold first batch goes, per object (bench/results/peers-log.md, "What limits the misses").

For one-object manifests (the shard-size sweep's, `bench/peers/work/full/sweep-*`),
in this process, a fresh node cache each:

* fetch: `NodeCache.fetch` of the raw object (copy + BLAKE3; the cache's fill);
* fetch + index: the same fill in a fresh cache with a `StagedIndexer`
  observing it (what DocSource does for a plain jsonl object whose tokens are
  not cached);
* count: `RecordLocator` indexing every line of it itself (what finding the
  last record costs the out-of-order path without the fill's index);
* step 0: a DocSource + `StepMaker.produce_step` of the first step (prefetch,
  demand, tokenizing its documents), raw object not cached, tokens not cached;
* encode: `encode_batch` of step 0's documents alone (the tokenizing part).

    .venv/bin/python bench/coldpath.py bench/peers/work/full/sweep-{10,100,300,1000}

Each phase's cache is removed before the next, and every timed phase starts
after `os.sync()`: each fill writes a whole copy of the object, and with the
earlier copies still there (and dirty) the third 1 GB fill in a row, step
0's, spent 2.2-3.3 s in read(2) and write(2) against 0.9 s for the first
(sampled stacks, run 11: bench/results/peers-log.md), which a daemon filling one
object does not see. Prints one line per object and a JSON list at the end.
Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import sys

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow the standard library.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(folder: Path) -> dict:
    from sluice.cache import NodeCache
    from sluice.loaderd.logical import Plan
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec
    from sluice.tokenize import encoder_for_manifest
    from sluice.tokenize.lineindex import StagedIndexer
    from sluice.tokenize.records import RecordLocator

    manifest = load_manifest(folder / "manifest.json")
    spec = load_runspec(folder / "run-block.toml" if (folder / "run-block.toml").exists() else folder / "run.toml")
    obj = manifest.sources[0].objects[0]
    encoder = encoder_for_manifest(manifest)
    encoder.encode_batch(["warm up"])
    out: dict = {"object": str(folder), "bytes": obj.size, "records": obj.records}
    with tempfile.TemporaryDirectory() as d:
        with NodeCache(Path(d) / "c1", 8 << 30) as cache:
            os.sync()
            t = time.perf_counter()
            pin = cache.fetch(obj, manifest.resolve(obj.location))
            out["fetch_s"] = time.perf_counter() - t
            loc = RecordLocator(pin.path, "jsonl", obj.compression, "text", "bench", spool_dir=d)
            t = time.perf_counter()
            loc.texts([obj.records - 1])
            out["count_s"] = time.perf_counter() - t
            loc.close()
            pin.close()
        shutil.rmtree(Path(d) / "c1")
        with NodeCache(Path(d) / "c1i", 8 << 30) as cache:
            indexer = StagedIndexer()
            os.sync()
            t = time.perf_counter()
            pin = cache.fetch(obj, manifest.resolve(obj.location), observe=indexer.feed)
            index = indexer.finish(obj.digest, obj.size)
            out["fetch_index_s"] = time.perf_counter() - t
            loc = RecordLocator(pin.path, "jsonl", obj.compression, "text", "bench", spool_dir=d, index=index,
                                digest=obj.digest)
            t = time.perf_counter()
            loc.texts([obj.records - 1])
            out["count_with_index_s"] = time.perf_counter() - t
            out["index_used"] = loc.used_index
            loc.close()
            pin.close()
        shutil.rmtree(Path(d) / "c1i")
        with NodeCache(Path(d) / "c2", 8 << 30, verify_on_read=True) as cache:
            plan = Plan(manifest, spec)
            docs = DocSource(manifest, cache, encoder)
            try:
                os.sync()
                t = time.perf_counter()
                StepMaker(plan, docs, replica=0, replicas=1).produce_step(plan.initial_state())
                out["step0_s"] = time.perf_counter() - t
                out["step0_docs"] = docs.calls
                out["step0_indexed_objects"] = docs.indexed_objects
            finally:
                docs.close()
        shutil.rmtree(Path(d) / "c2")
        # the same documents, tokenized alone
        state = plan.initial_state()
        refs = [r for lane in plan.lanes_of(1, 0) for r in plan.upcoming(state, lane, 8)][: out["step0_docs"]]
        with NodeCache(Path(d) / "c3", 8 << 30) as cache:
            pin = cache.fetch(obj, manifest.resolve(obj.location))
            loc = RecordLocator(pin.path, "jsonl", obj.compression, "text", "bench", spool_dir=d)
            texts = loc.texts([r.record for r in refs])
            t = time.perf_counter()
            encoder.encode_batch(texts)
            out["encode_s"] = time.perf_counter() - t
            loc.close()
            pin.close()
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="bench/coldpath.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="one-object manifest folders (bench/peers/work/full/sweep-*)")
    args = ap.parse_args(argv)
    missing = [f for f in args.folders if not (Path(f) / "manifest.json").is_file()]
    if missing:
        ap.error(f"{missing[0]}: no manifest.json (a shard-size sweep folder: `make bench-peers` makes them)")
    rows = []
    for folder in args.folders:
        row = measure(Path(folder))
        rows.append(row)
        print(f"{row['bytes'] / 1e6:8.0f} MB: fetch {row['fetch_s']:.2f} s, count {row['count_s']:.2f} s; "
              f"fetch + index {row['fetch_index_s']:.2f} s, last record then {row['count_with_index_s']:.3f} s "
              f"(index used: {row['index_used']}); step 0 {row['step0_s']:.2f} s ({row['step0_docs']} documents; encoding them alone "
              f"{row['encode_s']:.3f} s)", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
