"""The producer process of `loaderd --producer process`: its main loop (the daemon's side is procpipe.py).

It opens the data path as the daemon does and runs the same producer loop
(`steploop.StepLoop`) with `RingSink` as its sink: steps are written into the
shared ring the daemon mapped (stepring.py) and their notices sent, one message
per call; it waits at the
step lead and at the ring's limit for the daemon's floor (a shared word, a
FLOOR message to wake it), takes RESET and STOP, and sends metrics snapshots.
It exits when the daemon is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from sluice.loaderd.logical import DataState
from sluice.loaderd.physical import stepring
from sluice.loaderd.physical.stepqueue import COPY_BELOW, StepEntry
from sluice.loaderd.physical.steploop import DONE, RESET, STOP, StepLoop
from sluice.loaderd.physical.producermetrics import SNAPSHOT_EVERY_S, snapshot
from sluice.wire import encoding, protocol

# A waiting child polls its control socket this long before it looks at the shared floor word again: the
# bound on a wake-up lost between the two words (the daemon read the wait word before the child wrote it).
WAIT_POLL_MS = 20
START_WAIT_MS = 1000  # a starting child waits this long for the daemon's first word (GO or RESET)

def child_main(args_path: str) -> int:
    """The producer process: Plan + DocSource, steps pushed to the daemon."""
    from sluice.loaderd.metrics import Metrics
    from sluice.loaderd.options import data_path_fields
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path, roots_of
    from sluice.loaderd.physical.gcpause import freeze_startup_heap
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    a = json.loads(Path(args_path).read_text())
    m, spec = load_manifest(a["manifest"]), load_runspec(a["runspec"])
    metrics = Metrics(spec.run_id, m.dataset_id, [s.name for s in m.sources], [float(s.weight) for s in m.sources])
    data = open_data_path(m, spec, DataPathConfig(
        **{name: a[name] for name in data_path_fields()}, collect=False, allowed_roots=roots_of(a.get("allowed_roots")),
        window_steps=0), metrics=metrics)  # the daemon checked the order's cost at its start
    plan = data.plan()
    maker = StepMaker(plan, data.docs, replica=a["replica"], replicas=a["replicas"], metrics=metrics)
    freeze_startup_heap()  # as the daemon's own start-up heap (gcpause.py): collections stay short
    state = plan.load_state(a["state"])  # the daemon's RESETs (epoch >= 1) move it later
    sink = RingSink(a, plan, data, metrics, floor=state.step + 1)
    try:
        loop = sink.loop = StepLoop(maker, sink, state)
        # A hello (the first metrics snapshot), then the daemon's first word before any step: the RESET of a
        # RESTORE that came while this process started (a client resuming on a new daemon) is taken before
        # steps from the initial state are made for nothing. Without an answer in START_WAIT_MS (the
        # daemon could not send yet), the initial state's steps are made, and a RESET comes later.
        sink.send_metrics(force=True)
        sink.snap_at = 0.0  # (the hello is not a period's snapshot: the first step's counts go out at once, as before)
        if sink.ctl.poll(START_WAIT_MS) and sink.control(json.loads(sink.ctl.recv())) == STOP:
            return 0
        loop.run()
        return 0
    finally:
        data.close()
        sink.close()


class RingSink:
    """The producer process's `steploop.StepSink`: steps into the shared ring (or as frames), notices, control.

    `wait` takes the daemon's control messages (RESET restarts the loop, STOP
    ends it) and waits at the step lead and the byte bound for the daemon's
    floor; `put` writes a step into the ring when it fits there, else sends
    it as wire frames; `sent` sends the call's notices in one message and,
    at most every SNAPSHOT_EVERY_S, a metrics snapshot. Every wait ends when
    the daemon is gone (its pid is no longer this process's parent).
    """

    def __init__(self, a: dict[str, Any], plan: Any, data: Any, metrics: Any, *, floor: int) -> None:
        self.plan, self.data, self.metrics = plan, data, metrics
        self.loop: StepLoop | None = None  # set once made (the loop takes this sink)
        self.lead_steps, self.max_bytes = a["lead_steps"], a["max_bytes"]
        self.ctx = zmq.Context()
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.copy_threshold = COPY_BELOW  # as the daemon's ROUTER: copying small arrays costs less than zero-copy
        self.out.connect(f"ipc://{a['dir']}/steps.sock")
        self.ctl = self.ctx.socket(zmq.PULL)
        self.ctl.connect(f"ipc://{a['dir']}/ctl.sock")
        self.floor = floor  # the daemon's oldest unreleased step, as last read (`sync_floor`)
        self.ring = stepring.Ring(a["ring_bytes"])  # slots of the steps not yet released
        self.mem = stepring.map_memory(a["ring_fd"], a["ring_bytes"] + stepring.CONTROL_BYTES)
        os.close(a["ring_fd"])  # (the mapping keeps the memory)
        self.words = stepring.control_words(self.mem, a["ring_bytes"])
        self.over: dict[int, int] = {}  # step -> bytes, for unreleased steps sent as frames (larger than the ring)
        self.notices: list[bytes] = []  # of the steps written to the ring and not sent yet (one message a call)
        self.parent = a["daemon_pid"]  # not getppid() here: the daemon may have died while this process started
        self.last_snap: dict[str, Any] | None = None
        self.snap_at = 0.0

    def close(self) -> None:
        self.out.close()
        self.ctl.close(0)
        self.ctx.term()

    @property
    def epoch(self) -> int:
        return 0 if self.loop is None else self.loop.epoch

    def gone(self) -> bool:
        """The daemon died (kill -9): this process must not outlive it."""
        return os.getppid() != self.parent

    def send_metrics(self, force: bool) -> None:
        """A snapshot if SNAPSHOT_EVERY_S passed since the last one (or `force`) and it changed."""
        now = time.monotonic()
        if not force and now - self.snap_at < SNAPSHOT_EVERY_S:
            return
        self.metrics.observe_cache(self.data.cache.stats())
        self.metrics.docs_cache_bytes.set(self.data.docs.nbytes)
        snap = snapshot(self.metrics, self.data.docs)
        self.snap_at = now
        if snap != self.last_snap:
            try:  # a daemon that cannot take it now gets a later one (snapshots are cumulative)
                self.out.send_multipart(
                    encoding.encode(protocol.Header(kind=protocol.STATS_OK, step=0, body={"metrics": snap})),
                    zmq.NOBLOCK)
                self.last_snap = snap
            except zmq.Again:
                pass

    def send_step(self, frames: list[Any]) -> bool:
        """Push a message, waiting while the daemon is alive (its queue bounds us); False once it is gone."""
        while not self.out.poll(500, zmq.POLLOUT):
            if self.gone():
                return False  # a PUSH without its peer would wait forever
        self.out.send_multipart(frames, copy=False)
        return True

    def flush(self) -> bool:
        """Send the notices written so far (one message); False once the daemon is gone."""
        if not self.notices:
            return True
        ok = self.send_step(self.notices)
        self.notices.clear()
        return ok

    def sync_floor(self) -> int:
        """The daemon's floor (its shared word, when written in this epoch): released slots are freed."""
        got = stepring.unpack_floor(int(self.words[stepring.FLOOR_WORD]), self.epoch)
        if got is not None and got > self.floor:
            self.floor = got
            self.ring.free_below(got)
            if self.over:
                self.over = {k: v for k, v in self.over.items() if k >= got}
        return self.floor

    def control(self, msg: dict[str, Any]) -> str:
        """Apply a control message: STOP, RESET (the steps in hand are stale) or DONE (a FLOOR, or stale)."""
        if msg["op"] == "STOP":
            return STOP
        if msg["op"] == "RESET":
            assert self.loop is not None
            self.data.docs.restored(threading.get_ident())  # the old position's objects may stop
            self.ring.clear()  # the daemon dropped every step it held: no view on a slot is left
            self.over = {}
            self.notices.clear()
            self.loop.restart(self.plan.load_state(msg["state"]), msg["epoch"])
            self.floor = self.loop.state.step + 1
            return RESET
        return DONE  # a FLOOR wakes a wait (the floor itself is read from the shared word); a GO starts it

    def wait_floor(self, need: int | None) -> str:
        """Wait until the daemon's floor reaches `need` (None: for a control message only, 0.5 s at most). DONE
        to go on, STOP/RESET when that came, STOP when the daemon died. The wait word tells the daemon to
        send a FLOOR when its floor gets there; a lost one costs WAIT_POLL_MS."""
        if not self.flush():
            return STOP
        if need is not None:
            self.words[stepring.WAIT_WORD] = stepring.pack_floor(self.epoch, need)
        try:
            while True:
                if self.gone():
                    return STOP
                if need is not None and self.sync_floor() >= need:
                    return DONE
                if self.ctl.poll(WAIT_POLL_MS if need is not None else 500):
                    return self.control(json.loads(self.ctl.recv()))
                self.send_metrics(force=need is None)  # idle: what the last steps recorded reaches the daemon
        finally:
            self.words[stepring.WAIT_WORD] = 0

    # -- steploop.StepSink ------------------------------------------------------------------------------
    def wait(self, loop: StepLoop) -> tuple[int, DataState, int] | None:
        while True:
            if self.gone():
                return None
            if self.ctl.poll(0):
                if self.control(json.loads(self.ctl.recv())) == STOP:
                    return None
                continue
            state = loop.state
            if loop.parked:
                got = self.wait_floor(None)  # for a RESET (or STOP)
            elif state.step + 1 >= self.sync_floor() + self.lead_steps:
                got = self.wait_floor(state.step + 2 - self.lead_steps)  # at the step lead
            elif self.ring.used + sum(self.over.values()) >= self.max_bytes:
                got = self.wait_floor(self.ring.live[0][0] + 1 if self.ring.live else min(self.over) + 1)  # bytes
            else:
                return loop.epoch, state, self.floor + self.lead_steps - (state.step + 1)
            if got == STOP:
                return None

    def accept(self, epoch: int) -> contextlib.nullcontext[bool]:
        return contextlib.nullcontext(True)  # a RESET is taken between puts (`put` returns RESET)

    def put(self, entry: StepEntry) -> str:
        """Into the ring when it fits the layout and the ring (its notice sent with the call's others), else
        as wire frames; waiting for room may bring a RESET or STOP."""
        if entry.error is None and stepring.writable(entry.micros):
            samples = [encoding.json_bytes(ids) for ids in entry.samples]
            state_raw = entry.state_json or b""
            need = stepring.slot_bytes(entry.micros, samples, state_raw)
            while need <= self.ring.size:
                off = self.ring.alloc(entry.step, need)
                if off is not None:
                    self.notices.append(stepring.write_step(
                        self.mem, off, epoch=self.epoch, step=entry.step, micros=entry.micros, samples=samples,
                        state=state_raw, counts=entry.source_tokens))
                    return DONE
                got = self.wait_floor(self.ring.live[0][0] + 1)  # at the limit: the oldest slot's release makes room
                if got != DONE:
                    return got
        arrays: dict[str, np.ndarray] = {}
        for i, micro in enumerate(entry.micros):
            for k in protocol.BATCH_ARRAYS:
                arrays[f"{i}.{k}"] = micro[k]
        body = {"epoch": self.epoch, "samples": entry.samples, "state": entry.state,
                "source_tokens": entry.source_tokens, "error": list(entry.error) if entry.error else None}
        if not self.flush() or not self.send_step(
                encoding.encode(protocol.Header(kind=protocol.BATCH, step=entry.step, body=body), arrays)):
            return STOP
        self.over[entry.step] = entry.nbytes
        return DONE

    def sent(self) -> bool:
        if not self.flush():
            return False  # the daemon died (kill -9): do not outlive it
        self.send_metrics(force=False)
        return True
