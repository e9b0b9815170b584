"""The producer process of `loaderd --producer process`: its main loop (the daemon's side is procpipe.py).

It opens the data path as the daemon does, makes steps with the same
`StepMaker.produce_steps`, writes them into the shared ring the daemon mapped
(stepring.py) and sends their notices, one message per call; it waits at the
step lead and at the ring's limit for the daemon's floor (a shared word, a
FLOOR message to wake it), takes RESET and STOP, and sends metrics snapshots.
It exits when the daemon is gone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from sluice import wire
from sluice.loaderd.endpoint import COPY_BELOW
from sluice.loaderd.logical import DataState
from sluice.loaderd.physical import stepring
from sluice.loaderd.physical.stepqueue import StepEntry
from sluice.loaderd.producermetrics import SNAPSHOT_EVERY_S, snapshot

# A waiting child polls its control socket this long before it looks at the shared floor word again: the
# bound on a wake-up lost between the two words (the daemon read the wait word before the child wrote it).
WAIT_POLL_MS = 20
START_WAIT_MS = 1000  # a starting child waits this long for the daemon's first word (GO or RESET)

def child_main(args_path: str) -> int:
    """The producer process: Plan + DocSource, steps pushed to the daemon."""
    from sluice.loaderd.gcpause import freeze_startup_heap
    from sluice.loaderd.metrics import Metrics
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path, roots_of
    from sluice.loaderd.physical.jitload import START_AFTER_STEPS
    from sluice.loaderd.physical.producer import STEPS_AT_ONCE, StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    a = json.loads(Path(args_path).read_text())
    m, spec = load_manifest(a["manifest"]), load_runspec(a["runspec"])
    metrics = Metrics(spec.run_id, m.dataset_id, [s.name for s in m.sources], [float(s.weight) for s in m.sources])
    data = open_data_path(m, spec, DataPathConfig(
        cache_dir=a["cache_dir"], cache_budget=a["cache_budget"], verify_on_read=a["verify_on_read"], collect=False,
        decoded_bytes=a["decoded_bytes"], workers=a["workers"], worker_kind=a["worker_kind"],
        demand_workers=a.get("demand_workers", 0), jit=a.get("jit", "auto"), scrub_rate=a.get("scrub_rate", 0),
        tokenizer_threads=a.get("tokenizer_threads"),
        allowed_roots=roots_of(a.get("allowed_roots")),
        window_steps=0), metrics=metrics)  # the daemon checked the order's cost at its start
    plan = data.plan()
    maker = StepMaker(plan, data.docs, replica=a["replica"], replicas=a["replicas"], metrics=metrics)
    freeze_startup_heap()  # as the daemon's own start-up heap (gcpause.py): collections stay short
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.copy_threshold = COPY_BELOW  # as the daemon's ROUTER: copying small arrays costs less than zero-copy
    out.connect(f"ipc://{a['dir']}/steps.sock")
    ctl = ctx.socket(zmq.PULL)
    ctl.connect(f"ipc://{a['dir']}/ctl.sock")
    state: DataState | None = plan.load_state(a["state"])  # the daemon's RESETs (epoch >= 1) move it later
    epoch, floor, parked, fresh = 0, state.step + 1, False, True
    ring = stepring.Ring(a["ring_bytes"])  # slots of the steps not yet released
    mem = stepring.map_memory(a["ring_fd"], a["ring_bytes"] + stepring.CONTROL_BYTES)
    os.close(a["ring_fd"])  # (the mapping keeps the memory)
    words = stepring.control_words(mem, a["ring_bytes"])
    over: dict[int, int] = {}  # step -> bytes, for unreleased steps sent as frames (larger than the ring)
    notices: list[bytes] = []  # of the steps written to the ring and not sent yet (one message a call)
    produced = 0  # steps handed to the daemon (the kernel's load waits for START_AFTER_STEPS of them)
    parent = a["daemon_pid"]  # not getppid() here: the daemon may have died while this process started
    last_snap: dict[str, Any] | None = None
    snap_at = 0.0

    def send_metrics(force: bool) -> None:
        """A snapshot if SNAPSHOT_EVERY_S passed since the last one (or `force`) and it changed."""
        nonlocal last_snap, snap_at
        now = time.monotonic()
        if not force and now - snap_at < SNAPSHOT_EVERY_S:
            return
        metrics.observe_cache(data.cache.stats())
        metrics.docs_cache_bytes.set(data.docs.nbytes)
        snap = snapshot(metrics, data.docs)
        snap_at = now
        if snap != last_snap:
            try:  # a daemon that cannot take it now gets a later one (snapshots are cumulative)
                out.send_multipart(wire.encode(wire.Header(kind=wire.STATS_OK, step=0, body={"metrics": snap})),
                                   zmq.NOBLOCK)
                last_snap = snap
            except zmq.Again:
                pass

    def send_step(frames: list[Any]) -> bool:
        """Push a message, waiting while the daemon is alive (its queue bounds us); False once it is gone."""
        while not out.poll(500, zmq.POLLOUT):
            if os.getppid() != parent:
                return False  # a PUSH without its peer would wait forever
        out.send_multipart(frames, copy=False)
        return True

    def flush() -> bool:
        """Send the notices written so far (one message); False once the daemon is gone."""
        if not notices:
            return True
        ok = send_step(notices)
        notices.clear()
        return ok

    def sync_floor() -> int:
        """The daemon's floor (its shared word, when written in this epoch): released slots are freed."""
        nonlocal floor, over
        got = stepring.unpack_floor(int(words[stepring.FLOOR_WORD]), epoch)
        if got is not None and got > floor:
            floor = got
            ring.free_below(floor)
            if over:
                over = {k: v for k, v in over.items() if k >= floor}
        return floor

    def control(msg: dict[str, Any]) -> str:
        """Apply a control message: "STOP", "RESET" (the steps in hand are stale) or "" (a FLOOR, or stale)."""
        nonlocal epoch, parked, fresh, state, floor, over
        if msg["op"] == "STOP":
            return "STOP"
        if msg["op"] == "RESET":
            data.docs.restored(threading.get_ident())  # the old position's objects may stop
            epoch, parked, fresh = msg["epoch"], False, True
            ring.clear()  # the daemon dropped every step it held: no view on a slot is left
            over = {}
            notices.clear()
            state = plan.load_state(msg["state"])
            floor = state.step + 1
            return "RESET"
        return ""  # a FLOOR wakes a wait (the floor itself is read from the shared word); a GO starts it

    def wait(need: int | None) -> str:
        """Wait until the daemon's floor reaches `need` (None: for a control message only, 0.5 s at most). "" to
        go on, "STOP"/"RESET" when that came, "GONE" when the daemon died. The wait word tells the daemon to
        send a FLOOR when its floor gets there; a lost one costs WAIT_POLL_MS."""
        if not flush():
            return "GONE"
        if need is not None:
            words[stepring.WAIT_WORD] = stepring.pack_floor(epoch, need)
        try:
            while True:
                if os.getppid() != parent:
                    return "GONE"  # the daemon died (kill -9): do not outlive it
                if need is not None and sync_floor() >= need:
                    return ""
                if ctl.poll(WAIT_POLL_MS if need is not None else 500):
                    return control(json.loads(ctl.recv()))
                send_metrics(force=need is None)  # idle: what the last steps recorded reaches the daemon
        finally:
            words[stepring.WAIT_WORD] = 0

    def put(entry: StepEntry) -> str:
        """Hand a step to the daemon: "" when done, else what `wait` returned while waiting for room. Into the
        ring when it fits the layout and the ring (its notice sent with the call's others), else as wire
        frames."""
        if entry.error is None and stepring.writable(entry.micros):
            samples = [wire.json_bytes(ids) for ids in entry.samples]
            state_raw = entry.state_json or b""
            need = stepring.slot_bytes(entry.micros, samples, state_raw)
            while need <= ring.size:
                off = ring.alloc(entry.step, need)
                if off is not None:
                    notices.append(stepring.write_step(mem, off, epoch=epoch, step=entry.step, micros=entry.micros,
                                                       samples=samples, state=state_raw))
                    return ""
                got = wait(ring.live[0][0] + 1)  # at the limit: the release of the oldest slot makes room
                if got:
                    return got
        arrays: dict[str, np.ndarray] = {}
        for i, micro in enumerate(entry.micros):
            for k in wire.BATCH_ARRAYS:
                arrays[f"{i}.{k}"] = micro[k]
        body = {"epoch": epoch, "samples": entry.samples, "state": entry.state,
                "error": list(entry.error) if entry.error else None}
        if not flush() or not send_step(wire.encode(wire.Header(kind=wire.BATCH, step=entry.step, body=body),
                                                    arrays)):
            return "GONE"
        over[entry.step] = entry.nbytes
        return ""

    try:
        # A hello (the first metrics snapshot), then the daemon's first word before any step: the RESET of a
        # RESTORE that came while this process started (a client resuming on a new daemon) is taken before
        # steps from the initial state are made for nothing. Without an answer in START_WAIT_MS (the
        # daemon could not send yet), the initial state's steps are made, and a RESET comes later.
        send_metrics(force=True)
        snap_at = 0.0  # (the hello is not a period's snapshot: the first step's counts go out at once, as before)
        if ctl.poll(START_WAIT_MS) and control(json.loads(ctl.recv())) == "STOP":
            return 0
        while True:
            if os.getppid() != parent:
                return 0  # the daemon died (kill -9): do not outlive it
            if ctl.poll(0):
                if control(json.loads(ctl.recv())) == "STOP":
                    return 0
                continue
            if state is None or parked:
                got = wait(None)  # for a RESET (or STOP)
            elif state.step + 1 >= sync_floor() + a["lead_steps"]:
                got = wait(state.step + 2 - a["lead_steps"])  # at the step lead
            elif ring.used + sum(over.values()) >= a["max_bytes"]:
                got = wait(ring.live[0][0] + 1 if ring.live else min(over) + 1)  # at the byte bound
            else:
                got = None
            if got is not None:
                if got in ("STOP", "GONE"):
                    return 0
                continue
            # as the thread producer: the first step after a start or RESET alone, then up to
            # STEPS_AT_ONCE per call, never past the step lead
            n = 1 if fresh else max(1, min(STEPS_AT_ONCE, floor + a["lead_steps"] - (state.step + 1)))
            fresh = False
            made, after = maker.produce_run(state, n)
            os.sched_yield()  # as the thread producer (pipeline.py): the serving path's threads may wait here
            for entry in made:
                got = put(entry)
                if got in ("STOP", "GONE"):
                    return 0
                if got == "RESET":
                    break  # the steps in hand were computed from a superseded state (RESET set `state`)
                if entry.error is not None:  # (a terminal entry comes alone: `after` is None)
                    parked = True
                    break
                produced += 1
            else:
                state = after
            if not flush():
                return 0  # the daemon died (kill -9): do not outlive it
            if maker.jit is not None and produced >= START_AFTER_STEPS:
                # as the thread producer (pipeline.py): the fused path's kernel loads in the background once
                # the stream is steady (physical/jitload.py); does nothing after the first call
                maker.jit.start()
            send_metrics(force=False)
    finally:
        data.close()
        out.close()
        ctl.close(0)
        ctx.term()
