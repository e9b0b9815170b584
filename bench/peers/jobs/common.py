"""What every job shares: its config, the consumer loop, the one JSON line it prints.

A job is run by the driver with a peer's own python (no sluice importable), as
``python jobs/<peer>_job.py CONFIG_JSON``. Every job imports torch (here, as a
training script does) and the consumer loop takes every micro-batch as a torch
tensor (`as_tensor`): a loader that hands tensors pays nothing more, one that
hands numpy arrays or lists pays the conversion inside its timed loop, as it
would in a trainer. The consumer touches every micro-batch (a sum over its
ids) so nothing is delivered lazily. Throughput is steady: counted from the
end of the `warm`-th micro-batch to the last one. The first-batch time is
reported as a wall-clock instant (time.time()); the driver subtracts the
instant it started the process.

CPU: the job's whole process tree (the job, its loader's workers, sluice's
daemon and its tokenizer processes: `tree_cpu_s`), as CPU
seconds per million delivered tokens, over the steady window
(`cpu_s_per_mtok`) and from the process start (`cpu_e2e_s_per_mtok`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

SEQ = 2048
MICRO = 8
WARM = 2


def config() -> dict[str, Any]:
    return json.loads(sys.argv[1])


def consume(batches: Iterable[Any], n: int, *, at: int | None = None,
            on_at: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Pull `n` micro-batches of MICRO x SEQ ids; call on_at(i) after micro-batch `at` (1-based)."""
    first = t_warm = cpu_warm = None
    tokens = tok_warm = 0
    count = 0
    saved = None
    for batch in batches:
        rows = as_tensor(batch)
        if tuple(rows.shape) != (MICRO, SEQ):
            raise SystemExit(f"job: micro-batch {count} has shape {tuple(rows.shape)}, expected {(MICRO, SEQ)}")
        int(rows.sum())
        count += 1
        tokens += rows.numel()
        if count == 1:
            first = time.time()
        if count == WARM:
            t_warm, tok_warm, cpu_warm = time.perf_counter(), tokens, tree_cpu_s()
        if at is not None and count == at and on_at is not None:
            saved = on_at(count)
        if count == n:
            break
    if count < n or t_warm is None:
        raise SystemExit(f"job: stream ended after {count} micro-batches, wanted {n}")
    rate = (tokens - tok_warm) / (time.perf_counter() - t_warm)
    cpu = tree_cpu_s()
    steady_cpu = None if cpu is None or cpu_warm is None else cpu - cpu_warm
    return {"first_batch_wall": first, "last_batch_wall": time.time(), "tokens_per_s": rate, "batches": count,
            "tokens": tokens, "saved": saved,
            "cpu_s_per_mtok": None if steady_cpu is None else steady_cpu / ((tokens - tok_warm) / 1e6),
            "cpu_e2e_s_per_mtok": None if cpu is None else cpu / (tokens / 1e6)}


def as_tensor(batch: Any) -> torch.Tensor:
    """The micro-batch's input ids as a torch tensor (a dict's ``input_ids``; numpy or lists converted)."""
    if isinstance(batch, dict):
        batch = batch["input_ids"]
    return batch if isinstance(batch, torch.Tensor) else torch.as_tensor(batch)


def tree_cpu_s() -> float | None:
    """User + system CPU seconds of this process and every live descendant, each with its waited-for children
    (/proc; None where there is none): a job's whole cost, its loader's worker or daemon processes included."""
    try:
        parent: dict[int, int] = {}
        times: dict[int, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # (gone meanwhile)
            parent[int(name)] = int(fields[1])
            times[int(name)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    except OSError:
        return None
    tree, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [c for c, p in parent.items() if p == pid and c not in tree]
    return sum(times.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def timed_first(make_iter: Callable[[], Iterable[Any]]) -> float:
    """Seconds from building a restored pipeline to its first micro-batch in hand."""
    t = time.perf_counter()
    for batch in make_iter():
        as_tensor(batch).sum()
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
