"""A replica producer in its own process (`loaderd --producer process`).

The thread producer (`pipeline.ReplicaPipeline`) runs the logical plane, which
is GIL-bound Python, in the daemon's process, where it competes with the IO
thread for the GIL. This variant runs the very same `StepMaker.produce_steps` (up to
`STEPS_AT_ONCE` steps a call once it runs ahead, as the thread producer) in a child
process; the daemon's IO thread only moves bytes:

    daemon (IO thread)                               producer process
    StepQueue  <-- views on the ring ====== shared ring ======  step blocks written (stepring.py)
               <-- notice(epoch, step, slot, cuts) --------------  PUSH (a fixed binary head per step)
    control PUSH -- GO / RESET(epoch, state) / FLOOR(floor) / STOP -->  PULL
    metrics   <-- STATS_OK(producer metrics snapshot) ---------------  PUSH

Flow control is the same as the thread producer's: the child produces while
``step < floor + lead_steps`` and the bytes of its unreleased steps stay under
the byte bound (the ring's size); the daemon writes the floor (oldest
unreleased step) to a shared word after each release, and sends a FLOOR
message only to wake a child that waits for that floor. A RESET bumps the epoch; the daemon drops STEP messages of older
epochs, so nothing computed from a superseded state is ever served. A step
crosses as a block in a shared-memory ring (stepring.py: its slots are freed by
the FLOOR, all of them by a RESET; the ring's size is the byte bound), so the
IO thread decodes no JSON header per step but the state's (checked before it
reaches a client); a step too large for the ring, a terminal step and the
metrics cross as wire frames (copied). The child records
its metrics in its own `Metrics` and sends cumulative snapshots (JSON numbers)
at most every 0.5 s and when it idles; the daemon folds them into its own
(producermetrics.py), so /metrics and STATS show them as for a thread producer.

The IO thread never blocks on the child. Control messages are sent without
waiting; one a child cannot take (not connected yet, or dead: a PUSH socket
without a peer would block the sender forever) waits in an outbox of at most
two messages (the latest RESET, the latest FLOOR of its epoch or a GO; newer
ones replace older ones) that `tend` retries every 0.5 s. The child's initial state
travels in its args file; it (procchild.py) sends a hello and waits at most 1 s for
the daemon's first word (GO, or the RESET of a RESTORE that came while it
started, sent at once on the hello) before its first step. A
child that died (kill -9, OOM killer) is seen by `exit_code` at the next
housekeeping (0.5 s), which fails its replica's waiting GETs (upkeep.py).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from sluice.errors import ProtocolError
from sluice.loaderd.logical import DataState, Plan
from sluice.loaderd.physical import stepring
from sluice.loaderd.physical.stepqueue import StepEntry, StepQueue
from sluice.wire import decoding, errorcodes, protocol

try:  # optional (the "fast" extra): decodes a step's state JSON at a fraction of the stdlib's cost
    from msgspec.json import decode as _decode_json
except ImportError:  # pragma: no cover - the stdlib decoder alone
    _decode_json = json.loads

log = logging.getLogger("sluice.loaderd")

# A terminal's Ctrl-C reaches the whole process group: the daemon drains and STOPs this child itself
# (and the child ends when the daemon is gone), so the child ignores SIGINT instead of dying with a
# KeyboardInterrupt traceback in the daemon's terminal and a "producer process died" in its log.
BOOT = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "from sluice.loaderd.physical.procchild import child_main; sys.exit(child_main(sys.argv[1]))")
_LIMITS = protocol.Limits(max_header_bytes=64 << 20, max_frames=4096, max_frame_bytes=1 << 31)


class ProcessReplicaPipeline:
    """A `producer.Producer` whose steps are computed in a child process."""

    def __init__(self, *, ctx: zmq.Context, plan: Plan, replica: int, replicas: int, state: DataState, max_bytes: int,
                 lead_steps: int, child_args: dict[str, Any], fold: Any = None) -> None:
        self.replica = replica
        self.replicas = replicas
        self.lanes = list(plan.lanes_of(replicas, replica))
        self.micro_per_step = (plan.spec.global_batch // replicas) // plan.spec.micro_batch
        self._sources = len(plan.manifest.sources)  # the bound on a step's source counts (stepring.read_step)
        self.queue = StepQueue(max_bytes, lead_steps)
        self.state_step = state.step
        self.queue.floor = state.step + 1
        self.epoch = 0
        self.peers = 1
        self.produced_steps = 0
        self._fold = fold  # a producermetrics.ProducerFold, or None: snapshots are dropped
        self._dir = tempfile.mkdtemp(prefix="sluice-producer-")
        self.steps_sock = ctx.socket(zmq.PULL)
        self.steps_sock.setsockopt(zmq.LINGER, 0)
        self.steps_sock.bind(f"ipc://{self._dir}/steps.sock")
        self._ctl = ctx.socket(zmq.PUSH)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self._ctl.bind(f"ipc://{self._dir}/ctl.sock")
        args = {**child_args, "replica": replica, "replicas": replicas, "lead_steps": lead_steps,
                "max_bytes": max_bytes, "dir": self._dir, "state": state.subset(self.lanes).state_dict(),
                "daemon_pid": os.getpid()}
        # The ring: the byte bound's worth of shared memory (pages are touched as slots are written), passed to
        # the child as an inherited descriptor; the daemon's mapping outlives the child (served after a kill -9).
        self._ring_size = -(-max(max_bytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._ring_fd: int | None = stepring.create_memory(self._ring_size + stepring.CONTROL_BYTES)
        self._ring = stepring.map_memory(self._ring_fd, self._ring_size + stepring.CONTROL_BYTES)
        self._words = stepring.control_words(self._ring, self._ring_size)
        self._woken = 0  # the child's wait word a FLOOR message was sent for
        self._words[stepring.FLOOR_WORD] = stepring.pack_floor(0, self.queue.floor)
        args["ring_fd"], args["ring_bytes"] = self._ring_fd, self._ring_size
        self._args_path = Path(self._dir) / "args.json"
        self._args_path.write_text(json.dumps(args))
        self.proc: subprocess.Popen[bytes] | None = None
        self._last_floor = -1
        self._next_step = state.step + 1
        self._outbox: list[dict[str, Any]] = []  # control messages the child could not take yet (at most 2)
        self._greeted = False  # the child's first message (its hello) came

    @property
    def next_step(self) -> int:
        return self._next_step

    def start(self) -> None:
        assert self._ring_fd is not None, "start() once"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(self._args_path)], pass_fds=(self._ring_fd,))
        finally:  # the child has its own descriptor, the daemon its mapping
            os.close(self._ring_fd)
            self._ring_fd = None

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the child to stop; kill it if it has not ended after `timeout` s (a child inside a step
        reads the STOP only after it). True: it has ended (a killed child always has)."""
        if self.proc is not None and self.proc.poll() is None:
            self._outbox.clear()
            self._send_ctl({"op": "STOP"})  # not taken (child busy starting): the wait below ends in a kill
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.steps_sock.close(0)
        self._ctl.close(0)
        if self._ring_fd is not None:  # never started
            os.close(self._ring_fd)
            self._ring_fd = None
        # (the mapping goes with the last view on it: queue entries may still hold some)
        for name in ("steps.sock", "ctl.sock", "args.json"):
            Path(self._dir, name).unlink(missing_ok=True)
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
        return True

    def _send_ctl(self, msg: dict[str, Any]) -> None:
        """Queue `msg` for the child (a RESET drops everything older; a FLOOR the previous FLOOR), then flush."""
        if msg["op"] == "RESET":
            self._outbox.clear()
        elif msg["op"] == "FLOOR":
            self._outbox = [m for m in self._outbox if m["op"] not in ("FLOOR", "GO")]
        self._outbox.append(msg)
        self.tend()

    def tend(self) -> None:
        """Send what the outbox holds, never waiting: a child that is not connected (yet, or any more) keeps it."""
        while self._outbox:
            try:
                self._ctl.send(json.dumps(self._outbox[0]).encode(), zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.pop(0)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def steps_socket(self) -> zmq.Socket | None:
        return self.steps_sock

    def exit_code(self) -> int | None:
        """None while the child runs (or before start); its exit code once it exited."""
        return None if self.proc is None else self.proc.poll()

    def reset(self, state: DataState) -> None:
        with self.queue.cond:
            self.epoch += 1
            sub = state.subset(self.lanes)
            self.queue.clear(sub.step + 1)
            self._next_step = sub.step + 1
            self._last_floor = self.queue.floor
            self._words[stepring.FLOOR_WORD] = stepring.pack_floor(self.epoch, self._last_floor)
        self._send_ctl({"op": "RESET", "epoch": self.epoch, "state": sub.state_dict()})

    def after_release(self) -> None:
        """Tell the child the new floor (called by the IO thread after deliveries).

        Written to the shared floor word, which the child reads before each call; a message (FLOOR) only
        when the child waits for this floor (its wait word): a message per released step cost the IO thread
        an encode and a send, and libzmq and the child a wake-up each. A wake-up lost between the two words
        (the child set its word as the floor passed it) costs the child its poll timeout (`procchild.WAIT_POLL_MS`).
        """
        floor = self.queue.floor
        if floor != self._last_floor:
            self._last_floor = floor
            words = self._words
            words[stepring.FLOOR_WORD] = stepring.pack_floor(self.epoch, floor)
            wait = int(words[stepring.WAIT_WORD])
            if wait and wait != self._woken:
                need = stepring.unpack_floor(wait, self.epoch)
                if need is not None and floor >= need:
                    self._woken = wait
                    self._send_ctl({"op": "FLOOR", "epoch": self.epoch, "floor": floor})

    def receive(self) -> bool:
        """Take one message waiting on the socket (the notices of the steps of one call into the queue, a step
        as frames, or a metrics snapshot); True if a step was taken.

        The notices of a call's steps (up to STEPS_AT_ONCE) come as one message: taking them costs the IO
        thread a few microseconds each (views on the ring, the state's JSON decoded), against 50-90 us each
        when each step's arrays and JSON header crossed the socket (taking four at once then held the IO
        thread 0.2-0.35 ms, docs/loaderd.md, "Time to batch"), and one wake-up of the IO loop a call.
        """
        try:
            frames = self.steps_sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not self._greeted:  # the child's hello: what waits for it (a RESET) goes now, else a GO
            self._greeted = True
            if self._outbox:
                self.tend()
            else:
                self._send_ctl({"op": "GO"})
        if stepring.is_notice(frames[0]):
            took = False
            for notice in frames:
                try:
                    took = self._take_notice(notice) or took
                except ProtocolError as exc:
                    return self._broken(exc)
            return took
        msg = decoding.decode(frames, _LIMITS)
        body = msg.body
        if msg.header.kind == protocol.STATS_OK:  # a metrics snapshot, whatever the epoch
            if self._fold is not None:
                self._fold.fold(self.replica, body.get("metrics"))
            return False
        if body["epoch"] != self.epoch:
            return False  # computed from a superseded state
        mps = len(body["samples"])
        micros = [{k: msg.arrays[f"{i}.{k}"] for k in protocol.BATCH_ARRAYS} for i in range(mps)]
        try:
            counts = self._counts(body.get("source_tokens"), micros, msg.header.step)
        except ProtocolError as exc:
            return self._broken(exc)
        entry = StepEntry(step=msg.header.step, micros=micros, samples=body["samples"], state=body.get("state"),
                          nbytes=sum(a.nbytes for a in msg.arrays.values()), created=time.monotonic(),
                          error=tuple(body["error"]) if body.get("error") else None,  # type: ignore[arg-type]
                          delivered=[set() for _ in micros],
                          source_tokens=counts).encode_json()
        with self.queue.cond:
            self.queue.put(entry)
        if entry.error is None:
            self._next_step = entry.step + 1
            self.produced_steps += 1
        return True

    def _counts(self, raw: Any, micros: list[dict[str, Any]], step: int) -> list[tuple[tuple[int, int], ...]] | None:
        """A step's source counts as a producer process sent them in a wire message (JSON), checked as
        `stepring.read_step` checks a notice's; None when it sent none (a terminal step)."""
        if raw is None or not micros:
            return None
        try:
            got = [tuple((int(s), int(n)) for s, n in micro) for micro in raw]
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"step {step}: the producer's source counts are malformed ({exc})") from None
        if len(got) != len(micros) or any(
                not 0 <= s < self._sources or not 0 <= n <= m["input_ids"].size
                for counts, m in zip(got, micros) for s, n in counts):
            raise ProtocolError(f"step {step}: the producer's source counts name a source beyond the manifest's "
                                f"{self._sources}, more tokens than a micro-batch holds, or another count of "
                                "micro-batches")
        return got

    def _take_notice(self, notice: bytes) -> bool:
        """A step written to the ring: its entry (views on the ring) into the queue; True if taken."""
        epoch, step, nbytes, micros, samples, state_raw, counts = stepring.read_step(notice, self._ring,
                                                                                     self._ring_size, self._sources)
        if epoch != self.epoch or self.queue.terminal is not None:
            return False  # computed from a superseded state (its slot is free again after the RESET), or late
        if step != self._next_step:
            raise ProtocolError(f"step notice of step {step} where step {self._next_step} comes next")
        state = None
        if state_raw:
            try:
                state = _decode_json(state_raw)
            except ValueError as exc:  # (msgspec's DecodeError is a ValueError)
                raise ProtocolError(f"step {step}: the producer's state is not JSON ({exc})") from None
            if not isinstance(state, dict):
                raise ProtocolError(f"step {step}: the producer's state is not a JSON object")
        entry = StepEntry(step=step, micros=micros, samples=[], state=state, nbytes=nbytes, created=time.monotonic(),
                          delivered=[set() for _ in micros], state_json=state_raw or None, samples_raw=samples,
                          borrowed=True, source_tokens=counts)
        with self.queue.cond:
            self.queue.put(entry)
        self._next_step = step + 1
        self.produced_steps += 1
        return True

    def _broken(self, exc: ProtocolError) -> bool:
        """The child sent what no producer sends: its replica's stream ends here with INTERNAL, the child ends."""
        from sluice.loaderd.physical.producer import terminal

        message = f"step {self._next_step}: bug in sluice: the producer process (pid {self.pid}) sent {exc}"
        log.error("producer process sent an invalid step", extra={"replica": self.replica, "error": str(exc)})
        with self.queue.cond:
            self.queue.put(terminal(self._next_step, errorcodes.E_INTERNAL, message, pid=self.pid))
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        return True
