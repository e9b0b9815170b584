"""Benchmark the logical plane (issue: logical plane, "Speed").

1. Packing throughput on pre-tokenized input, one core: real token arrays
   (stdlib sources tokenized once up front with a BPE trained offline), packed
   by `Plan.step` (seq_len 2048) with concat and with bestfit, on a plan and on
   a `Plan(reference=True)`, interleaved in the same run (since the columnar
   plane was removed both are `Plan.step`, the specification; the serving path
   is `fast.fast_steps`, timed by bench/fused_mix.py). Targets (issue 9): concat >= 100 M
   tokens/s, bestfit >= 20 M tokens/s.
2. Tokenize + pack against raw `tokenizers` batch encoding of the same text in
   the same run: the docs callback tokenizes each object's texts in one
   `Encoder.encode_batch` call (as loaderd's DocSource does) and the packer
   consumes them. Target: >= 0.85x of the raw tokens/s.
   Packing and restore are timed in CPU time of the packing thread (per-core
   figures that hold on a shared, noisy machine); tokenize + pack in wall time.
3. Restore cost: state -> JSON -> state -> first step, from the state after
   step 10 and from a state with counters of step 1,000,000 (same cursors with
   draws/rows/epochs advanced: the cost must not depend on them). Target:
   equal within noise.

Prints a table, one JSON line, and writes bench/out/logical.json.
Run: ``.venv/bin/python bench/logical.py [--steps N]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))

import numpy as np  # noqa: E402

from logical_helpers import make_manifest, make_spec  # noqa: E402
from sluice.loaderd.logical import Plan  # noqa: E402
from sluice.loaderd.logical.state import DataState  # noqa: E402


def corpus(limit_files: int = 200) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py"))[:limit_files]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        texts += ["".join(lines[i : i + 60]) for i in range(0, len(lines), 60)]
    return texts


def train_tokenizer(texts: list[str], out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts[:2000], trainer=trainer)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def pack_throughput(pool: list[np.ndarray], algorithm: str, steps: int, seq_len: int = 2048,
                    reference: bool = False) -> float:
    per_obj = 1000
    n = len(pool)
    m = make_manifest(
        [("code", [per_obj] * (n // per_obj), "0.7", "repeat"), ("more", [per_obj] * max(1, n // per_obj // 2), "0.3", "repeat")],
        seq_len=seq_len, algorithm=algorithm,
    )
    spec = make_spec(lanes=8, global_batch=64, micro_batch=8)
    plan = Plan(m, spec, reference=reference)

    def docs(ref):
        return pool[ref.index % n]

    state = plan.initial_state()
    for _ in range(3):
        _, state = plan.step(state, docs)
    # CPU time of this (single) thread: tokens per second per core, robust to
    # other processes sharing the machine.
    t0 = time.thread_time()
    for _ in range(steps):
        _, state = plan.step(state, docs)
    dt = time.thread_time() - t0
    return steps * spec.global_batch * seq_len / dt


def tokenize_pack(texts: list[str], tok_path: Path, reps: int) -> tuple[float, float]:
    """(raw tokens/s, tokenize+pack tokens/s) on the same texts, best of `reps`."""
    from tokenizers import Tokenizer

    from sluice.tokenize import load_tokenizer

    raw_tok = Tokenizer.from_file(str(tok_path))
    enc = load_tokenizer(str(tok_path))
    per_obj = 200
    objs = [texts[i : i + per_obj] for i in range(0, len(texts) - per_obj + 1, per_obj)]
    texts = [t for o in objs for t in o]
    m = make_manifest([("code", [per_obj] * len(objs), "1", "stop")], seq_len=2048)
    spec = make_spec(lanes=8, global_batch=8, micro_batch=1, order="none")
    raw_best = ours_best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = raw_tok.encode_batch(texts, add_special_tokens=False)
        total = sum(len(e.ids) for e in out)
        raw_best = max(raw_best, total / (time.perf_counter() - t0))

        plan = Plan(m, spec)
        # As loaderd's DocSource: objects are tokenized whole, one encode_batch
        # each, by a worker thread running ahead of the packer (bounded: 4).
        pool = ThreadPoolExecutor(max_workers=1)
        futures: dict[int, Future] = {}
        decoded: dict[int, list[np.ndarray]] = {}

        def ahead(first: int) -> None:
            for o in range(first, min(first + 4, len(objs))):
                if o not in futures:
                    futures[o] = pool.submit(enc.encode_batch, objs[o])

        def docs(ref):
            got = decoded.get(ref.obj)
            if got is None:
                ahead(ref.obj)
                got = decoded[ref.obj] = futures.pop(ref.obj).result()
            return got[ref.record]

        t0 = time.perf_counter()
        state = plan.initial_state()
        served = 0
        try:
            while True:
                _, state = plan.step(state, docs)
                served += spec.global_batch * 2048
        except Exception as exc:  # EndOfStream: all text consumed
            if type(exc).__name__ != "EndOfStream":
                raise
        dt = time.perf_counter() - t0
        pool.shutdown()
        tokens = sum(len(d) for v in decoded.values() for d in v)
        ours_best = max(ours_best, tokens / dt)
    return raw_best, ours_best


def restore_cost(pool: list[np.ndarray], far: bool, reps: int = 30) -> float:
    n = len(pool)
    m = make_manifest([("code", [1000] * (n // 1000), "0.7", "repeat"), ("more", [1000] * 2, "0.3", "repeat")], seq_len=2048)
    spec = make_spec(lanes=8, global_batch=64, micro_batch=8)
    plan = Plan(m, spec)

    def docs(ref):
        return pool[ref.index % n]

    state = plan.initial_state()
    for _ in range(11):
        _, state = plan.step(state, docs)
    if far:  # the same cursors, a million steps on: counters and epochs advanced
        lanes = {
            k: replace(
                v,
                draws=v.draws + 4_000_000,
                rows=v.rows + 8_000_000,
                sources=tuple(replace(c, epoch=c.epoch + 700, docs=c.docs + 2_000_000, tokens=c.tokens + 2_000_000_000) for c in v.sources),
            )
            for k, v in state.lanes.items()
        }
        state = DataState(state.dataset_id, state.runspec_digest, 1_000_000, lanes)
    times = []
    for _ in range(reps):
        blob = json.dumps(state.state_dict())
        t0 = time.thread_time()
        restored = plan.load_state(json.loads(blob))
        plan.step(restored, docs)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per packing measurement")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    texts = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = train_tokenizer(texts, Path(tmp))
        from sluice.tokenize import load_tokenizer

        pool = load_tokenizer(str(tok_path)).encode_batch(texts)
        mean_doc = float(np.mean([len(d) for d in pool]))
        # interleaved, best of `reps` each: the first run in a process also pays one-time costs
        runs: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.reps):
            for alg in ("concat", "bestfit"):
                for ref in (False, True):
                    runs.setdefault((alg, ref), []).append(pack_throughput(pool, alg, args.steps, reference=ref))
        concat, concat_ref = max(runs[("concat", False)]), max(runs[("concat", True)])
        bestfit, bestfit_ref = max(runs[("bestfit", False)]), max(runs[("bestfit", True)])
        raw, ours = tokenize_pack(texts, tok_path, args.reps)
    near = restore_cost(pool, far=False)
    far = restore_cost(pool, far=True)
    result = {
        "bench": "logical",
        "docs": len(pool),
        "mean_doc_tokens": round(mean_doc, 1),
        "concat_tokens_per_s": round(concat),
        "concat_reference_tokens_per_s": round(concat_ref),
        "bestfit_tokens_per_s": round(bestfit),
        "bestfit_reference_tokens_per_s": round(bestfit_ref),
        "raw_tokenize_tokens_per_s": round(raw),
        "tokenize_pack_tokens_per_s": round(ours),
        "tokenize_pack_ratio": round(ours / raw, 3),
        "restore_step10_ms": round(near * 1e3, 3),
        "restore_step1e6_ms": round(far * 1e3, 3),
        "restore_ratio": round(far / near, 3),
    }
    rows = [
        ("concat packing (1 core)", f"{concat / 1e6:.1f} M tok/s",
         f"target >= 100 M; reference plane {concat_ref / 1e6:.1f} M ({concat / concat_ref:.2f}x)"),
        ("bestfit packing (1 core)", f"{bestfit / 1e6:.1f} M tok/s",
         f"target >= 20 M; reference plane {bestfit_ref / 1e6:.1f} M"),
        ("raw tokenizers encode_batch", f"{raw / 1e6:.2f} M tok/s", "baseline"),
        ("tokenize + pack", f"{ours / 1e6:.2f} M tok/s", f"ratio {ours / raw:.2f} (target >= 0.85)"),
        ("restore + first step @10", f"{near * 1e3:.2f} ms", ""),
        ("restore + first step @1e6", f"{far * 1e3:.2f} ms", f"ratio {far / near:.2f} (target ~1)"),
    ]
    print(f"mean document: {mean_doc:.0f} tokens; seq_len 2048; 8 lanes; global batch 64")
    for name, value, note in rows:
        print(f"{name:<30}{value:>16}   {note}")
    line = json.dumps(result)
    print(line)
    out = _REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "logical.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
