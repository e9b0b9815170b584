"""What every job shares: its config, the consumer loop, the one JSON line it prints.

A job is run by the driver with a peer's own python (no sluice importable), as
``python jobs/<peer>_job.py CONFIG_JSON``. The consumer touches every
micro-batch (a sum over its ids) so nothing is delivered lazily. Throughput is
steady: counted from the end of the `warm`-th micro-batch to the last one.
The first-batch time is reported as a wall-clock instant (time.time()); the
driver subtracts the instant it started the process.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

SEQ = 2048
MICRO = 8
WARM = 2


def config() -> dict[str, Any]:
    return json.loads(sys.argv[1])


def consume(batches: Iterable[Any], n: int, *, at: int | None = None,
            on_at: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Pull `n` micro-batches of MICRO x SEQ ids; call on_at(i) after micro-batch `at` (1-based)."""
    first = t_warm = None
    tokens = tok_warm = 0
    count = 0
    saved = None
    for batch in batches:
        rows = as_rows(batch)
        if rows.shape != (MICRO, SEQ):
            raise SystemExit(f"job: micro-batch {count} has shape {rows.shape}, expected {(MICRO, SEQ)}")
        int(rows.sum())
        count += 1
        tokens += rows.size
        if count == 1:
            first = time.time()
        if count == WARM:
            t_warm, tok_warm = time.perf_counter(), tokens
        if at is not None and count == at and on_at is not None:
            saved = on_at(count)
        if count == n:
            break
    if count < n or t_warm is None:
        raise SystemExit(f"job: stream ended after {count} micro-batches, wanted {n}")
    rate = (tokens - tok_warm) / (time.perf_counter() - t_warm)
    return {"first_batch_wall": first, "last_batch_wall": time.time(), "tokens_per_s": rate, "batches": count,
            "tokens": tokens, "saved": saved}


def as_rows(batch: Any) -> Any:
    import numpy as np

    if isinstance(batch, dict):
        batch = batch["input_ids"]
    if hasattr(batch, "numpy"):
        batch = batch.numpy()
    return np.asarray(batch)


def timed_first(make_iter: Callable[[], Iterable[Any]]) -> float:
    """Seconds from building a restored pipeline to its first micro-batch in hand."""
    t = time.perf_counter()
    for batch in make_iter():
        as_rows(batch).sum()
        break
    return time.perf_counter() - t


def restore(result: dict[str, Any], make_iter: Callable[[], Iterable[Any]], note: str) -> None:
    """Time the restored pipeline into result; a restore that fails is reported, not fatal to the job."""
    try:
        result["restore_s"] = timed_first(make_iter)
        result["restore_note"] = note
    except Exception as exc:  # a peer's own failure is a result to report
        result["restore_note"] = f"restore failed: {type(exc).__name__}: {str(exc)[:160]}"


def emit(result: dict[str, Any]) -> None:
    result.pop("saved", None)
    print(json.dumps(result), flush=True)


def pack_concat(token_lists: Iterable[list[int]], eos: int) -> Iterable[list[list[int]]]:
    """Concat-pack documents (each + eos) into SEQ-token rows, MICRO rows per micro-batch (residual carried)."""
    buf: list[int] = []
    rows: list[list[int]] = []
    for ids in token_lists:
        buf.extend(ids)
        buf.append(eos)
        while len(buf) >= SEQ:
            rows.append(buf[:SEQ])
            del buf[:SEQ]
            if len(rows) == MICRO:
                yield rows
                rows = []
