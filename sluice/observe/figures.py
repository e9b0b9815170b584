"""The run's figures: its record (`sluice report --json`) computed from a `RunRecord` and the checkpoints.

Definitions (docs/observe.md, "The run's record"):

* tokens served: what the daemons sent in BATCH messages (``sluice_served_tokens_total``,
  padding included), per source and replica from ``sluice_source_served_tokens_total``;
  padding is the total's rest;
* steps trained: the last committed step + 1 (steps 0..S), from the checkpoints' data
  state when given, else the daemons' ``committed`` log lines, else their
  ``sluice_committed_step`` gauges; the lowest over replicas; tokens trained: that
  times the tokens of one global step (the daemon's start log line);
* allocated time: first to last thing seen (sample, log line); down time: allocated
  time no daemon's samples cover (a daemon's samples cover its first to its last;
  restarts and start-up show as gaps, to within one sampling interval); stall
  time: the clients' input wait (``sluice_client_input_wait_seconds_sum``) over
  the replicas; replay: tokens served but not trained, as their share of the time
  served; ETTR = (allocated - down - stall - replay) / allocated; effective tokens/s
  = tokens trained / allocated time.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError, ObserveError
from sluice.observe.record import RunRecord
from sluice.observe.scrape import histogram_quantile, shown
from sluice.observe.totals import SERVED, WAIT

RECORD_KIND = "sluice.run-record/1"
_MAX_CHECKPOINTS = 100_000  # committed checkpoints listed from one folder
_MIN_SAMPLES = 3  # samples a daemon needs for its span to say when it was up


def read_checkpoints(dirs: list[str]) -> list[dict[str, Any]]:
    """The committed checkpoints of each checkpoint folder (``DIR/ckpt/s<S>-g<G>/manifest.json``, parsed and
    cross-checked as `sluice ckpt` does), oldest first; ObserveError naming the folder otherwise."""
    from sluice.trainer_hooks.layout import Paths
    from sluice.trainer_hooks.retention import committed_folders
    from sluice.trainer_hooks.verify import load_checkpoint_manifest

    out = []
    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise ObserveError(f"--checkpoints {shown(d)}: not a folder (a checkpoint folder holds ckpt/ and run.json)")
        try:
            folders = committed_folders(Paths(root))
            if len(folders) > _MAX_CHECKPOINTS:
                raise ObserveError(f"--checkpoints {shown(d)}: more than {_MAX_CHECKPOINTS} checkpoints")
            for (step, gen), folder in sorted(folders.items()):
                man = load_checkpoint_manifest(folder)
                data = man.data or {}
                out.append({"name": shown(folder.name), "folder": shown(d), "step": step, "generation": gen,
                            "data_step": data.get("step"), "dataset_id": data.get("dataset_id"),
                            "runspec_digest": data.get("runspec_digest"), "run_id": man.run_id})
        except (CheckpointError, OSError) as exc:
            raise ObserveError(f"--checkpoints {shown(d)}: {shown(str(exc), 400)}") from exc
    return out


def _iso(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _up_spans(rec: RunRecord, daemons: list[Any]) -> list[tuple[float, float]]:
    """When each sampled daemon instance was up: its first to its last sample, from its start when its log
    line says when (the start naming the same metrics port, at or before the instance's first sample)."""
    starts: dict[int, list[float]] = {}
    for s in rec.started:
        if isinstance(s.get("metrics_port"), int) and isinstance(s.get("wall"), float):
            starts.setdefault(s["metrics_port"], []).append(s["wall"])
    ports = {id(d): _port(url) for url, d in rec.daemons.items()}
    out = []
    for d in daemons:
        walls = starts.get(ports[id(d)], []) if ports[id(d)] is not None else []
        for first, last in d.spans:
            began = [w for w in walls if w <= first]
            out.append((max(began) if began else first, last))
    return out


def _port(url: str) -> int | None:
    head = url.removesuffix("/metrics").rpartition(":")[2]
    return int(head) if head.isdigit() and len(head) <= 5 else None


def _one(values: list[Any]) -> Any:
    """The value every input agrees on; a sorted list when they differ (the page says so); None when none."""
    got = sorted({v for v in values if v is not None}, key=str)
    return got[0] if len(got) == 1 else (got or None)


def _trained(rec: RunRecord, ckpts: list[dict[str, Any]]) -> tuple[int | None, str]:
    """(steps trained, where from): see the module docstring."""
    if ckpts:
        last = max(ckpts, key=lambda c: (c["step"], c["generation"]))
        s = last["data_step"] if isinstance(last["data_step"], int) else last["step"]
        return s + 1, "checkpoints"
    if rec.commits:
        return min(rec.commits.values()) + 1, "daemon logs (committed)"
    gauges: dict[str, float] = {}
    for d in rec.daemons.values():
        for r, step in d.committed.items():
            gauges[r] = max(gauges.get(r, -1.0), step)
    if gauges and min(gauges.values()) > 0:  # (the gauge reads 0 before a replica's first commit)
        return int(min(gauges.values())) + 1, "metrics (sluice_committed_step)"
    return None, "no commits: give --checkpoints DIR or the daemons' logs"


def run_figures(rec: RunRecord, ckpts: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON record: identity, time, tokens served and trained, waits, restarts, fencing, ETTR."""
    daemons = list(rec.daemons.values())
    served = sum(d.total(SERVED) for d in daemons)
    per_source: dict[str, float] = {}
    per_replica: dict[str, float] = {}
    for d in daemons:
        for (r, s), c in d.per_source.items():
            per_source[s] = per_source.get(s, 0.0) + c.total
            per_replica[r] = per_replica.get(r, 0.0) + c.total
    counted = sum(per_source.values())
    said = rec.started
    # (a checkpoint's run_id is the trainer's name for its run, not the run spec's: not compared)
    ids = {k: _one([s.get(k) for s in said] + [c.get(k) for c in ckpts if k != "run_id"])
           for k in ("run_id", "dataset_id", "runspec_digest")}
    tps = _one([s.get("tokens_per_step") for s in said])
    tps = tps if isinstance(tps, int) else None
    replicas = _one([s.get("replicas") for s in said])
    replicas = replicas if isinstance(replicas, int) else max(len(per_replica), len(rec.commits), 1)
    steps, steps_from = _trained(rec, ckpts)
    trained = steps * tps if steps is not None and tps is not None else None

    walls = [w for d in daemons for w in (d.first, d.last)] + [w for w in rec.log_span if math.isfinite(w)]
    start, end = (min(walls), max(walls)) if walls else (None, None)
    allocated = end - start if start is not None else 0.0
    wait_s = sum(d.total(WAIT + "_sum") for d in daemons)
    waits = sum(d.total(WAIT + "_count") for d in daemons)
    sampled = [d for d in daemons if len(d.points) >= _MIN_SAMPLES]
    ettr: dict[str, Any] = {"value": None, "allocated_s": allocated}
    if allocated > 0 and sampled:
        down = max(0.0, allocated - _union(_up_spans(rec, sampled)))
        stall = min(wait_s / replicas, max(0.0, allocated - down))
        replayed = max(0.0, served - trained) if trained is not None else 0.0
        replay = (allocated - down - stall) * (replayed / served) if served else 0.0
        productive = max(0.0, allocated - down - stall - replay)
        ettr.update(value=productive / allocated, productive_s=productive, down_s=down, stall_s=stall,
                    replay_s=replay, replayed_tokens=int(replayed))
    else:
        ettr["why_not"] = ("needs `sluice top --record` samples through the run (at least "
                           f"{_MIN_SAMPLES} per daemon) and a duration")
    wait_b = _summed([d.wait_buckets for d in daemons])
    ttb_b = _summed([d.ttb_buckets for d in daemons])
    return {
        "kind": RECORD_KIND,
        **ids,
        "start": _iso(start) if start is not None else None, "end": _iso(end) if end is not None else None,
        "duration_s": allocated,
        "served": {"tokens": int(served), "batches": int(sum(d.total("sluice_batches_served_total") for d in daemons)),
                   "padding_tokens": int(served - counted) if per_source else None,
                   "per_source": {k: int(v) for k, v in sorted(per_source.items())},
                   "per_replica": {k: int(v) for k, v in sorted(per_replica.items(), key=lambda kv: _num(kv[0]))},
                   "tokens_per_s": served / allocated if allocated > 0 else None},
        "trained": {"steps": steps, "steps_from": steps_from, "tokens_per_step": tps, "tokens": trained,
                    "effective_tokens_per_s": trained / allocated if trained is not None and allocated > 0 else None,
                    "committed_per_replica": {str(r): s for r, s in sorted(rec.commits.items())}},
        "input_wait": {"seconds": wait_s, "micro_batches": int(waits), "mean_s": wait_s / waits if waits else None,
                       "p50_s": histogram_quantile(0.5, wait_b), "p99_s": histogram_quantile(0.99, wait_b)},
        "time_to_batch": {"p50_s": histogram_quantile(0.5, ttb_b), "p99_s": histogram_quantile(0.99, ttb_b)},
        "daemons": len(daemons), "daemon_starts": rec.starts, "restarts": max(0, rec.starts - 1),
        "restores": rec.restores,
        "fencing": {"generation_changes": _generation_changes(rec),
                    "fenced_requests": int(sum(d.total("fenced") for d in daemons))},
        "ettr": ettr,
        "checkpoints": ckpts,
        "ledger": _ledger(rec),
    }


def _num(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 62, text)


def _summed(hists: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    total: dict[float, float] = {}
    for buckets in hists:
        for le, c in buckets:
            total[le] = total.get(le, 0.0) + c
    return sorted(total.items())


def _generation_changes(rec: RunRecord) -> int:
    """Times a daemon's generation went up (a restore or commit of a newer trainer fenced the older): in its
    samples, or in the logs' events (in time order) where they say more."""
    n = 0
    for points in rec.generations.values():
        n += sum(1 for (_, a), (_, b) in zip(points, points[1:]) if b > a)
    gens = [g for _, _, g in sorted(rec.events)]
    return max(n, sum(1 for a, b in zip(gens, gens[1:]) if b > a))


def _ledger(rec: RunRecord) -> dict[str, Any] | None:
    led = rec.ledger
    if led is None or led.last is None:
        return None
    return {"until_step": led.last["until_step"], "unit": led.last["unit"], "policy": led.last["policy"],
            "sources": [{k: r.get(k) for k in ("source", "docs", "tokens", "loss_tokens", "target_share",
                                                "realized_share")} for r in led.last["rows"]]}
