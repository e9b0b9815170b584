"""Benchmark: the Ray engine against the local engine, same corpus, 1 and 2 workers.

Corpus: the Python standard library's sources as the demo builds them (code
as .jsonl.zst, docstrings as parquet; no download), frozen once. Measured in
one run, on this machine:

* freeze: local threads vs Ray tasks (`--threads` / Ray CPUs = 1 and 2);
* pretokenize: local worker processes vs Ray tasks (1 and 2);
* for Ray, twice: the whole call with a local Ray started for it (what
  `--engine ray` without `--address` costs) and the engine alone on a Ray that
  is already running (what a call on a cluster costs); plus the bare
  `ray.init` + `ray.shutdown` of a local Ray.

Every Ray output is checked byte for byte against the local engine's.
Ratios are Ray time / local time at the same worker count (lower is better).
Prints a table, one JSON line, and writes bench/out/ray_engine.json.

    .venv/bin/python bench/ray_engine.py            # about two minutes
    .venv/bin/python bench/ray_engine.py --files 480 --per-shard 400
"""

from __future__ import annotations

import sys

# Run as a script, this file's folder is sys.path[0], where bench/tokenize.py
# would shadow the standard library's `tokenize`. Drop it before any import.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((folder / "shards").iterdir())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=240, help="stdlib files in the corpus (default 240)")
    parser.add_argument("--per-shard", type=int, default=200, help="documents per code shard (default 200)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "ray_engine.json"))
    args = parser.parse_args(argv)

    import ray

    from sluice import demo
    from sluice.engines import ray_engine
    from sluice.manifest.freeze import freeze
    from sluice.manifest.model import load_manifest
    from sluice.tokenize.pretokenize import pretokenize
    from sluice.tokenize.train import train_bpe

    root = Path(tempfile.mkdtemp(prefix="sluice-bench-ray-"))
    try:
        demo.build_corpus(root, files=args.files, per_shard=args.per_shard)
        train_bpe([str(p) for p in demo.stdlib_files(40)], str(root / "tokenizer.json"), vocab_size=2048)
        (root / "dataset.toml").write_text(demo.DATASET_SPEC)
        manifest = freeze(root / "dataset.toml", root / "manifest.json", progress=False)
        objects = sum(len(s.objects) for s in manifest.sources)
        raw_bytes = sum(s.bytes for s in manifest.sources)
        reference = (root / "manifest.json").read_bytes()
        tok_ref = pretokenize(manifest, root / "tok-ref", workers=2, progress=False)
        ref_shards = _shards(root / "tok-ref")

        rows = []
        _, init_s = _timed(lambda: (ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                                             configure_logging=False), ray.shutdown()))
        for w in (1, 2):
            r: dict = {"workers": w}
            _, r["freeze_local_s"] = _timed(freeze, root / "dataset.toml", root / "m-local.json", threads=w,
                                            progress=False)
            _, r["freeze_ray_call_s"] = _timed(ray_engine.freeze_ray, root / "dataset.toml", root / "m-ray.json",
                                               progress=False, num_cpus=w)
            assert (root / "m-ray.json").read_bytes() == reference
            res, r["tok_local_s"] = _timed(pretokenize, manifest, root / f"tok-local{w}", workers=w, progress=False)
            assert res.dataset_id == tok_ref.dataset_id
            res, r["tok_ray_call_s"] = _timed(ray_engine.pretokenize_ray, manifest, root / f"tok-ray{w}",
                                              progress=False, num_cpus=w)
            assert res.dataset_id == tok_ref.dataset_id and _shards(root / f"tok-ray{w}") == ref_shards
            # the engine alone, on a Ray that is already up (a cluster's case); warm its workers once
            ray.init(num_cpus=w, include_dashboard=False, log_to_driver=False, configure_logging=False)
            try:
                ray_engine.freeze_ray(root / "dataset.toml", root / "m-warm.json", progress=False)
                _, r["freeze_ray_engine_s"] = _timed(ray_engine.freeze_ray, root / "dataset.toml",
                                                     root / "m-ray2.json", progress=False)
                assert (root / "m-ray2.json").read_bytes() == reference
                shutil.rmtree(root / f"tok-ray{w}")
                res, r["tok_ray_engine_s"] = _timed(ray_engine.pretokenize_ray, manifest, root / f"tok-ray{w}",
                                                    progress=False)
                assert _shards(root / f"tok-ray{w}") == ref_shards
            finally:
                ray.shutdown()
            for k in ("freeze", "tok"):
                r[f"{k}_ratio_call"] = r[f"{k}_ray_call_s"] / r[f"{k}_local_s"]
                r[f"{k}_ratio_engine"] = r[f"{k}_ray_engine_s"] / r[f"{k}_local_s"]
            rows.append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"corpus: {objects} objects, {raw_bytes / 1e6:.1f} MB; local ray.init+shutdown {init_s:.2f} s; "
          f"{tok_ref.tokens} tokens")
    print(f"{'workers':>7} | {'freeze local':>12} {'ray call':>9} {'ray engine':>10} | "
          f"{'tokenize local':>14} {'ray call':>9} {'ray engine':>10}")
    for r in rows:
        print(f"{r['workers']:>7} | {r['freeze_local_s']:>10.2f} s {r['freeze_ray_call_s']:>7.2f} s "
              f"{r['freeze_ray_engine_s']:>8.2f} s | {r['tok_local_s']:>12.2f} s {r['tok_ray_call_s']:>7.2f} s "
              f"{r['tok_ray_engine_s']:>8.2f} s")
        print(f"{'ratio':>7} | {'':>12} {r['freeze_ratio_call']:>8.2f}x {r['freeze_ratio_engine']:>9.2f}x | "
              f"{'':>14} {r['tok_ratio_call']:>8.2f}x {r['tok_ratio_engine']:>9.2f}x")
    result = {"objects": objects, "raw_bytes": raw_bytes, "tokens": tok_ref.tokens, "ray_init_shutdown_s": init_s,
              "rows": rows, "identical": True}
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
