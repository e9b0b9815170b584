"""The training-side iterator: micro-batches from loaderd as tensors; a fenced Stateful.

    from sluice.client import Client
    client = Client("ipc:///tmp/sluice-loaderd-x/loaderd.sock", replica=0, replicas=2)
    for step, micros in client.steps(start):   # this replica's micro-batches of one global step
        ...                                     # each a dict: the batch arrays (input_ids, labels, ...:
                                                # sluice/batcharrays.py), step, micro
    state = client.state_dict()   # the data state after the last completed step (JSON)
    client.reset(state)           # RESTORE: resume after `state`; client.reset() starts over at step 0
    client.commit(step)           # COMMIT: the checkpoint holding the state after `step` is durable

The run ID and dataset ID are read from the daemon when not given. The state
methods are the `sluice.trainer_hooks.FencedStateful` protocol, so a
CheckpointManager drives them (``fence(generation)`` before ``reset``, and
``commit`` after a publish); used alone, ``reset`` takes the generation after
the daemon's, fencing any older reader.

Flow control: at most `credits` micro-batches are asked for and not yet
returned by `next()` (a reply that came ahead still counts), asked for once
half are free (`_top_up`: one GET of several
positions where the daemon takes them, docs/protocol.md "Spans"); each
position has its own request ID; replies are matched to requests by it and must
carry the requested (step, micro): anything else (a gap, a repeat, a reply
nobody asked for) raises ProtocolError.

Tensors are built on the received ZeroMQ frames without a copy (one
`np.ndarray` per array at its offset in its frame: the client's GETs ask for
packed frames, docs/protocol.md; then `torch.from_numpy`; numpy arrays when
torch is absent or `as_numpy=True`). torch is imported lazily, on the first
batch. A BATCH as the daemon writes it is read in one typed pass, its data
state kept as JSON until asked for (replies.py); any other reply is decoded
in full and checked the same way.

No silent wait: a GET the daemon parked longer than its request TTL comes back
ERROR(EXPIRED) and the client asks again for exactly those (replies to the
superseded request IDs are dropped); after `timeout_s` of silence the client
probes the daemon (below) and, if the same instance answers, keeps waiting
(the daemon answers every GET it holds: a duplicate would be served twice). A
wait for one micro-batch that passes `timeout_s` is logged (a warning on the
"sluice.client" logger naming the step, micro, replica, endpoint, what the
daemon said and the bound), again each time it doubles. A
micro-batch that has not arrived `max_wait_s` after it became the next one
to yield raises DaemonTimeout naming the step, micro, replica and endpoint.

Who may ask: a daemon with a run token refuses requests without it
(UNAUTHORIZED); pass `token=` or set SLUICE_TOKEN in the environment.

Daemon restarts: if no reply arrives within `timeout_s`, the client probes the
endpoint with a HELLO on a fresh socket. The same daemon instance answering
means it is only slow (keep waiting); another instance means it restarted:
the client switches to a new socket, RESTOREs the state of its last completed
step and requests the current step again from micro 0 (dropping micro-batches
it already yielded), so the stream goes on exactly where it stopped.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from typing import Any

import zmq

from sluice.client.calls import DaemonCalls
from sluice.client.config import ClientConfig, StreamOptions, settings
from sluice.client.fencing import FencedState
from sluice.client.replies import Batch, held_state
from sluice.client.arena import ClientArena
from sluice.client.ring import ClientRing
from sluice.client.requests import GetFrames
from sluice.errors import (
    DaemonError,
    DaemonTimeout,
    DaemonUnavailable,
    FencedError,
    ProtocolError,
)
from sluice.wire import decoding, errorcodes, protocol, runtoken

log = logging.getLogger("sluice.client")

__all__ = ["Client", "DaemonError", "DaemonTimeout", "DaemonUnavailable"]

_ABANDONED = 4096  # request IDs superseded by a re-send whose late replies are dropped


class Client(DaemonCalls, FencedState):
    """Iterator over one replica's micro-batches; a torch Stateful.

    Takes a `ClientConfig` (endpoint, replica r of R, run and dataset IDs, run
    token or CurveZMQ keys, `Timeouts`) and `stream`, a `StreamOptions`
    (credits, peers, samples, observe, start and end step, numpy or tensors):
    sluice/client/config.py says what each field does. The same fields by
    keyword after an endpoint work as they always did:
    ``Client(endpoint, replica, replicas, run_id=..., timeout_s=..., as_numpy=True)``.
    """

    def __init__(self, config: ClientConfig | str | None = None, replica: int | None = None,
                 replicas: int | None = None, *, stream: StreamOptions | None = None, **keywords: Any) -> None:
        config, stream = settings(config, replica, replicas, stream, keywords)
        token = config.token if config.token is not None else os.environ.get(runtoken.TOKEN_ENV) or None
        self._token = runtoken.check_token(token, "client token") if token is not None else None
        self.config, self.stream_options = config, stream  # as given (run_id, dataset_id: filled at HELLO)
        self.endpoint, self.replica, self.replicas = config.endpoint, config.replica, config.replicas
        self.run_id, self.dataset_id, self.curve = config.run_id, config.dataset_id, config.curve
        t = config.timeouts
        self.timeout_s, self.reconnect_s, self.connect_s, self.max_wait_s = (t.timeout_s, t.reconnect_s, t.connect_s,
                                                                              t.max_wait_s)
        self.credits, self.peers, self.samples = stream.credits, stream.peers, stream.samples
        self.observe, self.as_numpy, self.ring = stream.observe, stream.as_numpy, stream.ring
        self.limits = protocol.Limits.for_client()
        self.generation = 0
        self.instance: str | None = None
        self.info: dict[str, Any] = {}
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._inflight: deque[tuple[int, int, int]] = deque()  # (request_id, step, micro) in send order
        self._stash: dict[int, protocol.Message] = {}
        self._abandoned: OrderedDict[int, None] = OrderedDict()  # superseded request IDs (bounded)
        self.resent = 0
        self.restore_retries = 0
        self._last: int | None = None  # the last completed step (its state: `_history[_last]`)
        self._history: OrderedDict[int, dict[str, Any] | bytes] = OrderedDict()
        self._start_step = stream.start_step
        self.end_step = stream.end_step
        self._cursor: tuple[int, int] | None = None  # next (step, micro) to yield
        self._send_cursor: tuple[int, int] | None = None  # next (step, micro) to request
        self._skip_before: tuple[int, int] | None = None
        self._need_restore = False
        self._start_over = False  # RESTORE to the state before step 0 (reset())
        self._fenced = False  # a fence(generation) awaits the next reset
        self._bump = False  # the next RESTORE takes the generation after the daemon's
        self._ended = False
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.batches = 0
        self.reconnects = 0
        self._newer_instance: str | None = None  # another daemon instance answered the last request (_await)
        self._gets: GetFrames | None = None  # GET frames for the current connection and generation
        self._ring: ClientRing | None = None  # the daemon's ring for this connection (client/ring.py)
        self._arena: ClientArena | None = None  # the daemon's arena, where it offers one (client/arena.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> Client:
        """A client configured from environment variables, as torchrun's ranks are (`sluice.client.env`).

        Endpoint from $SLUICE_ENDPOINT (or $SLUICE_ENDPOINT_FILE), replica r of
        R from $RANK and $WORLD_SIZE (or $SLUICE_REPLICA, $SLUICE_REPLICAS; 0 of
        1 without either), $SLUICE_PEERS, the token from $SLUICE_TOKEN or
        $SLUICE_TOKEN_FILE, CurveZMQ keys from $SLUICE_CURVE_SECRET and
        $SLUICE_CURVE_SERVER; $SLUICE_NODE_FILE names a per-node file of the
        endpoint, token and key settings (`sluice.client.nodefile`). `kwargs` are `Client`'s and win over the
        environment. SpecError naming the variable on a missing or bad value.
        """
        from sluice.client.env import client_args

        args = {**client_args(env), **kwargs}
        return cls(args.pop("endpoint"), args.pop("replica"), args.pop("replicas"), **args)

    def _send_get(self, step: int, micro: int, count: int = 1) -> int:
        """Send the GET for `count` positions from (step, micro) on under `count` new request IDs (consecutive);
        return the first.

        The bytes are `self._header(GET, ...)`'s (`GetFrames`), with the
        constant fields encoded once per connection and generation.
        """
        assert self._sock is not None
        ring, arena = self._ring is not None, self._arena is not None
        key = (self.run_id, self.dataset_id, self.generation, self.replica, self.instance or "", self._token,
               self.samples, self.observe, ring, ring, arena)
        gets = self._gets
        if gets is None or gets.key != key:  # (ring replies may come joined: `_await` splits them)
            gets = self._gets = GetFrames(run_id=self.run_id, dataset_id=self.dataset_id, generation=self.generation,
                                          replica=self.replica, instance=self.instance or "", token=self._token,
                                          samples=self.samples, observe=self.observe, ring=ring, joined=ring,
                                          arena=arena)
        rid = next(self._ids)
        for _ in range(count - 1):
            next(self._ids)
        # One small frame: `send` (copied) does what `send_multipart([frame], copy=False)` does, in 0.7 us of
        # the client's thread against 1.9 (the latter checks and wraps every part).
        (frame,) = gets.frames(step=step, micro=micro, request_id=rid, input_wait_s=round(self.last_wait_s, 6),
                               release=(self._ring.release_field() if ring else b"") +
                               (self._arena.release_field() if arena else b""), count=count)
        self._sock.send(frame)
        return rid

    # -- iteration -----------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def _top_up(self) -> None:
        """Fill the credits with GETs once half of them are free (or none is in flight).

        The free credits go in one GET of that many positions where the daemon
        takes spans (HELLO_OK ``max_count``; docs/protocol.md, "Spans"), else
        in that many GETs sent together: either way libzmq's IO thread wakes
        once, not once per position, and the daemon reads one request for the
        lot. Half the credits stay in flight, so the daemon always holds requests.

        With a ring (its replies may come joined), a call whose reply is not
        here yet leaves the GET to a later call while its free credits are just
        half: that call receives a joined message and reads its replies
        (docs/protocol.md, "Joined replies"), and the send (a wake-up of
        libzmq's IO thread) on top of it was the tail of the wait at a
        trainer's pace (docs/performance.md, "Known limits").
        """
        assert self._sock is not None and self._send_cursor is not None
        half = (self.credits + 1) // 2
        if self._inflight and self.credits - len(self._inflight) < half:
            return
        if self._ring is not None and len(self._inflight) > half - 1 and self._inflight[0][0] not in self._stash:
            return  # (the next call takes its reply from the stash, and sends then)
        mps = int(self.info["micro_per_step"])
        most = self.info.get("max_count", 1)
        most = most if type(most) is int and most >= 1 else 1  # (a daemon before spans: one position a GET)
        step, micro = self._send_cursor
        while len(self._inflight) < self.credits:
            if self.end_step is not None and step >= self.end_step:
                break
            count = min(self.credits - len(self._inflight), most)
            if self.end_step is not None:
                count = min(count, (self.end_step - step) * mps - micro)
            rid = self._send_get(step, micro, count)
            for i in range(count):
                self._inflight.append((rid + i, step, micro))
                step, micro = (step, micro + 1) if micro + 1 < mps else (step + 1, 0)
        self._send_cursor = (step, micro)

    def __next__(self) -> dict[str, Any]:
        if self._ended:
            raise StopIteration
        if self._sock is None or self._need_restore:
            self.connect()
        t0 = time.perf_counter()
        waiting_since = time.monotonic()
        warn_after = self.timeout_s  # (a long wait is said, at timeout_s and each time it doubles)
        while True:
            self._top_up()
            if not self._inflight:  # end_step reached
                self._ended = True
                raise StopIteration
            rid, step, micro = self._inflight[0]
            left = waiting_since + self.max_wait_s - time.monotonic()
            reply = self._await(rid, max(0.0, min(self.timeout_s, left)))
            if reply is None or _expired(reply):
                if time.monotonic() - waiting_since >= self.max_wait_s:
                    raise DaemonTimeout(endpoint=self.endpoint, replica=self.replica, step=step, micro=micro,
                                        waited_s=time.monotonic() - waiting_since)
                probe = None
                if reply is None:
                    probe = self._recover()
                else:
                    self._resend_expired(head_expired=True)
                waited = time.monotonic() - waiting_since
                if waited >= warn_after:
                    self._say_waiting(step, micro, waited, reply is not None, probe)
                    warn_after = 2 * waited
                continue
            self._inflight.popleft()
            if type(reply) is not Batch:  # any message but a BATCH as the daemon writes it (replies.py)
                if reply.kind == protocol.ERROR:
                    code = reply.body.get("code")
                    if code == errorcodes.E_END:
                        self._ended = True
                        raise StopIteration
                    if code == errorcodes.E_SHUTTING_DOWN:
                        self._recover(force=True)
                        continue
                    errorcodes.raise_for(reply)
                reply = Batch.of(reply, self.info["micro_per_step"])
            if reply.generation > self.generation:
                raise FencedError(f"loaderd is at generation {reply.generation}, this client at {self.generation}: "
                                  "another trainer restored this run")
            if (reply.kind != protocol.BATCH or reply.step != step or reply.micro != micro
                    or (step, micro) != self._cursor):
                raise ProtocolError(f"loaderd answered {reply.kind} for step {reply.step} micro {reply.micro}; "
                                    f"expected step {step} micro {micro} (next to yield: {self._cursor}): a gap or a "
                                    "repeat")
            mps = reply.micro_per_step
            if type(mps) is not int or mps < 1:  # a stranger's reply: our error, not int()'s
                raise ProtocolError(f"loaderd at {self.endpoint}: BATCH step {step} micro {micro}: body field "
                                    f"micro_per_step must be an integer >= 1, got {mps!r:.80}")
            self._cursor = (step, micro + 1) if micro + 1 < mps else (step + 1, 0)
            if micro + 1 == mps:
                state = reply.state
                if type(state) is bytes:  # JSON as the BATCH carried it: decoded only if the trainer asks
                    state = held_state(state, step)
                if type(state) is not bytes and (not isinstance(state, dict) or state.get("step") != step):
                    raise ProtocolError(f"loaderd: last micro-batch of step {step} lacks the data state after it")
                self._hold(step, state)
            if self._skip_before is not None:
                if (step, micro) < self._skip_before:
                    waiting_since = time.monotonic()
                    continue  # already yielded before the daemon restarted
                self._skip_before = None
            wait = time.perf_counter() - t0
            self.last_wait_s = wait
            self.total_wait_s += wait
            self.batches += 1
            out: dict[str, Any] = dict(reply.arrays) if self.as_numpy else decoding.to_tensors(reply.arrays)
            out["step"] = step
            out["micro"] = micro
            if self.samples:
                out["samples"] = list(reply.samples)
            return out

    def _say_waiting(self, step: int, micro: int, waited: float, expired: bool, probe: Any) -> None:
        """Log that the wait for (step, micro) has lasted `waited` s, with what the daemon said: EXPIRED (asked
        again), or its answer to the silence probe (`probe`, its HELLO_OK body: the replica's next step to make;
        None: another instance answered, or none)."""
        if expired:
            said = "it answered EXPIRED (the GET outlived its request TTL) and was asked again"
        elif probe is None:  # (`_recover` found another instance, or none: this client reconnected)
            said = "another daemon instance answers at that endpoint: this client reconnected and restores"
        else:
            nxt = probe.get("next_step")
            said = "it answers a probe" + (f"; its producer's next step is {nxt}" if type(nxt) is int else "")
        log.warning(f"sluice: waited {waited:.1f} s for step {step} micro {micro} of replica {self.replica} from "
                    f"loaderd at {self.endpoint}: {said}; still waiting (DaemonTimeout after max_wait_s = "
                    f"{self.max_wait_s:g} s)")

    def _resend_expired(self, head_expired: bool) -> None:
        """Ask again, under new request IDs, for exactly the GETs the daemon said it dropped (EXPIRED).

        The head of the queue when its own reply was EXPIRED (`head_expired`),
        and any other outstanding GET whose stashed reply is EXPIRED. A GET the
        daemon still holds is never sent twice: a live daemon answers every GET
        it parks, with the batch or with EXPIRED, so a duplicate would only be
        served twice, and the step released by the first answer would make
        the second one OUT_OF_RANGE. The old IDs go to a bounded set whose late
        replies `_await` drops.
        """
        assert self._sock is not None
        fresh: deque[tuple[int, int, int]] = deque()
        for k, (rid, step, micro) in enumerate(self._inflight):
            kept = self._stash.get(rid)
            dropped = (k == 0 and head_expired) or (kept is not None and _expired(kept))
            if not dropped:
                fresh.append((rid, step, micro))
                continue
            self._stash.pop(rid, None)
            self._abandoned[rid] = None
            while len(self._abandoned) > _ABANDONED:
                self._abandoned.popitem(last=False)
            fresh.append((self._send_get(step, micro), step, micro))
            self.resent += 1
        self._inflight = fresh

def _expired(reply: protocol.Message) -> bool:
    """The daemon dropped this parked GET after its request TTL: ask again."""
    return reply.kind == protocol.ERROR and reply.body.get("code") == errorcodes.E_EXPIRED
