"""The loaderd server: one ROUTER socket, one IO thread, one producer per replica.

The IO thread owns the daemon's sockets (wireio.py: sockets live in the thread
that uses them) and an inproc PULL socket on which producer threads announce
finished steps. It never blocks on data: a GET whose step is assembled is
answered at once from the replica's `StepQueue`; otherwise it waits in a
bounded pending list and is answered when the producer announces the step, or
after the request TTL with ERROR(EXPIRED) (parking.py). Every message is
received within bounds (`endpoint.receive_bounded`) and answered by
`handlers.Requests`; periodic upkeep and STATS live in upkeep.py.

Fencing (DESIGN.md section 6): the durable generation and every RESTORE and
COMMIT check live in `gate.StateGate`; an accepted RESTORE resets the
replica's producer (dropping what was prefetched), a COMMIT is recorded
durably.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from sluice.loaderd import arena, rings
from sluice.loaderd.config import ServerConfig
from sluice.loaderd.endpoint import receive_bounded
from sluice.loaderd.fencing import FenceStore
from sluice.loaderd.gate import StateGate
from sluice.loaderd.handlers import Requests
from sluice.loaderd.metrics import METRICS_HIDDEN, Metrics
from sluice.loaderd.gilcpu import GilCpu
from sluice.loaderd.physical.gcpause import GcPauses, freeze_startup_heap
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.physical.producer import steps_a_call
from sluice.loaderd.upkeep import Upkeep
from sluice.loaderd.wireio import WireIO
from sluice.wire import errorcodes
from sluice.wire import ring as wire_ring

__all__ = ["Server", "ServerConfig"]

log = logging.getLogger("sluice.loaderd")

# How long `close` may take: the IO loop sees a SIGTERM within its 0.1 s poll and the process's own exit
# takes tens of ms after close, which leaves most of a second to a loaded machine's scheduler within the 2 s
# a supervisor is promised (docs/loaderd.md, "Stopping"). What close waits for ends in milliseconds unless
# it is stuck in one call, which no longer wait would end either.
STOP_S = 1.2
# The least `close` gets however late the stop was seen (below): the producers' and workers' own stops take
# milliseconds when nothing holds them.
_STOP_FLOOR_S = 0.2
_POLLIN = int(zmq.POLLIN)


class Server:
    """A loaderd instance. `bind()` then `serve(stop)`; `close()` releases everything.

    Its parts: `wire` (the sockets, wireio.py), `requests` (the answers,
    handlers.py), `upkeep` (housekeeping and STATS, upkeep.py), the data path
    (`data`) and one producer per served replica (`pipelines`).
    """

    def __init__(self, config: ServerConfig) -> None:
        from sluice.loaderd.physical.assemble import open_data_path

        self.config = config
        m, spec = config.manifest, config.spec
        self.run_id = spec.run_id
        self.dataset_id = m.dataset_id
        # Every local user can read the metrics port: the IDs are labels only when asked for (--metrics-ids).
        labels = (self.run_id, self.dataset_id) if config.metrics_ids else (METRICS_HIDDEN, METRICS_HIDDEN)
        self.metrics = Metrics(*labels, [s.name for s in m.sources],
                               [float(s.weight) for s in m.sources], unit=m.mixture.unit,
                               policy=m.mixture.policy, piece_tokens=m.mixture.piece_tokens)
        fence = FenceStore(config.state_dir or os.path.join(config.cache_dir, "loaderd-state"),
                           self.run_id, self.dataset_id)
        self.data = open_data_path(m, spec, config.data_path(), metrics=self.metrics)
        self.cache, self.docs = self.data.cache, self.data.docs
        self.gate = StateGate(fence, self.data.plan(), self.docs)  # validates states; producers get their own Plans
        self.metrics.generation.set(self.generation)
        self.pipelines: dict[int, ReplicaPipeline] = {}
        self.wire = WireIO(config)
        for r in config.serve:
            plan = self.data.plan()  # one per producer thread: a Plan caches orders, it is not shared
            self.pipelines[r] = ReplicaPipeline(
                plan=plan, replica=r, replicas=config.replicas, docs=self.docs, state=plan.initial_state(),
                max_bytes=config.queue_bytes, lead_steps=config.lead_steps, notify=self.wire.notify,
                metrics=self.metrics,
            )
        self.gil = GilCpu(config.gil_cpu)  # the IO loop and the producers on one CPU (`serve`; gilcpu.py)
        self.requests = Requests(config, self.gate, self.metrics, self.pipelines, self.wire.route, self.stats)
        self.upkeep = Upkeep(self.requests, self.wire, self.data, self.metrics, self.gil)
        self.gc_pauses = GcPauses()
        self.turn_began: float | None = None  # (monotonic) when the IO loop's latest turn began: `stop_budget`

    @property
    def generation(self) -> int:
        return self.gate.generation

    @property
    def instance(self) -> str:
        return self.requests.instance

    @property
    def endpoint(self) -> str | None:
        return self.wire.endpoint

    @property
    def metrics_port(self) -> int | None:
        return self.upkeep.metrics_port

    @property
    def wire_resets(self) -> int:
        return self.wire.wire_resets

    def stats(self) -> dict[str, Any]:
        """The STATS body (docs/protocol.md)."""
        return self.upkeep.stats()

    # -- lifecycle --------------------------------------------------------------
    def bind(self, *, freeze_gc: bool = False) -> str:
        """Bind the ROUTER (and the metrics port); start producers; return the endpoint.

        `freeze_gc` (the daemon's own process: cli.py): freeze the start-up heap
        out of the garbage collector's reach before the producers start
        (gcpause.py); off for a Server embedded in another program, whose heap
        is not the daemon's to freeze. BindError (exit 2) when the endpoint
        cannot be bound; nothing is left open that would keep `close()` from
        finishing.
        """
        endpoint = self.wire.bind()
        rings.sweep()  # ring files of daemons killed before their clients mapped them
        c = self.config
        slot_bytes = wire_ring.slot_bytes(c.spec.micro_batch, c.manifest.packing.seq_len)
        self.requests.rings = rings.Rings(endpoint, slot_bytes, announce=self.requests.ring_offer)
        self._make_arena(endpoint)
        if self.config.metrics_port is not None:
            self.upkeep.metrics_port = self.metrics.start_http(self.config.metrics_port)
        # The producers are GIL-bound Python (the logical plane); with the default 5 ms
        # switch interval a GET waits up to 5 ms for the IO thread to get the GIL back.
        # 0.2 ms keeps time-to-batch near the socket's own latency (docs/loaderd.md).
        sys.setswitchinterval(self.config.switch_interval_s)
        if freeze_gc:  # a full collection of the start-up heap took 3-8 ms of GIL; frozen, < 0.1 ms
            self.metrics.gc_frozen.set(freeze_startup_heap())
        self.gc_pauses.start()
        self.wire.start_memory_guard(len(self.pipelines))
        for p in self.pipelines.values():
            p.start()
        # (c: the run spec's digest and tokens per step below, what `sluice report` binds its record to)
        log.info("loaderd listening", extra={
            "endpoint": endpoint, "metrics_port": self.metrics_port, "pid": os.getpid(),
            "runspec_digest": c.spec.digest, "replicas": c.replicas,
            "tokens_per_step": c.spec.global_batch * c.manifest.packing.seq_len})
        return endpoint

    def _make_arena(self, endpoint: str) -> None:
        """The producers' blocks in shared memory (arena.py) where `--arena on` and the endpoint is ipc://: a slot
        holds a call's largest block (`steps_a_call` steps of 3 int32 planes of a replica's rows)."""
        if self.config.arena != "on":
            self.requests.arena_refused = "off"
            return
        c = self.config
        step = 3 * 4 * next(iter(self.pipelines.values())).micro_per_step * c.spec.micro_batch * \
            c.manifest.packing.seq_len
        made, self.requests.arena_refused = arena.make(endpoint, len(self.pipelines), steps_a_call(step) * step)
        self.requests.arena = made
        if made is not None:
            for p in self.pipelines.values():
                p.loop.maker.blocks = made.block

    def _reset_wire(self, poller: zmq.Poller) -> None:
        """Drop every connection and what libzmq holds for them; listen again under a new instance ID.

        Called on the IO thread when the memory guard trips. Parked GETs leave
        with their connections (never served: their identities are gone).
        Clients find the new instance when they probe after `timeout_s` of
        silence (or are told WRONG_INSTANCE) and RESTORE as after a restart.
        """
        parked = self.requests.drain(None)
        old = self.requests.new_instance()
        before, after, freed = self.wire.reset(poller)
        self.metrics.wire_resets.inc()
        guard = self.wire.memory_guard
        assert guard is not None
        mib = 1 << 20
        figures = (f"memory {before // mib} MiB over the limit of {guard.limit // mib} MiB (--memory-limit), "
                   f"{after // mib} MiB after every connection was dropped")
        log.warning(f"{figures} with what libzmq buffered for it (a peer's messages of many frames?); "
                    f"{parked} parked GETs dropped; instance {old} is now {self.instance}, clients restore"
                    if freed else f"{figures}: not the wire's memory (raise --memory-limit); the guard waits "
                    "until it is below the limit")

    def serve(self, stop: threading.Event) -> None:
        """Run the IO loop until `stop` is set; then answer pending GETs SHUTTING_DOWN."""
        w, req = self.wire, self.requests
        assert w.router is not None and w.pull is not None and w.connections is not None, "bind() first"
        poller = zmq.Poller()
        w.register(poller)
        poller.register(w.pull, zmq.POLLIN)
        next_housekeeping = 0.0
        self.gil.start([p.thread for p in self.pipelines.values()])
        while not stop.is_set():
            self.turn_began = time.monotonic()
            events = dict(poller.poll(100))
            if w.pull in events:
                ready, tripped = w.woken()
                if tripped:
                    self._reset_wire(poller)
                    continue
                for r in ready:
                    req.serve_pending(r)
            if w.connections.socket in events:
                w.connections.drain()
            if w.router in events:
                for _ in range(256):  # bounded burst, then look at the notifications again
                    try:
                        frames, dropped = receive_bounded(w.router, self.config.limits)
                    except zmq.Again:
                        break
                    req.handle(frames, dropped)
                    # Another message waiting? Asked, not tried: the zmq.Again that ends a burst cost the IO
                    # thread 5 us per poll (most polls bring one GET), the question 1.5 us.
                    if not w.router.get(zmq.EVENTS) & _POLLIN:
                        break
            now = time.monotonic()
            if now >= next_housekeeping:
                self.upkeep.housekeeping(now)
                self.gc_pauses.drain(self.metrics.gc_pause.__getitem__)
                next_housekeeping = now + 0.5
        req.drain(errorcodes.E_SHUTTING_DOWN, "loaderd is shutting down")
        log.info("loaderd drained", extra={"pid": os.getpid()})

    def stop_budget(self) -> float:
        """Seconds `close` may take after the IO loop saw its stop: `STOP_S` counted from the start of the loop's
        last turn, the earliest the signal can have come (at least `_STOP_FLOOR_S`). A thread holding the GIL
        (a tokenizer call turning a huge document's ids into Python ints) delays the signal's handler by as
        long as it holds it; counted from when the stop was seen, that delay went past the 2 s promised."""
        late = time.monotonic() - self.turn_began if self.turn_began is not None else 0.0
        return max(_STOP_FLOOR_S, STOP_S - late)

    def close(self, timeout_s: float = STOP_S) -> list[str]:
        """Stop the producers and workers and release everything, within `timeout_s` seconds.

        Returns what still runs after that: the names of worker threads in a
        task that does not look at its stop flag (one tokenizer call, a raw
        fetch), and "zmq context" if libzmq did not finish; empty when
        everything stopped. The daemon's process then leaves without them
        (cli.py). Why this order (docs/loaderd.md, "Stopping"):

        * `WireIO.closing`, under the lock notify sockets are made under: a
          producer thread that finishes a step from now on opens no socket (one
          made after the sockets below were closed kept `Context.term()` waiting
          forever) and sends nothing;
        * the document source is interrupted before the producers are joined,
          so a producer waiting for a document of a cold fill leaves at once
          (`Stopping`) instead of after the fill;
        * every wait after that shares one deadline, and `Context.term()` runs
          in a thread joined until it: every socket has LINGER 0, so it returns
          at once unless a socket was left open, which is then reported.
        """
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        self.wire.closing()
        if self.requests.rings is not None:
            self.requests.rings.close_all()
        if self.requests.arena is not None:
            self.requests.arena.close()  # (its name: no new client maps it; the blocks alive keep their pages)
        self.gc_pauses.stop()
        self.gil.release()  # (threads it starts from here on, and exit handlers, may use every CPU)
        self.docs.interrupt()
        running = [f"producer of replica {r}" for r, p in self.pipelines.items() if not p.stop(left())]
        running += self.data.close(left())
        running += self.wire.close(left)
        self.gate.fence.close()
        endpoint = self.wire.endpoint
        if endpoint and endpoint.startswith("ipc://") and self.config.endpoint is None:
            path = Path(endpoint[len("ipc://"):])
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass
        return running
