"""The rate this node delivers for a run spec, measured: on the fly and from tokens, for a bounded time.

Steps are made by the daemon's own step function (`StepMaker`, as a
replica's producer runs it: the first step alone, then `STEPS_AT_ONCE` a
call) over the daemon's own data path (`open_data_path`: node cache, encoder,
DocSource with loaderd's default workers), in a scratch node cache, so what
is measured is what this node's daemon would do, minus the wire:

    phase "on the fly"   empty cache: objects fetched from their sources, text tokenized
    (fills finish)       the tokens of every object the phase started are published
    phase "from tokens"  the same steps again, new DocSource, same cache: tokens mapped

For a pre-tokenized manifest the first phase is a cold fetch of its shards
and only the second is quoted. A phase runs until `seconds` pass or
`max_steps` steps are made; its rate is the steps after the first one, times
`global_batch x seq_len` tokens, over the time from the first step to the
end of the phase (the deadline when time ran out: a step still waiting
counts against the rate). The first step's wait is reported apart
(`first_step_s`). One producer makes every lane's step (a daemon serving R
replicas runs R producers: this is the rate of one). The fused path's
compiled kernel is off (numpy), as in the daemon's first 2,048 steps.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

_STOP_S = 10.0  # the longest a phase's end waits for its producer thread and workers


@dataclass(frozen=True)
class Phase:
    """One measurement: `steps` made in `seconds` (from the first step), `tokens_per_s`, why it `stopped`."""

    name: str
    steps: int
    seconds: float
    first_step_s: float | None
    tokens_per_s: float
    stopped: str  # "time", "steps", "end of stream", or an error naming the step
    note: str = ""

    def to_obj(self) -> dict[str, Any]:
        obj = asdict(self)
        obj["seconds"] = round(self.seconds, 3)
        obj["tokens_per_s"] = round(self.tokens_per_s, 1)
        obj["first_step_s"] = None if self.first_step_s is None else round(self.first_step_s, 3)
        return obj


@dataclass(frozen=True)
class Rates:
    """Both phases, the tokens one step serves, and the threads the tokenizer had."""

    on_the_fly: Phase | None  # None: the manifest is pre-tokenized
    from_tokens: Phase | None  # None: the first phase made no step (nothing to replay)
    tokens_per_step: int
    tokenizer_threads: int
    cpus: int

    def to_obj(self) -> dict[str, Any]:
        return {"on_the_fly": None if self.on_the_fly is None else self.on_the_fly.to_obj(),
                "from_tokens": None if self.from_tokens is None else self.from_tokens.to_obj(), "tokens_per_step": self.tokens_per_step,
                "tokenizer_threads": self.tokenizer_threads, "cpus": self.cpus}


def _produce(maker: Any, plan: Any, limit: int, stop: threading.Event, times: list[float], out: dict[str, str]) -> None:
    """Make up to `limit` steps from the start, appending each one's completion time; stop when `stop` is set."""
    from sluice.loaderd.physical.producer import STEPS_AT_ONCE
    from sluice.wire import errorcodes

    state = plan.initial_state()
    try:
        first, state = maker.produce_step(state)  # alone: its time is the cold start, apart from the steady rate
        entries = [first]
        while True:
            for entry in entries:
                if entry.error is not None:
                    code, message, _ = entry.error
                    out["stopped"] = "end of stream" if code in (errorcodes.E_END, errorcodes.E_EXHAUSTED) else message
                    return
                times.append(time.perf_counter())
            if len(times) >= limit:
                out["stopped"] = "steps"
                return
            if stop.is_set() or state is None:
                return
            entries, state = maker.produce_run(state, min(STEPS_AT_ONCE, limit - len(times)))
    except Exception as exc:  # noqa: BLE001 - a phase that fails is reported, never a traceback
        out["stopped"] = f"{type(exc).__name__}: {exc}"


def run_phase(data: Any, name: str, seconds: float, max_steps: int) -> Phase:
    """Make steps over `data` (a DataPath) for at most `seconds` / `max_steps`; the Phase measured.

    The producer runs in a thread; at the deadline it is told to stop after
    its call under way, and if that call does not end within `_STOP_S` the
    DocSource is closed (a step stuck waiting for a fill is cut off).
    """
    from sluice.loaderd.physical.producer import StepMaker

    plan = data.plan()
    maker = StepMaker(plan, data.docs, replica=0, replicas=1)
    tokens_per_step = plan.spec.global_batch * data.manifest.packing.seq_len
    times: list[float] = []
    out: dict[str, str] = {}
    stop = threading.Event()
    worker = threading.Thread(target=_produce, args=(maker, plan, max_steps, stop, times, out),
                              name=f"sluice-preflight-{name.replace(' ', '-')}", daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(seconds)
    end = time.perf_counter()
    stop.set()
    if worker.is_alive():
        out.setdefault("stopped", "time")
        worker.join(_STOP_S)  # the call under way ends; the fills it started go on (the second phase reads them)
        if worker.is_alive():
            data.docs.close(_STOP_S)  # a step stuck waiting for a fill is cut off
            worker.join(_STOP_S)
    else:
        end = times[-1] if times and out.get("stopped") in ("steps", "end of stream") else end
    made = [t for t in times if t <= end]  # steps finished after the deadline do not count
    first = made[0] - t0 if made else None
    steady = max(end - made[0], 1e-9) if made else end - t0
    if len(made) >= 2:
        rate = (len(made) - 1) * tokens_per_step / steady
    else:  # no steady window: the one step (or none) over the whole phase, a lower bound
        rate = len(made) * tokens_per_step / max(end - t0, 1e-9)
    note = "" if len(made) >= 2 else "fewer than 2 steps: the rate is over the whole phase, the first step's wait included"
    return Phase(name, len(made), steady if len(made) >= 2 else end - t0, first, rate,
                 out.get("stopped", "time"), note)


def measure(manifest: Any, spec: Any, scratch: str, *, seconds: float, max_steps: int, workers: int = 2,
            allowed_roots: Any = None) -> Rates:
    """Both phases in the node cache folder `scratch` (made empty by the caller); see the module docstring.

    Raises the data path's own errors when it cannot open (a tokenizer that
    does not load, a global order the decode budget refuses: what would stop
    the daemon at start), naming the cause.
    """
    from sluice.loaderd.options import OPTIONS
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.loaderd.physical.demandpool import default_workers
    from sluice.tokenize.threads import available_cpus, current_threads

    os.makedirs(scratch, exist_ok=True)
    # (the order's start check over the daemon's default window, its step lead: what would stop the daemon)
    lead = next(o.field_default() for o in OPTIONS if o.field == "lead_steps")
    config = DataPathConfig(cache_dir=scratch, cache_budget=1 << 50, workers=workers, window_steps=lead,
                            demand_workers=default_workers(), allowed_roots=allowed_roots, jit="off", scrub_rate=0)
    text = any(src.format != "tokens" for src in manifest.sources)
    with open_data_path(manifest, spec, config) as data:
        cold = run_phase(data, "on the fly" if text else "cold cache", seconds, max_steps)
        filled = data.docs.wait_filled(max(seconds, _STOP_S))
    if cold.steps == 0:  # nothing to replay from tokens: the first phase is all there is to say
        warm = None
    else:
        with open_data_path(manifest, spec, config) as data:
            warm = run_phase(data, "from tokens", seconds, max(2, cold.steps) if text else max_steps)
        if not filled:
            warm = Phase(warm.name, warm.steps, warm.seconds, warm.first_step_s, warm.tokens_per_s, warm.stopped,
                         f"objects were still being tokenized {max(seconds, _STOP_S):g} s after the first phase; "
                         "this phase tokenized them again, so its rate is low")
    return Rates(cold if text else None, warm if text or warm is not None else cold,
                 spec.global_batch * manifest.packing.seq_len, current_threads(), available_cpus())
