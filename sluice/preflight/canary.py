"""`sluice preflight --canary`: a few steps through a real loaderd, a kill -9, a restore, the same stream.

    reference   `sluice plan`'s digests of steps 0 .. 2K-1 (the pure plan over a node cache)
    daemon 1    a real loaderd child (`EmbeddedDaemon`), a client takes steps 0 .. K-1, keeps the
                data state after step K-1 (the cursor a checkpoint would hold)
    SIGKILL     daemon 1 dies as in a node failure: no stop, no flush
    daemon 2    a new loaderd on the same node cache and state folder; a new client RESTOREs the
                cursor and takes steps K .. 2K-1
    check       every step's digest (BLAKE3 of its micro-batch arrays, `wire.arrays_digest`)
                equals the plan's; then daemon 2 is stopped

Every wait is bounded (`timeout_s`: a daemon's start, one micro-batch) and
both daemons are stopped on every path (SIGTERM, then SIGKILL); they also
stop within 2 s if this process dies (the embedded daemon's parent pipe).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from sluice.errors import SluiceError
from sluice.preflight.checks import Check


def plan_digests(manifest: Any, spec: Any, cache_dir: str, steps: int) -> dict[int, str]:
    """step -> digest of steps 0 .. steps-1 for one replica, as `sluice plan --replicas 1` prints them."""
    from sluice.loaderd.logical import micro_batches_digest
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path

    out: dict[int, str] = {}
    with open_data_path(manifest, spec, DataPathConfig(cache_dir=cache_dir, cache_budget=1 << 50,
                                                       verify_on_read=False)) as data:
        plan = data.plan()
        state = plan.initial_state()
        while state.step + 1 < steps:
            batch, state = plan.step(state, data.docs)
            out[batch.step] = micro_batches_digest(plan.replica_micro_batches(batch, 1, 0))
    return out


def _take(client: Any, start: int, stop: int) -> dict[int, str]:
    """step -> digest of the micro-batches `client` yields for steps start .. stop-1."""
    from sluice.wire.protocol import arrays_digest

    got: dict[int, str] = {}
    for step, micros in client.steps(start):
        got[step] = arrays_digest(micros)  # (over the digest's arrays, `wire.ARRAY_ORDER`, by name)
        if step + 1 >= stop:
            break
    return got


def run_canary(manifest_path: str, runspec_path: str, manifest: Any, spec: Any, scratch: str, *, steps: int = 3,
               timeout_s: float = 120.0, daemon_args: tuple[str, ...] = ()) -> Check:
    """The canary (module docstring) in the empty folder `scratch`; a Check naming what differed or failed."""
    from sluice.client.embedded import EmbeddedDaemon

    cache = os.path.join(scratch, "cache")
    os.makedirs(scratch, exist_ok=True)
    t0 = time.monotonic()
    try:
        expected = plan_digests(manifest, spec, os.path.join(scratch, "plan-cache"), 2 * steps)
    except SluiceError as exc:
        return Check("canary", "fail", "the plan's reference stream could not be computed", (str(exc),))
    if len(expected) < 2 * steps:
        return Check("canary", "skip", f"the stream has only {len(expected)} steps; the canary needs {2 * steps}")
    args = ("--log-level", "warning", *daemon_args)
    got: dict[int, str] = {}
    daemons: list[Any] = []
    stage = "starting the first loaderd"
    try:
        first = EmbeddedDaemon(manifest_path, runspec_path, cache_dir=cache, cache_budget="1024TiB",
                               extra_args=args, start_timeout_s=timeout_s)
        daemons.append(first)
        stage = f"taking steps 0-{steps - 1} from the first loaderd"
        client = first.client(as_numpy=True, max_wait_s=timeout_s, end_step=steps)
        try:
            got.update(_take(client, 0, steps))
            state = client.state_dict()
        finally:
            client.close()
        stage = "killing the first loaderd (SIGKILL)"
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout_s)
        killed = first.proc.returncode
        stage = "starting the second loaderd on the same cache"
        second = EmbeddedDaemon(manifest_path, runspec_path, cache_dir=cache, cache_budget="1024TiB",
                                extra_args=args, start_timeout_s=timeout_s)
        daemons.append(second)
        stage = f"restoring step {steps - 1}'s cursor and taking steps {steps}-{2 * steps - 1}"
        client = second.client(as_numpy=True, max_wait_s=timeout_s, end_step=2 * steps)
        try:
            client.reset(state)
            got.update(_take(client, steps, 2 * steps))
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - SluiceError, OSError, subprocess.TimeoutExpired: named, no traceback
        return Check("canary", "fail", f"failed while {stage}", (f"{type(exc).__name__}: {exc}",))
    finally:
        for daemon in daemons:
            daemon.close(grace_s=min(timeout_s, 10.0))
    wrong = [f"step {s}: loaderd served {got.get(s, 'nothing')[:16]}, the plan says {d[:16]}"
             for s, d in sorted(expected.items()) if got.get(s) != d]
    details = {"steps": 2 * steps, "killed_exit": killed, "seconds": round(time.monotonic() - t0, 2)}
    if wrong:
        return Check("canary", "fail", f"the stream after the restore differs from the plan at {len(wrong)} steps",
                     tuple(wrong), details)
    return Check("canary", "ok", f"steps 0-{steps - 1}, kill -9, restore, steps {steps}-{2 * steps - 1}: "
                 f"every digest equals the plan's ({details['seconds']} s)", details=details)
