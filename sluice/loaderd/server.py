"""The loaderd server: one ROUTER socket, one IO thread, one producer per replica.

The IO thread owns the ROUTER socket (sockets live in the thread that uses
them) and an inproc PULL socket on which producers announce finished steps. It
never blocks on data: a GET whose step is assembled is answered at once from
the replica's `StepQueue`; otherwise it waits in a bounded pending list and is
answered when the producer announces the step, or after the request TTL with
ERROR(EXPIRED) (parking.py). Every message is received within bounds
(`endpoint.receive_bounded`), must carry the run token when the daemon has
one (UNAUTHORIZED otherwise), and is validated by `sluice.wire.decode`;
anything wrong gets an ERROR reply with a code and a counter, and the loop
goes on. Periodic upkeep and STATS live in upkeep.py.

Fencing (DESIGN.md section 6): the durable generation and every RESTORE and
COMMIT check live in `gate.StateGate`; an older generation gets FENCED, an
accepted RESTORE resets the replica's producer (dropping what was
prefetched), a COMMIT is recorded durably.

Why over 450 lines: the IO loop's dispatch (GET, RESTORE, COMMIT, STATS,
HELLO and their refusals) shares the socket, the replicas' queues and the
counters; parking, upkeep, fencing and the endpoint already live apart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from sluice import wire
from sluice.errors import ProtocolError, SluiceError, WireError
from sluice.loaderd.config import ServerConfig
from sluice.loaderd import upkeep
from sluice.loaderd.endpoint import (Connections, TokenAuthenticator, bind_router, check_endpoint,
                                     private_ipc_endpoint, rebind_router, receive_bounded, send_frames)
from sluice.loaderd.fencing import FenceStore
from sluice.loaderd.gate import StateGate
from sluice.loaderd import memguard
from sluice.loaderd.metrics import METRICS_HIDDEN, Metrics
from sluice.loaderd.options import data_path_values
from sluice.loaderd.parking import Parked, Parking, PeerClaims, apply_claims, restore_peer
from sluice.loaderd.physical.gcpause import GcPauses, freeze_startup_heap
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.physical.producer import Producer
from sluice.loaderd.physical.producermetrics import ProducerFold
from sluice.loaderd.physical.stepqueue import COPY_BELOW

__all__ = ["Server", "ServerConfig"]

log = logging.getLogger("sluice.loaderd")

_NOTIFY = "inproc://loaderd-notify-{}"
# How long `close` may take: the IO loop sees a SIGTERM within its 0.1 s poll and the process's own exit
# takes tens of ms after close, which leaves most of a second to a loaded machine's scheduler within the 2 s
# a supervisor is promised (docs/loaderd.md, "Stopping"). What close waits for ends in milliseconds unless
# it is stuck in one call, which no longer wait would end either.
STOP_S = 1.2
_POLLIN = int(zmq.POLLIN)
# Refusals every restart or restore causes (pending requests drained at
# shutdown, requests queued for the previous daemon instance or generation):
# logged once at info per code, not as a warning per request.
_EXPECTED_AFTER_RESTART = frozenset({wire.E_SHUTTING_DOWN, wire.E_WRONG_INSTANCE, wire.E_FENCED})


class Server:
    """A loaderd instance. `bind()` then `serve(stop)`; `close()` releases everything."""

    def __init__(self, config: ServerConfig) -> None:
        from sluice.loaderd.physical.assemble import open_data_path, roots_json

        self.config = config
        m, spec = config.manifest, config.spec
        self.run_id = spec.run_id
        self.dataset_id = m.dataset_id
        self.instance = _new_instance()
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
        self.pipelines: dict[int, Producer] = {}
        self.producer_fold = ProducerFold(self.metrics)  # producer processes' metrics (empty with threads)
        self._batch_headers: dict[int, wire.BatchHeaders] = {}  # replica -> BATCH header template
        self._committed_steps: dict[int, int] = {}
        self.ctx = zmq.Context()
        for r in config.serve:
            plan = self.data.plan()  # one per producer thread: a Plan caches orders, it is not shared
            if config.producer == "process":
                from sluice.loaderd.physical.procpipe import ProcessReplicaPipeline

                self.pipelines[r] = ProcessReplicaPipeline(
                    ctx=self.ctx, plan=plan, replica=r, replicas=config.replicas, state=plan.initial_state(),
                    max_bytes=config.queue_bytes, lead_steps=config.lead_steps,
                    child_args={"manifest": config.manifest_path, "runspec": config.runspec_path,
                                **data_path_values(config), "allowed_roots": roots_json(config.allowed_roots),
                                "tokenizer_threads": _per_producer(config.tokenizer_threads, len(config.serve))},
                    fold=self.producer_fold)
            else:
                self.pipelines[r] = ReplicaPipeline(
                    plan=plan, replica=r, replicas=config.replicas, docs=self.docs, state=plan.initial_state(),
                    max_bytes=config.queue_bytes, lead_steps=config.lead_steps, notify=self._notify,
                    metrics=self.metrics,
                )
        self.parking = Parking(self.pipelines, config.max_pending)
        # claims outlive parked GETs (1 TTL): a live client re-asks after EXPIRED before its claim lapses
        self.claims = PeerClaims(2 * config.request_ttl_s)
        self._notify_addr = _NOTIFY.format(id(self))
        self._local = threading.local()
        self._notify_lock = threading.Lock()
        self._notify_socks: list[zmq.Socket] = []
        self._closing = False  # set by close(), under _notify_lock: no notify socket made or used after it
        self.endpoint: str | None = None
        self.metrics_port: int | None = None
        self._router: zmq.Socket | None = None
        self._pull: zmq.Socket | None = None
        self._auth: Any = None
        self.connections: Connections | None = None
        self.requests = 0
        self.dropped_frames = 0  # frames of over-long messages released unread
        self.unauthorized = 0
        self.undeliverable = 0  # replies whose client was gone (or full): never counted as deliveries
        self.memory_guard: memguard.MemoryGuard | None = None
        self.wire_resets = 0  # every connection dropped to bound memory (memguard.py)
        self._logged_expected: set[str] = set()  # codes of expected refusals already logged at info
        self.gc_pauses = GcPauses()

    @property
    def generation(self) -> int:
        return self.gate.generation

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
        endpoint = self.config.endpoint or private_ipc_endpoint()
        curve = self.config.curve
        check_endpoint(endpoint, curve=curve is not None, token=self.config.token is not None)
        self._router, self.endpoint, self._auth = bind_router(self.ctx, endpoint, curve=curve,
                                                              limits=self.config.limits, token=self.config.token)
        self.connections = Connections(self._router)
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._notify_addr)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self.config.metrics_port)
        # The producers are GIL-bound Python (the logical plane); with the default 5 ms
        # switch interval a GET waits up to 5 ms for the IO thread to get the GIL back.
        # 0.2 ms keeps time-to-batch near the socket's own latency (docs/loaderd.md).
        sys.setswitchinterval(self.config.switch_interval_s)
        if freeze_gc:  # a full collection of the start-up heap took 3-8 ms of GIL; frozen, < 0.1 ms
            self.metrics.gc_frozen.set(freeze_startup_heap())
        self.gc_pauses.start()
        self._start_memory_guard()
        for p in self.pipelines.values():
            p.start()
        c = self.config  # the run spec's digest and tokens per step: what `sluice report` binds its record to
        log.info("loaderd listening", extra={
            "endpoint": self.endpoint, "metrics_port": self.metrics_port, "pid": os.getpid(),
            "runspec_digest": c.spec.digest, "replicas": c.replicas,
            "tokens_per_step": c.spec.global_batch * c.manifest.packing.seq_len})
        return self.endpoint

    def _start_memory_guard(self) -> None:
        """Start the memory guard (memguard.py) unless it is off; before the producers, whose queues and
        decoded objects the auto limit counts over the memory measured here."""
        c = self.config
        if c.memory_limit == "off" or not memguard.available():
            return
        limit = c.memory_limit
        if limit == "auto":
            start = memguard.AnonMemory()
            try:
                limit = memguard.auto_limit(start(), c.queue_bytes, len(self.pipelines), c.decoded_bytes)
            finally:
                start.close()
        assert isinstance(limit, int)
        self.memory_guard = memguard.MemoryGuard(limit, self.ctx, self._notify_addr)
        self.memory_guard.start()

    def _reset_wire(self, poller: zmq.Poller) -> None:
        """Drop every connection and what libzmq holds for them; listen again under a new instance ID.

        Called on the IO thread when the memory guard trips. Parked GETs leave
        with their connections (never served: their identities are gone).
        Clients find the new instance when they probe after `timeout_s` of
        silence (or are told WRONG_INSTANCE) and RESTORE as after a restart.
        """
        guard = self.memory_guard
        assert guard is not None and self._router is not None and self.connections is not None
        before = guard.read()
        poller.unregister(self._router)
        poller.unregister(self.connections.socket)
        parked = len(self.parking.drain())
        self.connections.close(self._router)
        self._router.close(0)
        self._router = None
        old, self.instance = self.instance, _new_instance()
        self._batch_headers.clear()  # they carry the instance ID
        # libzmq frees the closed pipes in its own threads: give it a moment, then hand the heap back
        deadline = time.monotonic() + 1.0
        after = before
        while True:
            memguard.trim()
            after = guard.read()
            if after <= guard.limit or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        assert self.endpoint is not None
        self._router = rebind_router(self.ctx, self.endpoint, curve=self.config.curve, limits=self.config.limits,
                                     token=self.config.token)
        self.connections = Connections(self._router)
        poller.register(self._router, zmq.POLLIN)
        poller.register(self.connections.socket, zmq.POLLIN)
        self.wire_resets += 1
        self.metrics.wire_resets.inc()
        freed = guard.handled(after)
        mib = 1 << 20
        figures = (f"memory {before // mib} MiB over the limit of {guard.limit // mib} MiB (--memory-limit), "
                   f"{after // mib} MiB after every connection was dropped")
        log.warning(f"{figures} with what libzmq buffered for it (a peer's messages of many frames?); "
                    f"{parked} parked GETs dropped; instance {old} is now {self.instance}, clients restore"
                    if freed else f"{figures}: not the wire's memory (raise --memory-limit); the guard waits "
                    "until it is below the limit")

    def serve(self, stop: threading.Event) -> None:
        """Run the IO loop until `stop` is set; then answer pending GETs SHUTTING_DOWN."""
        assert self._router is not None and self._pull is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        assert self.connections is not None
        poller.register(self.connections.socket, zmq.POLLIN)
        producer_socks = {}
        for r, p in self.pipelines.items():
            sock = p.steps_socket
            if sock is not None:  # a producer process: its steps arrive on this socket
                poller.register(sock, zmq.POLLIN)
                producer_socks[sock] = r
        next_housekeeping = 0.0
        while not stop.is_set():
            events = dict(poller.poll(100))
            if self._pull in events:
                ready = set()
                while True:  # (readable per the poll; then looked at, not tried: a zmq.Again costs 5 us)
                    try:
                        ready.add(int(self._pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                    if not self._pull.get(zmq.EVENTS) & _POLLIN:
                        break
                if -1 in ready:  # the memory guard's wake (memguard.MemoryGuard.WAKE)
                    ready.discard(-1)
                    if self.memory_guard is not None and self.memory_guard.tripped:
                        self._reset_wire(poller)
                        continue
                for r in ready:
                    self._serve_pending(r)
            for sock, r in producer_socks.items():
                if sock in events and self.pipelines[r].receive():
                    self._serve_pending(r)
            if self.connections.socket in events:
                self.connections.drain()
            if self._router in events:
                for _ in range(256):  # bounded burst, then look at the notifications again
                    try:
                        frames, dropped = receive_bounded(self._router, self.config.limits)
                    except zmq.Again:
                        break
                    self._handle(frames, dropped)
                    # Another message waiting? Asked, not tried: the zmq.Again that ends a burst cost the IO
                    # thread 5 us per poll (most polls bring one GET), the question 1.5 us.
                    if not self._router.get(zmq.EVENTS) & _POLLIN:
                        break
            now = time.monotonic()
            if now >= next_housekeeping:
                self._housekeeping(now)
                next_housekeeping = now + 0.5
        for item in self.parking.drain():
            self._error(item.identity, item.header, wire.E_SHUTTING_DOWN, "loaderd is shutting down")
        log.info("loaderd drained", extra={"pid": os.getpid()})

    def close(self, timeout_s: float = STOP_S) -> list[str]:
        """Stop the producers and workers and release everything, within `timeout_s` seconds.

        Returns what still runs after that: the names of worker threads in a
        task that does not look at its stop flag (one tokenizer call, a raw
        fetch), and "zmq context" if libzmq did not finish; empty when
        everything stopped. The daemon's process then leaves without them
        (cli.py). Why this order (docs/loaderd.md, "Stopping"):

        * `_closing`, under the lock notify sockets are made under: a producer
          thread that finishes a step from now on opens no socket (one made
          after the sockets below were closed kept `Context.term()` waiting
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

        with self._notify_lock:
            self._closing = True
        self.gc_pauses.stop()
        if self.memory_guard is not None:
            self.memory_guard.stop()
        self.docs.interrupt()
        running = [f"producer of replica {r}" for r, p in self.pipelines.items() if not p.stop(left())]
        running += self.data.close(left())
        with self._notify_lock:  # (a producer still running cannot be in `_notify` meanwhile)
            for s in self._notify_socks:
                s.close(0)
            self._notify_socks.clear()
        if self._router is not None:
            if self.connections is not None:
                self.connections.close(self._router)
            self._router.close(0)
        if self._pull is not None:
            self._pull.close(0)
        if isinstance(self._auth, TokenAuthenticator):
            self._auth.stop(left())
        elif self._auth is not None:  # pyzmq's (CurveZMQ): its thread polls and leaves at once
            self._auth.stop()
        term = threading.Thread(target=self.ctx.term, name="loaderd-zmq-term", daemon=True)
        term.start()
        term.join(max(left(), 0.1))  # (every socket is closed: a spent deadline still gives it its milliseconds)
        if term.is_alive():
            running.append("zmq context")
        self.gate.fence.close()
        if self.endpoint and self.endpoint.startswith("ipc://") and self.config.endpoint is None:
            path = Path(self.endpoint[len("ipc://"):])
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass
        return running

    def _notify(self, replica: int) -> None:
        """Called from a producer thread: wake the IO thread (socket per thread).

        Under `_notify_lock`, and nothing once `close` began: a socket made or
        used while `close` closes them would keep `Context.term()` waiting (or
        race libzmq's socket, which is not thread-safe). The lock is uncontended
        but for `close` (one acquisition per producer call, about 0.1 us)."""
        with self._notify_lock:
            if self._closing:
                return
            sock = getattr(self._local, "sock", None)
            if sock is None:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self._notify_addr)
                self._local.sock = sock
                self._notify_socks.append(sock)
            try:  # never blocks while holding the lock `close` needs
                sock.send(str(replica).encode(), zmq.NOBLOCK)
            except zmq.Again:
                # 1,000 wake-ups unread (the high-water mark): the IO thread is far behind, not idle. Unread
                # wake-ups are bounded by the steps made between two passes of its loop (each replica's step
                # lead), so this is not reached while it runs; after it stopped, nothing waits for a wake-up.
                pass

    # -- message handling -------------------------------------------------------
    def _send(self, identity: bytes, header: wire.Header, arrays: dict[str, Any] | None = None) -> bool:
        return self._route([identity, *wire.encode(header, arrays)])

    def _route(self, frames: list[Any], copy: bool = False) -> bool:
        """Send without blocking; False if the peer is gone or its queue is full (ROUTER_MANDATORY).

        What did not leave is never a delivery: a client that went away with GETs
        parked releases no step a live client still needs."""
        assert self._router is not None
        try:
            send_frames(self._router, frames, copy)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.undeliverable += 1
            return False

    def _error(self, identity: bytes, request: wire.Header | None, code: str, message: str, **extra: Any) -> None:
        self.metrics.error(code)
        extra_log = {"code": code, "step": request.step if request else None,
                     "replica": request.replica if request else None}
        if code in _EXPECTED_AFTER_RESTART:
            # Requests a client queued for the previous instance or generation
            # arrive in bursts (one per credit) after every restart or restore:
            # expected, so one info line per code; the counter has them all.
            level = logging.DEBUG if code in self._logged_expected else logging.INFO
            self._logged_expected.add(code)
            log.log(level, f"{message} (expected around a daemon restart or a restore; further ones at debug)",
                    extra=extra_log)
        elif code not in (wire.E_END,):
            log.warning(message, extra=extra_log)
        reply = wire.error_reply(request, code, message, instance=self.instance, **extra)
        self._send(identity, dataclasses.replace(reply, generation=self.generation))

    def _handle(self, frames: list[Any], dropped: int = 0) -> None:
        self.requests += 1
        identity = frames[0].bytes if frames else b""
        header = None
        try:
            if dropped:
                self.dropped_frames += dropped
                raise WireError(wire.E_TOO_MANY_FRAMES, f"message of {len(frames) - 1 + dropped} frames exceeds "
                                                        f"the limits ({self.config.limits.max_frames} frames, "
                                                        f"{self.config.limits.max_header_bytes} bytes); "
                                                        "refused unread")
            msg = wire.decode(frames[1:], self.config.limits)
            header = msg.header
            if header.kind not in wire.REQUEST_KINDS:
                raise WireError(wire.E_UNKNOWN_KIND, f"{header.kind} is a reply kind; the daemon takes "
                                                     f"{', '.join(wire.REQUEST_KINDS)}")
            if self.config.token is not None and not wire.token_matches(self.config.token, header.body.get("token")):
                self.unauthorized += 1
                raise WireError(wire.E_UNAUTHORIZED, f"{header.kind} without this run's token is refused "
                                                     "(pass the launcher's token: Client(token=...) or SLUICE_TOKEN)")
            if header.kind == wire.STATS and not header.run_id and not header.dataset_id:
                # An operator query (sluice peek, monitoring) may ask without knowing the IDs.
                self._send(identity, self._reply(header, wire.STATS_OK, {"stats": self.stats()}))
                return
            if header.run_id != self.run_id:
                raise WireError(wire.E_WRONG_RUN, f"run ID {header.run_id!r} differs from this daemon's "
                                                  f"{self.run_id!r}")
            if header.dataset_id != self.dataset_id:
                raise WireError(wire.E_WRONG_DATASET, f"dataset ID {header.dataset_id!r} differs from this "
                                                      f"daemon's {self.dataset_id!r}")
            if header.kind == wire.STATS:
                self._send(identity, self._reply(header, wire.STATS_OK, {"stats": self.stats()}))
                return
            if header.replica not in self.pipelines:
                raise WireError(wire.E_BAD_REPLICA, f"replica {header.replica} is not served here (this "
                                                    f"daemon serves {sorted(self.pipelines)} of "
                                                    f"{self.config.replicas})")
            self.claims.seen(header.replica, identity, time.monotonic())
            if header.kind == wire.HELLO:
                self._hello(identity, header)
            elif header.instance and header.instance != self.instance:
                # A request queued for a daemon that died and reached us through zmq's
                # automatic reconnect: serving it would count as a delivery to a socket
                # nobody reads and release steps its client still needs.
                raise WireError(wire.E_WRONG_INSTANCE, f"{header.kind} is addressed to daemon instance "
                                                       f"{header.instance!r}, this is {self.instance!r}")
            elif header.generation < self.generation:
                raise WireError(wire.E_FENCED, f"{header.kind} with generation {header.generation} is older "
                                               f"than the daemon's generation {self.generation}")
            elif header.kind == wire.GET:
                self._get(identity, header)
            elif header.kind == wire.RESTORE:
                self._restore(identity, header)
            elif header.kind == wire.COMMIT:
                self._commit(identity, header)
        except SluiceError as exc:
            self._error(identity, header, wire.code_for(exc), str(exc))
        except Exception as exc:  # a bug must not take the daemon down; report and count it
            log.exception("internal error handling a message")
            self._error(identity, header, wire.E_INTERNAL, f"bug in sluice: {exc!r}")

    def _reply(self, request: wire.Header, kind: str, body: dict[str, Any], **fields: Any) -> wire.Header:
        return wire.Header(
            kind=kind, run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation,
            replica=request.replica, step=fields.get("step", request.step), micro=fields.get("micro", request.micro),
            request_id=request.request_id, instance=self.instance, body=body,
        )

    def _hello(self, identity: bytes, h: wire.Header) -> None:
        replicas = h.body.get("replicas")
        if replicas != self.config.replicas:
            raise WireError(wire.E_BAD_REPLICA, f"client says replicas={replicas!r}, this daemon serves "
                                                f"replicas={self.config.replicas}")
        peers = h.body.get("peers", 1)
        if not isinstance(peers, int) or isinstance(peers, bool) or not 1 <= peers <= 1024:
            raise WireError(wire.E_MALFORMED, f"HELLO peers must be an integer in [1, 1024], got {peers!r}")
        self.claims.claim(h.replica, identity, peers, time.monotonic())
        apply_claims(self.claims, h.replica, self.pipelines[h.replica], time.monotonic())
        log.info("hello", extra={"replica": h.replica, "peer": identity.hex()})
        self._send(identity, self._reply(h, wire.HELLO_OK, upkeep.hello_body(self, h.replica)))

    def _get(self, identity: bytes, h: wire.Header) -> None:
        p = self.pipelines[h.replica]
        wait = h.body.get("input_wait_s")
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < 86400:
            self.metrics.input_wait.observe(wait)
        if not 0 <= h.micro < p.micro_per_step:
            raise WireError(wire.E_OUT_OF_RANGE, f"micro {h.micro} of step {h.step} outside "
                                                 f"[0, {p.micro_per_step})")
        item = Parked(identity, h, time.monotonic())
        if not self._try_serve(p, item):
            self.parking.park(item)

    def _try_serve(self, p: Producer, item: Parked) -> bool:
        """Answer `item` if its step is decided (batch or terminal error); False if it must wait."""
        h = item.header
        with p.queue.cond:
            q = p.queue
            entry = q.entries.get(h.step)
            if entry is None:
                if h.step < q.floor:
                    code, msg = wire.E_OUT_OF_RANGE, (
                        f"step {h.step} of replica {h.replica} was served and released (oldest held step is "
                        f"{q.floor}); RESTORE to go back")
                elif h.step >= q.floor + self.config.lead_steps + self.config.pending_window_steps:
                    code, msg = wire.E_TOO_FAR_AHEAD, (
                        f"step {h.step} is more than {self.config.lead_steps + self.config.pending_window_steps} "
                        f"steps ahead of the oldest held step {q.floor}")
                else:
                    last = next(reversed(q.entries.values()), None)
                    if last is not None and last.error is not None and h.step > last.step:
                        entry = last  # the stream stops at a terminal step; later steps share its error
                    else:
                        return False
                if entry is None:
                    self._error(item.identity, h, code, msg)
                    return True
            if entry.error is not None:
                code, msg, extra = entry.error
                self._error(item.identity, h, code, msg, **extra)
                return True
            arrays = entry.micros[h.micro]
            # Header bytes from pre-encoded parts: constant fields once per generation, the state once per
            # step (by the producer), and only on the step's last micro-batch (docs/protocol.md).
            heads = self._batch_headers.get(h.replica)
            if heads is None or heads.key != (self.generation, h.replica):
                heads = self._batch_headers[h.replica] = wire.BatchHeaders(
                    run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation, replica=h.replica,
                    instance=self.instance)
            last = h.micro == p.micro_per_step - 1
            try:
                samples = entry.samples_json(h.micro) if h.body.get("samples") else None
            except ProtocolError as exc:  # a producer process's sample IDs that are not a list of strings
                self._error(item.identity, h, wire.E_INTERNAL, f"bug in sluice: {exc}")
                return True
            body = wire.BatchHeaders.body(p.micro_per_step, samples, entry.state_json if last else None)
            if last:
                self.metrics.note_state(h.replica, entry.state)
            # A client that asked for packed frames gets the micro-batch's planes (back to back in the step's
            # block) in one frame: fewer frames for libzmq's threads and the client (docs/protocol.md).
            sent = self._route([item.identity, *heads.frames(
                step=h.step, micro=h.micro, request_id=h.request_id, body=body, arrays=arrays,
                pack_below=COPY_BELOW if h.body.get("packed") is True else 0)], entry.borrowed)
            if sent and not h.body.get("observe"):  # observers (sluice peek --observe) do not consume
                entry.delivered[h.micro].add(item.identity)
                if q.release_upto(p.peers):
                    p.after_release()
        m = self.metrics
        m.time_to_batch.observe(time.monotonic() - item.arrived)
        m.batches.inc()
        m.served_bytes.inc(sum(a.nbytes for a in arrays.values()))
        m.served_tokens.inc(int(arrays["input_ids"].size))
        if entry.source_tokens is not None:
            m.served_sources(h.replica, entry.source_tokens[h.micro])
        return True

    def _serve_pending(self, replica: int) -> None:
        p = self.pipelines[replica]
        q = p.queue
        generation = self.generation
        ahead = self.config.lead_steps + self.config.pending_window_steps

        def answered(item: Parked) -> bool:
            h = item.header
            if h.generation < generation:
                self._error(item.identity, h, wire.E_FENCED, f"GET with generation "
                            f"{h.generation} fenced by generation {generation}")
                return True
            # Still plainly waiting (most parked GETs at each announcement, while the producer catches up):
            # kept without the queue's lock and `_try_serve`'s checks. Read unlocked: a step or terminal
            # entry the producer puts after this look is announced after it, and offered again then.
            if q.floor <= h.step < q.floor + ahead and h.step not in q.entries and q.terminal is None:
                return False
            return self._try_serve(p, item)

        self.parking.retry(replica, answered)

    def _restore(self, identity: bytes, h: wire.Header) -> None:
        p = self.pipelines[h.replica]
        state, grew = self.gate.restore(h, p.lanes, p.queue.floor)  # validates before the generation moves
        if grew:
            self.metrics.generation.set(self.generation)
            for r in self.pipelines:
                self._serve_pending(r)  # fences pending GETs of the older generation
        restore_peer(p, identity, h.step, state, h.generation)  # peers of this generation keep what they hold
        if state is not None:
            log.info("restored", extra={"replica": h.replica, "step": state.step})
        self._send(identity, self._reply(h, wire.RESTORE_OK, {"next_step": h.step + 1, "generation": self.generation}))

    def _commit(self, identity: bytes, h: wire.Header) -> None:
        record, grew = self.gate.commit(h, self.pipelines[h.replica].lanes)
        if grew:
            self.metrics.generation.set(self.generation)
        self.metrics.replica(h.replica).committed.set(record["step"])
        self._committed_steps[h.replica] = record["step"]
        log.info("committed", extra={"replica": h.replica, "step": record["step"]})
        self._send(identity, self._reply(h, wire.COMMIT_OK, {"committed_step": record["step"]}))

    def _housekeeping(self, now: float) -> None:
        upkeep.housekeeping(self, now)
        self.gc_pauses.drain(self.metrics.gc_pause.__getitem__)

    def stats(self) -> dict[str, Any]:
        """The STATS body (docs/protocol.md)."""
        return upkeep.stats(self)


def _per_producer(threads: int | None, producers: int) -> int | None:
    """Each producer process's share of the daemon's encoder threads (at least 1); None stays None."""
    return None if threads is None else max(1, threads // max(1, producers))


def _new_instance() -> str:
    """An ID no other daemon instance (nor this one before a wire reset) has had: pid and a nanosecond clock."""
    return f"{os.getpid()}-{time.time_ns():x}"
