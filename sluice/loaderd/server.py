"""The loaderd server: one ROUTER socket, one IO thread, one producer per replica.

The IO thread owns the ROUTER socket (sockets live in the thread that uses
them) and an inproc PULL socket on which producers announce finished steps. It
never blocks on data: a GET whose step is assembled is answered at once from
the replica's `StepQueue`; otherwise it waits in a bounded pending list and is
answered when the producer announces the step. Every message is validated by
`sluice.wire.decode`; anything wrong gets an ERROR reply with a code and a
counter, and the loop goes on.

Fencing (DESIGN.md section 6): the generation lives in `FenceStore` (LMDB,
durable). A request with an older generation gets ERROR(FENCED). RESTORE with a
generation not older than the current one resets the replica's producer to the
given lane states (dropping everything prefetched); COMMIT records step and
lane states durably.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from sluice import wire
from sluice.errors import FencedError, SluiceError, SpecError, StateError
from sluice.loaderd.fencing import FenceStore
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.physical.producer import Producer

log = logging.getLogger("sluice.loaderd")

_NOTIFY = "inproc://loaderd-notify-{}"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything a daemon needs; `loaderd --help` documents each field's flag.

    Bounds: `queue_bytes` per replica (assembled micro-batches), `lead_steps`
    (steps produced ahead of the oldest unreleased one), `decoded_bytes`
    (decoded/tokenized objects shared by all replicas), `max_pending` GETs per
    replica, `request_ttl_s` after which a pending GET of a vanished client is
    dropped (its credit released).
    """

    manifest: Any
    spec: Any
    cache_dir: str
    cache_budget_bytes: int
    replicas: int = 1
    serve: tuple[int, ...] = (0,)
    endpoint: str | None = None  # None: ipc socket in a private 0700 directory
    state_dir: str | None = None  # default <cache_dir>/loaderd-state
    metrics_port: int | None = None  # None: no HTTP exporter; 0: any free port
    workers: int = 2
    worker_kind: str = "thread"  # or "process": decode+tokenize in worker processes
    producer: str = "thread"  # or "process": each replica's producer (logical plane) in its own process
    manifest_path: str | None = None  # needed by producer="process" (the child loads the same files)
    runspec_path: str | None = None
    lead_steps: int = 8
    queue_bytes: int = 256 << 20
    decoded_bytes: int = 256 << 20
    max_pending: int = 4096
    pending_window_steps: int = 256
    request_ttl_s: float = 60.0
    verify_on_read: bool = True
    switch_interval_s: float = 0.0002
    limits: wire.Limits = field(default_factory=wire.Limits)
    curve: Any = None  # sluice.curve.CurveServerKeys: encrypt and authenticate every connection

    def __post_init__(self) -> None:
        self.spec.check_replicas(self.replicas)
        bad = [r for r in self.serve if not 0 <= r < self.replicas]
        if not self.serve or bad or len(set(self.serve)) != len(self.serve):
            raise SpecError(f"loaderd: --serve {list(self.serve)} must be distinct replicas in [0, {self.replicas})")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, curve=self.curve is not None)
        if self.producer not in ("thread", "process"):
            raise SpecError(f"loaderd: producer {self.producer!r} is not 'thread' or 'process'")
        if self.producer == "process" and not (self.manifest_path and self.runspec_path):
            raise SpecError("loaderd: producer='process' needs manifest_path and runspec_path")
        for name in ("workers", "lead_steps", "queue_bytes", "decoded_bytes", "max_pending"):
            if getattr(self, name) < 1:
                raise SpecError(f"loaderd: {name} must be >= 1, got {getattr(self, name)}")


def private_ipc_endpoint() -> str:
    """ipc:// endpoint in a fresh 0700 directory (mkdtemp creates it 0700)."""
    d = tempfile.mkdtemp(prefix="sluice-loaderd-")
    return f"ipc://{d}/loaderd.sock"


def check_endpoint(endpoint: str, curve: bool = False) -> None:
    """ipc://, loopback TCP, or (only with CurveZMQ keys) any TCP address."""
    if endpoint.startswith("ipc://"):
        return
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]") and not curve:
            raise SpecError(
                f"loaderd: endpoint {endpoint} is not loopback; tcp beyond loopback needs CurveZMQ keys "
                "(--curve-secret and --curve-clients; see `sluice curve-keys`), or use ipc:// or tcp://127.0.0.1:*"
            )
        return
    raise SpecError(f"loaderd: endpoint {endpoint!r} must start with ipc:// or tcp://")


def write_private(path: str, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, p)


@dataclass
class _Pending:
    identity: bytes
    header: wire.Header
    arrived: float


class Server:
    """A loaderd instance. `bind()` then `serve(stop)`; `close()` releases everything."""

    def __init__(self, config: ServerConfig) -> None:
        from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path

        self.config = config
        m, spec = config.manifest, config.spec
        self.run_id = spec.run_id
        self.dataset_id = m.dataset_id
        self.instance = f"{os.getpid()}-{time.time_ns():x}"
        self.metrics = Metrics(self.run_id, self.dataset_id, [s.name for s in m.sources],
                               [float(s.weight) for s in m.sources])
        self.fence = FenceStore(config.state_dir or os.path.join(config.cache_dir, "loaderd-state"),
                                self.run_id, self.dataset_id)
        self.generation = self.fence.generation()
        self.metrics.generation.set(self.generation)
        self.data = open_data_path(m, spec, DataPathConfig(
            cache_dir=config.cache_dir, cache_budget=config.cache_budget_bytes, verify_on_read=config.verify_on_read,
            decoded_bytes=config.decoded_bytes, workers=config.workers,
            # with producer processes the children decode; this one only serves stats
            worker_kind=config.worker_kind if config.producer == "thread" else "thread"), metrics=self.metrics)
        self.cache, self.docs = self.data.cache, self.data.docs
        self._validator = self.data.plan()
        self.pipelines: dict[int, Producer] = {}
        self._pending: dict[int, deque[_Pending]] = {}
        self._restored: dict[int, tuple[int, str]] = {}
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
                                "cache_dir": config.cache_dir, "cache_budget": config.cache_budget_bytes,
                                "verify_on_read": config.verify_on_read, "decoded_bytes": config.decoded_bytes,
                                "workers": config.workers, "worker_kind": config.worker_kind})
            else:
                self.pipelines[r] = ReplicaPipeline(
                    plan=plan, replica=r, replicas=config.replicas, docs=self.docs, state=plan.initial_state(),
                    max_bytes=config.queue_bytes, lead_steps=config.lead_steps, notify=self._notify,
                    metrics=self.metrics,
                )
            self._pending[r] = deque()
        self._notify_addr = _NOTIFY.format(id(self))
        self._local = threading.local()
        self._notify_lock = threading.Lock()
        self._notify_socks: list[zmq.Socket] = []
        self.endpoint: str | None = None
        self.metrics_port: int | None = None
        self._router: zmq.Socket | None = None
        self._pull: zmq.Socket | None = None
        self._auth: Any = None
        self.requests = 0

    # -- lifecycle --------------------------------------------------------------
    def bind(self) -> str:
        """Bind the ROUTER (and the metrics port); start producers; return the endpoint."""
        endpoint = self.config.endpoint or private_ipc_endpoint()
        curve = self.config.curve
        check_endpoint(endpoint, curve=curve is not None)
        router = self.ctx.socket(zmq.ROUTER)
        if curve is not None:
            # ZAP handler: only clients whose public key is in clients_dir get in.
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.clients_dir)
            router.curve_secretkey = curve.secret
            router.curve_publickey = curve.public
            router.curve_server = True
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 1024)
        router.setsockopt(zmq.SNDHWM, 4096)
        # Transport bound: libzmq drops the peer before buffering a larger frame.
        router.setsockopt(zmq.MAXMSGSIZE, max(self.config.limits.max_header_bytes, self.config.limits.max_frame_bytes))
        router.bind(endpoint)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        self._router = router
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._notify_addr)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self.config.metrics_port)
        # The producers are GIL-bound Python (the logical plane); with the default 5 ms
        # switch interval a GET waits up to 5 ms for the IO thread to get the GIL back.
        # 0.2 ms keeps time-to-batch near the socket's own latency (docs/loaderd.md).
        sys.setswitchinterval(self.config.switch_interval_s)
        for p in self.pipelines.values():
            p.start()
        log.info("loaderd listening", extra={"endpoint": self.endpoint, "metrics_port": self.metrics_port,
                                             "pid": os.getpid()})
        return self.endpoint

    def serve(self, stop: threading.Event) -> None:
        """Run the IO loop until `stop` is set; then answer pending GETs SHUTTING_DOWN."""
        assert self._router is not None and self._pull is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
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
                while True:
                    try:
                        ready.add(int(self._pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                for r in ready:
                    self._serve_pending(r)
            for sock, r in producer_socks.items():
                if sock in events and self.pipelines[r].receive():
                    self._serve_pending(r)
            if self._router in events:
                for _ in range(256):  # bounded burst, then look at the notifications again
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            now = time.monotonic()
            if now >= next_housekeeping:
                self._housekeeping(now)
                next_housekeeping = now + 0.5
        for r, pend in self._pending.items():
            while pend:
                item = pend.popleft()
                self._error(item.identity, item.header, wire.E_SHUTTING_DOWN, "loaderd is shutting down")
        log.info("loaderd drained", extra={"pid": os.getpid()})

    def close(self) -> None:
        for p in self.pipelines.values():
            p.stop()
        self.data.close()
        for s in self._notify_socks:
            s.close(0)
        if self._router is not None:
            self._router.close(0)
        if self._pull is not None:
            self._pull.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        self.fence.close()
        if self.endpoint and self.endpoint.startswith("ipc://") and self.config.endpoint is None:
            path = Path(self.endpoint[len("ipc://"):])
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass

    def _notify(self, replica: int) -> None:
        """Called from a producer thread: wake the IO thread (socket per thread)."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._notify_addr)
            self._local.sock = sock
            with self._notify_lock:
                self._notify_socks.append(sock)
        sock.send(str(replica).encode())

    # -- message handling -------------------------------------------------------
    def _send(self, identity: bytes, header: wire.Header, arrays: dict[str, Any] | None = None) -> None:
        assert self._router is not None
        self._router.send_multipart([identity, *wire.encode(header, arrays)], copy=False)

    def _error(self, identity: bytes, request: wire.Header | None, code: str, message: str, **extra: Any) -> None:
        self.metrics.error(code)
        if code not in (wire.E_END,):
            log.warning(message, extra={"code": code, "step": request.step if request else None,
                                        "replica": request.replica if request else None})
        reply = wire.error_reply(request, code, message, instance=self.instance, **extra)
        self._send(identity, dataclasses.replace(reply, generation=self.generation))

    def _handle(self, frames: list[Any]) -> None:
        self.requests += 1
        identity = frames[0].bytes if frames else b""
        header = None
        try:
            msg = wire.decode(frames[1:], self.config.limits)
            header = msg.header
            if header.kind not in wire.REQUEST_KINDS:
                raise wire.WireError(wire.E_UNKNOWN_KIND, f"{header.kind} is a reply kind; the daemon takes "
                                                          f"{', '.join(wire.REQUEST_KINDS)}")
            if header.kind == wire.STATS and not header.run_id and not header.dataset_id:
                # An operator query (sluice peek, monitoring) may ask without knowing the IDs.
                self._send(identity, self._reply(header, wire.STATS_OK, {"stats": self.stats()}))
                return
            if header.run_id != self.run_id:
                raise wire.WireError(wire.E_WRONG_RUN, f"run ID {header.run_id!r} differs from this daemon's "
                                                       f"{self.run_id!r}")
            if header.dataset_id != self.dataset_id:
                raise wire.WireError(wire.E_WRONG_DATASET, f"dataset ID {header.dataset_id!r} differs from this "
                                                           f"daemon's {self.dataset_id!r}")
            if header.kind == wire.STATS:
                self._send(identity, self._reply(header, wire.STATS_OK, {"stats": self.stats()}))
                return
            if header.replica not in self.pipelines:
                raise wire.WireError(wire.E_BAD_REPLICA, f"replica {header.replica} is not served here (this "
                                                         f"daemon serves {sorted(self.pipelines)} of "
                                                         f"{self.config.replicas})")
            if header.kind == wire.HELLO:
                self._hello(identity, header)
            elif header.instance and header.instance != self.instance:
                # A request queued for a daemon that died and reached us through zmq's
                # automatic reconnect: serving it would count as a delivery to a socket
                # nobody reads and release steps its client still needs.
                raise wire.WireError(wire.E_WRONG_INSTANCE, f"{header.kind} is addressed to daemon instance "
                                                            f"{header.instance!r}, this is {self.instance!r}")
            elif header.generation < self.generation:
                raise wire.WireError(wire.E_FENCED, f"{header.kind} with generation {header.generation} is older "
                                                    f"than the daemon's generation {self.generation}")
            elif header.kind == wire.GET:
                self._get(identity, header)
            elif header.kind == wire.RESTORE:
                self._restore(identity, header)
            elif header.kind == wire.COMMIT:
                self._commit(identity, header)
        except wire.WireError as exc:
            self._error(identity, header, exc.code, str(exc))
        except FencedError as exc:
            self._error(identity, header, wire.E_FENCED, str(exc))
        except StateError as exc:
            self._error(identity, header, wire.E_BAD_STATE, str(exc))
        except SluiceError as exc:
            self._error(identity, header, wire.E_INTERNAL, str(exc))
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
            raise wire.WireError(wire.E_BAD_REPLICA, f"client says replicas={replicas!r}, this daemon serves "
                                                     f"replicas={self.config.replicas}")
        peers = h.body.get("peers", 1)
        if not isinstance(peers, int) or isinstance(peers, bool) or not 1 <= peers <= 1024:
            raise wire.WireError(wire.E_MALFORMED, f"HELLO peers must be an integer in [1, 1024], got {peers!r}")
        p = self.pipelines[h.replica]
        with p.queue.cond:
            p.peers = peers
            floor = p.queue.floor
        committed = self.fence.committed(h.replica)
        body = {
            "instance": self.instance,
            "generation": self.generation,
            "floor_step": floor,
            "next_step": p.next_step,
            "micro_per_step": p.micro_per_step,
            "lanes": p.lanes,
            "replicas": self.config.replicas,
            "seq_len": self.config.manifest.packing.seq_len,
            "micro_batch": self.config.spec.micro_batch,
            "max_steps": self.config.spec.max_steps,
            "lead_steps": self.config.lead_steps,
            "committed_step": committed["step"] if committed else -1,
            "runspec_digest": self.config.spec.digest,
        }
        log.info("hello", extra={"replica": h.replica, "peer": identity.hex()})
        self._send(identity, self._reply(h, wire.HELLO_OK, body))

    def _get(self, identity: bytes, h: wire.Header) -> None:
        p = self.pipelines[h.replica]
        wait = h.body.get("input_wait_s")
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < 86400:
            self.metrics.input_wait.observe(wait)
        if not 0 <= h.micro < p.micro_per_step:
            raise wire.WireError(wire.E_OUT_OF_RANGE, f"micro {h.micro} of step {h.step} outside "
                                                      f"[0, {p.micro_per_step})")
        item = _Pending(identity, h, time.monotonic())
        if self._try_serve(p, item):
            return
        pend = self._pending[h.replica]
        if len(pend) >= self.config.max_pending:
            raise wire.WireError(wire.E_OVERLOADED, f"{len(pend)} GETs already pending for replica {h.replica}")
        pend.append(item)

    def _try_serve(self, p: Producer, item: _Pending) -> bool:
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
            body: dict[str, Any] = {"micro_per_step": p.micro_per_step}
            if h.body.get("samples"):
                body["samples"] = entry.samples[h.micro]
            if h.micro == p.micro_per_step - 1:
                body["state"] = entry.state
            self._send(item.identity, self._reply(h, wire.BATCH, body), arrays)
            if not h.body.get("observe"):  # observers (sluice peek --observe) do not consume
                entry.delivered[h.micro].add(item.identity)
                if q.release_upto(p.peers):
                    p.after_release()
        m = self.metrics
        m.time_to_batch.observe(time.monotonic() - item.arrived)
        m.batches.inc()
        m.served_bytes.inc(sum(a.nbytes for a in arrays.values()))
        m.served_tokens.inc(int(arrays["input_ids"].size))
        return True

    def _serve_pending(self, replica: int) -> None:
        p = self.pipelines[replica]
        pend = self._pending[replica]
        keep: deque[_Pending] = deque()
        while pend:
            item = pend.popleft()
            if item.header.generation < self.generation:
                self._error(item.identity, item.header, wire.E_FENCED,
                            f"GET with generation {item.header.generation} fenced by generation {self.generation}")
            elif not self._try_serve(p, item):
                keep.append(item)
        self._pending[replica] = keep

    def _restore(self, identity: bytes, h: wire.Header) -> None:
        p = self.pipelines[h.replica]
        if h.body.get("initial") is True and "state" not in h.body:
            # A trainer starting over without a checkpoint (e.g. it died before its
            # first one): the state before step 0 is a pure function of the run.
            state = self._validator.initial_state()
        else:
            state = self._validator.load_state(h.body.get("state"))
        state = state.subset(p.lanes)  # StateError names the missing lanes
        key = json.dumps(state.state_dict(), sort_keys=True, separators=(",", ":"))
        self.fence.advance(h.generation)  # durable before we act on it
        if h.generation > self.generation:
            self.generation = h.generation
            self.metrics.generation.set(self.generation)
            for r in self.pipelines:
                self._serve_pending(r)  # fences pending GETs of the older generation
        if self._restored.get(h.replica) != (h.generation, key):
            p.reset(state)
            self._restored[h.replica] = (h.generation, key)
            log.info("restored", extra={"replica": h.replica, "step": state.step})
        self._send(identity, self._reply(h, wire.RESTORE_OK, {"next_step": state.step + 1, "generation": self.generation}))

    def _commit(self, identity: bytes, h: wire.Header) -> None:
        p = self.pipelines[h.replica]
        state = self._validator.load_state(h.body.get("state")).subset(p.lanes)
        if state.step != h.step:
            raise StateError(f"COMMIT of step {h.step} carries the state after step {state.step}")
        record = self.fence.commit(h.replica, h.step, h.generation, state.state_dict())
        if h.generation > self.generation:
            self.generation = h.generation
            self.metrics.generation.set(self.generation)
        self.metrics.replica(h.replica)[5].set(record["step"])
        self._committed_steps[h.replica] = record["step"]
        log.info("committed", extra={"replica": h.replica, "step": record["step"]})
        self._send(identity, self._reply(h, wire.COMMIT_OK, {"committed_step": record["step"]}))

    def _housekeeping(self, now: float) -> None:
        ttl = self.config.request_ttl_s
        for r, p in self.pipelines.items():
            code = p.exit_code()
            if code is not None:
                self._producer_died(r, p, code)
            pend = self._pending[r]
            if pend and now - pend[0].arrived > ttl:
                keep = deque(i for i in pend if now - i.arrived <= ttl)
                self.metrics.released_credits.inc(len(pend) - len(keep))
                self._pending[r] = keep
            qs, qb, qa, lead, pending, committed, lag = self.metrics.replica(r)
            with p.queue.cond:
                q = p.queue
                qs.set(len(q.entries))
                qb.set(q.nbytes)
                first = next(iter(q.entries.values()), None)
                qa.set(now - first.created if first else 0.0)
                lead.set(p.next_step - q.floor)
                floor = q.floor
            pending.set(len(self._pending[r]))
            c = self._committed_steps.get(r)
            if c is not None:
                lag.set(max(0, floor - 1 - c))
        self.metrics.docs_cache_bytes.set(self.docs.nbytes)
        try:
            st = self.cache.stats()
            self.metrics.cache_hits.inc(max(0, st.hits - getattr(self, "_cache_hits_seen", 0)))
            self.metrics.cache_misses.inc(max(0, st.misses - getattr(self, "_cache_misses_seen", 0)))
            self._cache_hits_seen, self._cache_misses_seen = st.hits, st.misses
        except SluiceError:  # stats are best effort; a busy index must not stop serving
            pass

    def _producer_died(self, r: int, p: Producer, code: int) -> None:
        """A producer process exited: its replica's next step becomes an INTERNAL error (never a hang)."""
        with p.queue.cond:
            last = next(reversed(p.queue.entries.values()), None)
            if last is not None and last.error is not None:
                return
            from sluice.loaderd.physical.pipeline import StepEntry

            p.queue.put(StepEntry(step=p.next_step, micros=[], samples=[], state=None, nbytes=0,
                                  created=time.monotonic(),
                                  error=(wire.E_INTERNAL, f"step {p.next_step}: the producer process of replica "
                                                          f"{r} exited with code {code}", {})))
        log.error("producer process died", extra={"replica": r, "step": p.next_step})
        self._serve_pending(r)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "instance": self.instance,
            "run_id": self.run_id,
            "dataset_id": self.dataset_id,
            "replicas_total": self.config.replicas,
            "served": sorted(self.pipelines),
            "generation": self.generation,
            "requests": self.requests,
            "errors": self.metrics.error_counts(),
            "decoded_bytes": self.docs.nbytes,
            "decoded_hits": self.docs.hits,
            "decoded_misses": self.docs.misses,
            "rss_bytes": _rss_bytes(),
            "replicas": {},
        }
        for r, p in self.pipelines.items():
            with p.queue.cond:
                out["replicas"][str(r)] = {
                    "floor_step": p.queue.floor,
                    "next_step": p.next_step,
                    "queued_steps": len(p.queue.entries),
                    "queued_bytes": p.queue.nbytes,
                    "pending": len(self._pending[r]),
                    "produced_steps": p.produced_steps,
                    "peers": p.peers,
                }
        return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
