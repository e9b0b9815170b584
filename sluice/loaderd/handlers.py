"""The daemon's answers to requests: GET, RESTORE, COMMIT, STATS, HELLO and their refusals.

`Requests.handle` takes one received message (IO thread): it must carry the
run token when the daemon has one (UNAUTHORIZED otherwise), name this run,
dataset, a served replica, this daemon instance and a current generation, and
is validated by `sluice.wire.decoding.decode`; anything wrong gets an ERROR reply with
a code and a counter. A GET whose step is decided is answered at once by the
replica's `StepQueue.answer`; otherwise it is parked (parking.py) and offered
again when the producer announces a step (`serve_pending`). Fencing lives in
`gate.StateGate`; an accepted RESTORE resets the replica's producer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from sluice.errors import SluiceError, WireError
from sluice.loaderd.config import ServerConfig
from sluice.loaderd.gate import StateGate
from sluice.loaderd.joined import JoinedReplies
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.parking import Parked, Parking, PeerClaims, apply_claims, restore_peer
from sluice.loaderd.physical.pipeline import ReplicaPipeline
from sluice.loaderd.physical.stepqueue import COPY_BELOW, StepEntry
from sluice.loaderd import arena, rings
from sluice.wire import decoding, encoding, errorcodes, protocol, runtoken

__all__ = ["MAX_SPAN", "Requests", "checked", "hello_body", "new_instance", "refusal", "span", "unread"]

log = logging.getLogger("sluice.loaderd")

# Refusals every restart or restore causes (pending requests drained at
# shutdown, requests queued for the previous daemon instance or generation):
# logged once at info per code, not as a warning per request.
_EXPECTED_AFTER_RESTART = frozenset({errorcodes.E_SHUTTING_DOWN, errorcodes.E_WRONG_INSTANCE, errorcodes.E_FENCED})


MAX_SPAN = 16  # the most positions one GET may ask for (HELLO_OK `max_count`; docs/protocol.md, "Spans")


def span(h: protocol.Header, micro_per_step: int) -> list[protocol.Header]:
    """The positions a GET asks for: `h` itself, or with body ``count`` k > 1 the k positions from (step,
    micro) on in stream order (across steps), request IDs ``request_id`` .. ``request_id + k - 1``.
    WireError(MALFORMED) for a count that is not an integer in [1, MAX_SPAN]."""
    count = h.body.get("count", 1)
    if count == 1 and type(count) is int:
        return [h]
    if type(count) is not int or not 1 <= count <= MAX_SPAN or h.request_id + count > 2**62:
        raise WireError(errorcodes.E_MALFORMED, f"GET count must be an integer in [1, {MAX_SPAN}] (request IDs "
                                                f"below 2**62), got {count!r:.40}")
    out = []
    for i in range(count):
        at = object.__new__(protocol.Header)  # (h's fields but three: the frozen __init__ skipped, as decode does)
        at.__dict__.update(h.__dict__, step=h.step + (h.micro + i) // micro_per_step,
                           micro=(h.micro + i) % micro_per_step, request_id=h.request_id + i)
        out.append(at)
    return out


def refusal(exc: Exception) -> tuple[str, str]:
    """The ERROR code and message that answer a request `exc` stopped: its own for a SluiceError; else a bug in
    sluice (logged with its traceback), INTERNAL."""
    if isinstance(exc, SluiceError):
        return errorcodes.code_for(exc), str(exc)
    log.exception("internal error handling a message")
    return errorcodes.E_INTERNAL, f"bug in sluice: {exc!r}"


def unread(frames: int, limits: protocol.Limits) -> WireError:
    """The refusal of a message of `frames` frames, those past `limits` released unread."""
    return WireError(errorcodes.E_TOO_MANY_FRAMES, f"message of {frames} frames exceeds the limits "
                     f"({limits.max_frames} frames, {limits.max_header_bytes} bytes); refused unread")


def checked(header: protocol.Header, token: str | None, run_id: str, dataset_id: str) -> None:
    """WireError unless `header` is a request kind, with the run `token` (E_UNAUTHORIZED), and (but an operator's
    STATS, which may ask without knowing them) of this run and dataset. Checked after decoding, so that the
    refusal carries the request's ID: a client matches replies to its requests by it (else it hears silence)."""
    if header.kind not in protocol.REQUEST_KINDS:
        raise WireError(errorcodes.E_UNKNOWN_KIND, f"{header.kind} is a reply kind; the daemon takes "
                                                   f"{', '.join(protocol.REQUEST_KINDS)}")
    if token is not None and not runtoken.token_matches(token, header.body.get("token")):
        raise WireError(errorcodes.E_UNAUTHORIZED, f"{header.kind} without this run's token is refused "
                                                   "(pass the launcher's token: Client(token=...) or SLUICE_TOKEN)")
    if header.kind == protocol.STATS and not header.run_id and not header.dataset_id:
        return
    if header.run_id != run_id:
        raise WireError(errorcodes.E_WRONG_RUN, f"run ID {header.run_id!r} differs from this daemon's {run_id!r}")
    if header.dataset_id != dataset_id:
        raise WireError(errorcodes.E_WRONG_DATASET, f"dataset ID {header.dataset_id!r} differs from this "
                                                    f"daemon's {dataset_id!r}")


def hello_body(req: Requests, replica: int) -> dict[str, Any]:
    """The HELLO_OK body `req` answers for `replica`: who this daemon is and where the replica stands
    (docs/protocol.md)."""
    p = req.pipelines[replica]
    committed = req.gate.fence.committed(replica)
    c = req.config
    return {
        "instance": req.instance, "generation": req.generation, "floor_step": p.queue.figures().floor,
        "next_step": p.next_step, "micro_per_step": p.micro_per_step, "lanes": p.lanes,
        "replicas": c.replicas, "seq_len": c.manifest.packing.seq_len, "micro_batch": c.spec.micro_batch,
        "global_batch": c.spec.global_batch, "max_steps": c.spec.max_steps, "lead_steps": c.lead_steps,
        "request_ttl_s": c.request_ttl_s, "committed_step": committed["step"] if committed else -1,
        "runspec_digest": c.spec.digest, "resume": c.spec.resume, "max_count": MAX_SPAN,
    }


def new_instance() -> str:
    """An ID no other daemon instance (nor this one before a wire reset) has had: pid and a nanosecond clock."""
    return f"{os.getpid()}-{time.time_ns():x}"


class Requests:
    """Answers the requests of one daemon: its identity, replicas, parked GETs, peer claims and counters.

    `route(frames, copy)` sends a reply without blocking (False: not
    delivered); `stats()` gives the STATS body (upkeep.py).
    """

    def __init__(self, config: ServerConfig, gate: StateGate, metrics: Metrics,
                 pipelines: dict[int, ReplicaPipeline],
                 route: Callable[[list[Any]], bool], stats: Callable[[], dict[str, Any]]) -> None:
        self.config, self.gate, self.metrics, self.pipelines = config, gate, metrics, pipelines
        self.run_id, self.dataset_id = config.spec.run_id, config.manifest.dataset_id
        self.instance = new_instance()
        self.parking = Parking(pipelines, config.max_pending)
        # claims outlive parked GETs (1 TTL): a live client re-asks after EXPIRED before its claim lapses
        self.claims = PeerClaims(2 * config.request_ttl_s)
        self._route, self._stats = route, stats
        self._ahead = config.lead_steps + config.pending_window_steps  # how far past the floor a GET may wait
        self._batch_headers: dict[int, encoding.BatchHeaders] = {}  # replica -> BATCH header template
        self.committed_steps: dict[int, int] = {}
        self.requests = 0  # received (STATS `requests`)
        self.dropped_frames = 0  # frames of over-long messages released unread
        self.unauthorized = 0  # requests refused for want of the token
        self._logged_expected: set[str] = set()  # codes of expected refusals already logged at info
        self.rings: rings.Rings | None = None  # shared-memory rings (rings.py), made once the endpoint is bound
        self.arena: arena.Arena | None = None  # the producers' blocks in shared memory (arena.py), made then too
        self.arena_refused: str | None = None  # why there is none (STATS ``arena``)
        self.joined = JoinedReplies()  # ring replies of this turn, sent at its end (`_flush`)

    @property
    def generation(self) -> int:
        return self.gate.generation

    def new_instance(self) -> str:
        """Answer as a new daemon instance from now on (after every connection was dropped); the old ID."""
        old, self.instance = self.instance, new_instance()
        self._batch_headers.clear()  # they carry the instance ID
        return old

    # -- what upkeep asks (upkeep.py) ---------------------------------------------------
    def pending(self, replica: int) -> int:
        """GETs of `replica` parked now."""
        return self.parking.count(replica)

    def committed(self, replica: int) -> int | None:
        """The last step of `replica` a COMMIT recorded since this daemon started (None: none)."""
        return self.committed_steps.get(replica)

    def expire(self, replica: int, now: float) -> int:
        """Answer ERROR(EXPIRED) to the GETs of `replica` parked longer than the request TTL; how many."""
        ttl = self.config.request_ttl_s
        expired = self.parking.expire(replica, now, ttl)
        for item in expired:
            # Never silent: a live client learns it must ask again; a vanished one is gone anyway.
            self.error(item.identity, item.header, errorcodes.E_EXPIRED,
                       f"GET of step {item.header.step} micro {item.header.micro} of replica {replica} waited "
                       f"longer than the daemon's request TTL of {ttl} s; ask again")
        return len(expired)

    def lapse_claims(self, replica: int, now: float) -> None:
        """Drop lapsed HELLO `peers` claims of `replica`; the release re-runs when its peers drop."""
        apply_claims(self.claims, replica, self.pipelines[replica], now)

    def drain(self, code: str | None, message: str = "") -> int:
        """Drop every parked GET (answered ERROR `code`, when given); how many."""
        items = self.parking.drain()
        if code is not None:
            for item in items:
                self.error(item.identity, item.header, code, message)
        return len(items)

    # -- replies ---------------------------------------------------------------------
    def send(self, identity: bytes, header: protocol.Header, arrays: dict[str, Any] | None = None) -> bool:
        return self._route([identity, *encoding.encode(header, arrays)])

    def error(self, identity: bytes, request: protocol.Header | None, code: str, message: str, **extra: Any) -> None:
        """Reply ERROR `code` to `request` (counted; logged once per code where a restart or restore causes it)."""
        self.metrics.error(code)
        extra_log = {"code": code, "step": request.step if request else None,
                     "replica": request.replica if request else None}
        if code in _EXPECTED_AFTER_RESTART:
            # Requests a client queued for the previous instance or generation arrive in bursts (one per
            # credit) after every restart or restore: expected, so one info line per code; the counter has all.
            level = logging.DEBUG if code in self._logged_expected else logging.INFO
            self._logged_expected.add(code)
            log.log(level, f"{message} (expected around a daemon restart or a restore; further ones at debug)",
                    extra=extra_log)
        elif code not in (errorcodes.E_END,):
            log.warning(message, extra=extra_log)
        reply = errorcodes.error_reply(request, code, message, instance=self.instance, **extra)
        self.send(identity, dataclasses.replace(reply, generation=self.generation))

    def _reply(self, request: protocol.Header, kind: str, body: dict[str, Any]) -> protocol.Header:
        return protocol.Header(kind=kind, run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation,
                               replica=request.replica, step=request.step, micro=request.micro,
                               request_id=request.request_id, instance=self.instance, body=body)

    # -- dispatch ----------------------------------------------------------------------
    def handle(self, frames: list[Any], dropped: int = 0) -> None:
        """Answer one received message (`dropped`: frames released unread past the limits)."""
        self.requests += 1
        identity = frames[0] if frames else b""
        header = None
        try:
            if dropped:  # (then no header is known)
                self.dropped_frames += dropped
                raise unread(len(frames) - 1 + dropped, self.config.limits)
            header = decoding.decode_header(frames[1:], self.config.limits)
            checked(header, self.config.token, self.run_id, self.dataset_id)
            kind = header.kind
            if kind == protocol.STATS:
                self.send(identity, self._reply(header, protocol.STATS_OK, {"stats": self._stats()}))
                return
            p = self.pipelines.get(header.replica)
            if p is None:
                raise WireError(errorcodes.E_BAD_REPLICA, f"replica {header.replica} is not served here (this "
                                                          f"daemon serves {sorted(self.pipelines)} of "
                                                          f"{self.config.replicas})")
            now = time.monotonic()  # (one clock read a request: the claim's refresh and a GET's arrival)
            self.claims.seen(header.replica, identity, now)
            if self.rings is not None:
                self.rings.seen(identity, now, header.body)
            if self.arena is not None and "release_arena" in header.body:
                self.arena.release(identity, header.body["release_arena"])
            if kind == protocol.HELLO:
                self._hello(identity, header, now)
            elif header.instance and header.instance != self.instance:
                # A request queued for a daemon that died and reached us through zmq's
                # automatic reconnect: serving it would count as a delivery to a socket
                # nobody reads and release steps its client still needs.
                raise WireError(errorcodes.E_WRONG_INSTANCE, f"{kind} is addressed to daemon instance "
                                                             f"{header.instance!r}, this is {self.instance!r}")
            elif header.generation < self.gate.generation:
                raise WireError(errorcodes.E_FENCED, f"{kind} with generation {header.generation} is older "
                                                     f"than the daemon's generation {self.generation}")
            elif kind == protocol.GET:
                self._get(identity, header, p, now)
            elif kind == protocol.RESTORE:
                self._restore(identity, header)
            elif kind == protocol.COMMIT:
                self._commit(identity, header)
        except Exception as exc:  # a bug must not take the daemon down; report and count it
            code, message = refusal(exc)
            self.unauthorized += code == errorcodes.E_UNAUTHORIZED  # (only `checked` refuses for the token)
            self.error(identity, header, code, message)

    def _hello(self, identity: bytes, h: protocol.Header, now: float) -> None:
        asked, arena_asked = rings.asked(h.body), arena.asked(h.body)
        replicas = h.body.get("replicas")
        if replicas != self.config.replicas:
            raise WireError(errorcodes.E_BAD_REPLICA, f"client says replicas={replicas!r}, this daemon serves "
                                                      f"replicas={self.config.replicas}")
        peers = h.body.get("peers", 1)
        if not isinstance(peers, int) or isinstance(peers, bool) or not 1 <= peers <= 1024:
            raise WireError(errorcodes.E_MALFORMED, f"HELLO peers must be an integer in [1, 1024], got {peers!r}")
        self.claims.claim(h.replica, identity, peers, now)
        apply_claims(self.claims, h.replica, self.pipelines[h.replica], now)
        log.info("hello", extra={"replica": h.replica, "peer": identity.hex()})
        shm = {"ring": self.rings.offer(identity, asked, now)} if asked is not None and self.rings is not None else {}
        if arena_asked is not None:
            shm["arena"] = self.arena.offer(identity, arena_asked) if self.arena is not None else None
        self.send(identity, self._reply(h, protocol.HELLO_OK, {**hello_body(self, h.replica), **shm}))

    # -- GET ---------------------------------------------------------------------------
    def _get(self, identity: bytes, h: protocol.Header, p: ReplicaPipeline, now: float) -> None:
        """Each position of the GET (`span`) answered or parked as a GET of its own (a refusal: its own ERROR)."""
        wait = h.body.get("input_wait_s")
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < 86400:
            self.metrics.input_wait.observe(wait)
        if not 0 <= h.micro < p.micro_per_step:
            raise WireError(errorcodes.E_OUT_OF_RANGE, f"micro {h.micro} of step {h.step} outside "
                                                       f"[0, {p.micro_per_step})")
        try:
            for at in span(h, p.micro_per_step):
                try:
                    item = Parked(identity, at, now)  # (not made yet, as most, asked `credits` ahead: parked
                    if p.queue.undecided(at.step, self._ahead) or not self._try_serve(p, item):  # without a lock)
                        self.parking.park(item)
                except Exception as exc:  # (OVERLOADED; a bug) each position answered, as a GET of its own was
                    self.error(identity, at, *refusal(exc))
        finally:
            self._flush()

    def _try_serve(self, p: ReplicaPipeline, item: Parked) -> bool:
        """Answer `item` if its step is decided (batch or terminal error); False if it must wait."""
        h = item.header
        micro, body = h.micro, h.body  # (read once: a GET's header never changes)
        served: list[StepEntry] = []  # the entry whose micro-batch was sent (counted below, off the queue's lock)

        def send(entry: StepEntry) -> bytes | None:  # (under the queue's lock: a ring's slot stays the step's)
            if entry.error is not None:
                code, msg, extra = entry.error
                self.error(item.identity, h, code, msg, **extra)
                return None
            samples = entry.samples_json(micro) if body.get("samples") else None
            last = micro == p.micro_per_step - 1
            reply = encoding.BatchHeaders.body(p.micro_per_step, samples, entry.state_json if last else None)
            if last:
                self.metrics.note_state(h.replica, entry.state_later())
            # Packed frames where asked: the planes (back to back in the step's block) in one (docs/protocol.md).
            frames = self._headers(h.replica).frames(
                step=h.step, micro=micro, request_id=h.request_id, body=reply, arrays=entry.micros[micro],
                pack_below=COPY_BELOW if body.get("packed") is True else 0)
            # Arrays in the arena (arena.py) go as a reference to them; else a ring's holder (rings.py) gets them
            # in its next slot, under the queue's lock
            out = frames
            if body.get("arena") is True and self.arena is not None:
                ref = self.arena.ref(item.identity, frames[1:])
                if ref is not None:
                    out = [frames[0], ref]
            if out is frames and body.get("ring") is True and self.rings:
                out = self.rings.frames(item.identity, frames, h)
            if out is not frames and body.get("joined") is True:  # sent at the turn's end, then counted (_flush)
                self.joined.add(item.identity, out, (p, h, entry, item.arrived, not body.get("observe")))
                return None
            sent = self._route([item.identity, *out])
            if not sent and out is not frames and self.arena is not None:
                self.arena.unsent(item.identity, out)
            served.append(entry)
            # observers (sluice peek --observe) do not consume
            return item.identity if sent and not body.get("observe") else None

        try:
            decided = p.queue.answer(h.step, micro, h.replica, ahead=self._ahead, peers=p.peers, send=send)
        except WireError as exc:  # released already, or too far ahead
            self.error(item.identity, h, exc.code, str(exc))
            return True
        if served:
            self._sent(h, served[0], item.arrived)
        return decided

    def _sent(self, h: protocol.Header, entry: StepEntry, arrived: float) -> None:
        """Count the BATCH of `h`'s micro-batch of `entry` as sent (metrics), `arrived` its GET's arrival."""
        self.metrics.sent.batch(h.replica, entry.micros[h.micro], None if entry.source_tokens is None
                                else entry.source_tokens[h.micro], time.monotonic() - arrived)

    def _flush(self) -> None:
        """Send the ring replies this turn joined (joined.py), a message per client; a position whose message
        left counts as received by that client (but an observer's), as `answer` counts one sent alone."""
        for identity, frames, positions in self.joined.take():
            sent = self._route([identity, *frames])
            if not sent and self.arena is not None:
                self.arena.unsent(identity, frames)
            for p, h, entry, arrived, consumes in positions:
                if sent and consumes:
                    p.queue.delivered(entry, h.micro, identity, p.peers)
                self._sent(h, entry, arrived)

    def ring_offer(self, identity: bytes, request: protocol.Header, offer: dict[str, Any]) -> None:
        """Send `identity` a new ring (`rings.Rings.announce`): a RING message answering `request`'s ID."""
        self.send(identity, self._reply(request, protocol.RING, {"ring": offer}))

    def _headers(self, replica: int) -> encoding.BatchHeaders:
        """Header bytes from pre-encoded parts: constant fields once per generation, the state once per step
        (by the producer), and only on the step's last micro-batch (docs/protocol.md)."""
        heads = self._batch_headers.get(replica)
        if heads is None or heads.key[0] != self.gate.generation:  # (kept per replica; the instance: cleared)
            heads = self._batch_headers[replica] = encoding.BatchHeaders(
                run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation, replica=replica,
                instance=self.instance)
        return heads

    def serve_pending(self, replica: int) -> None:
        """Offer the parked GETs of `replica` again (its producer announced a step; a generation moved)."""
        p, generation = self.pipelines[replica], self.generation

        def fence(item: Parked) -> None:
            self.error(item.identity, item.header, errorcodes.E_FENCED, f"GET with generation "
                       f"{item.header.generation} fenced by generation {generation}")

        try:
            self.parking.offer(replica, p.queue, self._ahead, generation, lambda item: self._try_serve(p, item),
                               fence)
        finally:
            self._flush()

    # -- RESTORE, COMMIT ------------------------------------------------------------------
    def _restore(self, identity: bytes, h: protocol.Header) -> None:
        p = self.pipelines[h.replica]
        state, grew = self.gate.restore(h, p.lanes, p.queue.figures().floor)  # validated before the generation moves
        if grew:
            self.metrics.generation.set(self.generation)
            for r in self.pipelines:
                self.serve_pending(r)  # fences pending GETs of the older generation
        restore_peer(p, identity, h.step, state, h.generation)  # peers of this generation keep what they hold
        if state is not None:
            log.info("restored", extra={"replica": h.replica, "step": state.step})
        body = {"next_step": h.step + 1, "generation": self.generation}
        self.send(identity, self._reply(h, protocol.RESTORE_OK, body))

    def _commit(self, identity: bytes, h: protocol.Header) -> None:
        record, grew = self.gate.commit(h, self.pipelines[h.replica].lanes)
        if grew:
            self.metrics.generation.set(self.generation)
        self.metrics.replica(h.replica).committed.set(record["step"])
        self.committed_steps[h.replica] = record["step"]
        log.info("committed", extra={"replica": h.replica, "step": record["step"]})
        self.send(identity, self._reply(h, protocol.COMMIT_OK, {"committed_step": record["step"]}))
