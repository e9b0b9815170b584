"""Checkpoint exposed pause: sync vs async sluice save vs a plain torch.save.

Builds a model + AdamW state of about --mb megabytes (parameters plus two
moment buffers) and a 64-lane data state shaped like the data client's, then,
interleaved for --repeats rounds on the same filesystem:

* baseline  torch.save({"model", "optim"}) to one file + fsync (what a training
            script would do without sluice);
* sync      CheckpointManager.save (shards, BLAKE3, manifest, fenced publish);
* async     CheckpointManager(async_save=True).save: the exposed pause is the
            host-memory staging; the durability lag is until the publish.

Prints a table of medians and the ratios to the baseline, the data state's
share of checkpoint bytes and time (targets: < 1% and < 1 ms), and writes one
JSON line to stdout and bench/out/ckpt.json.

    .venv/bin/python bench/ckpt.py            # ~48 MB of state, about a minute
    .venv/bin/python bench/ckpt.py --full     # 240 MB of state (the issue's >= 200 MB)
"""

from __future__ import annotations

import sys

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow
# the standard library's tokenize: drop it before anything imports tokenize.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sluice.trainer_hooks.manager import CheckpointManager  # noqa: E402


class DataStateLike:
    """A data state with the shape of sluice's (64 lanes of pointers), JSON only."""

    def __init__(self, lanes: int = 64, sources: int = 4) -> None:
        self.lanes, self.sources, self.step = lanes, sources, 0

    def state_dict(self) -> dict:
        return {
            "kind": "sluice.data_state", "schema": 1, "dataset_id": "b3:" + "d" * 64,
            "runspec_digest": "b3:" + "5" * 64, "step": self.step,
            "lanes": {str(lane): {
                "draws": 1000 * self.step + lane,
                "sources": [{"position": 37 * self.step + s, "epoch": 0} for s in range(self.sources)],
                "residual": {"sample": f"b3:{lane:064x}", "record": 12345, "offset": 77},
                "realized": [str(9 * self.step + s) for s in range(self.sources)],
            } for lane in range(self.lanes)},
        }

    def load_state_dict(self, state: dict) -> None:
        self.reset(state)

    # The FencedStateful protocol: the manager stores this state as a JSON shard.
    def reset(self, state: dict | None = None) -> None:
        self.step = 0 if state is None else state["step"]

    def fence(self, generation: int) -> None:
        self.generation = generation

    def commit(self, step: int) -> None:
        self.committed = step

    def check_resize(self, saved_world_size: int, world_size: int) -> None:
        pass  # an elastic contract: the bench never resizes


def build(mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of 1024x1024 linears whose params + 2 Adam moments total about `mb` MB."""
    per_layer = (1024 * 1024 + 1024) * 4 * 3  # weight+bias, fp32, x3 with Adam moments
    layers = max(1, round(mb * 1e6 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()  # materialise exp_avg / exp_avg_sq
    return model, opt


def torch_save_baseline(path: Path, model, opt) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=48.0, help="model + optimizer state in MB (default 48)")
    parser.add_argument("--full", action="store_true", help="240 MB of state (the issue's >= 200 MB)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--dir", default=None, help="filesystem to write to (default: the system temp dir)")
    args = parser.parse_args(argv)
    mb = 240.0 if args.full else args.mb
    model, opt = build(mb)
    data = DataStateLike()
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-ckpt-", dir=args.dir))
    rows: dict[str, list[float]] = {"baseline": [], "sync": [], "async_pause": [], "async_lag": [],
                                    "data_s": []}
    total_bytes = data_bytes = 0
    try:
        sync = CheckpointManager(work / "sync", {"model": model, "optim": opt, "data": data}, keep_last=1)
        asy = CheckpointManager(work / "async", {"model": model, "optim": opt, "data": data}, keep_last=1,
                                async_save=True)
        for step in range(args.repeats):
            data.step = step
            rows["baseline"].append(torch_save_baseline(work / f"plain-{step}.pt", model, opt))
            (work / f"plain-{step}.pt").unlink()
            report = sync.save(step)
            rows["sync"].append(report.exposed_pause_s)
            rows["data_s"].append(report.data_seconds)
            total_bytes, data_bytes = report.bytes, report.data_bytes
            pause = asy.save(step).exposed_pause_s
            durable = asy.wait()
            rows["async_pause"].append(pause)
            rows["async_lag"].append(durable.durability_lag_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    # The client's own share: state_dict() alone (the rest is sluice's encode + write).
    capture = []
    for _ in range(21):
        t0 = time.perf_counter()
        data.state_dict()
        capture.append(time.perf_counter() - t0)
    med["data_capture_s"] = statistics.median(capture)
    result = {
        "bench": "ckpt",
        "state_mb": round(total_bytes / 1e6, 1),
        "repeats": args.repeats,
        "torch_save_s": med["baseline"],
        "sync_pause_s": med["sync"],
        "async_pause_s": med["async_pause"],
        "async_durability_lag_s": med["async_lag"],
        "sync_over_torch_save": med["sync"] / med["baseline"],
        "async_pause_over_torch_save": med["async_pause"] / med["baseline"],
        "data_state_bytes": data_bytes,
        "data_bytes_share": data_bytes / total_bytes,
        "data_state_ms": 1000 * med["data_s"],
        "data_state_dict_ms": 1000 * med["data_capture_s"],
        "data_time_share": med["data_s"] / med["sync"],
        "targets": {"data_bytes_share_lt": 0.01, "data_state_ms_lt": 1.0},
    }
    print(f"checkpoint of {result['state_mb']} MB (model + AdamW) + a 64-lane data state, median of {args.repeats}")
    print(f"{'what':34} {'seconds':>9} {'x torch.save':>13}")
    print(f"{'plain torch.save + fsync':34} {med['baseline']:>9.3f} {1.0:>13.2f}")
    print(f"{'sluice sync save (exposed pause)':34} {med['sync']:>9.3f} {result['sync_over_torch_save']:>13.2f}")
    print(f"{'sluice async save (exposed pause)':34} {med['async_pause']:>9.3f} "
          f"{result['async_pause_over_torch_save']:>13.2f}")
    print(f"{'sluice async durability lag':34} {med['async_lag']:>9.3f} {med['async_lag'] / med['baseline']:>13.2f}")
    print(f"data state: {data_bytes} bytes = {100 * result['data_bytes_share']:.4f}% of the checkpoint "
          f"(target < 1%), {result['data_state_ms']:.3f} ms = {100 * result['data_time_share']:.3f}% of the "
          f"sync save (target < 1 ms); of that, state_dict() itself {result['data_state_dict_ms']:.3f} ms")
    line = json.dumps(result)
    print(line)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ckpt.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
