"""A real ZeroMQ relay between clients and a loaderd that loses one message on purpose.

`FaultProxy(backend)` binds an ipc ROUTER; each client socket that connects to
it gets its own DEALER to `backend` (so the daemon still sees one identity per
client socket, and zmq reconnects those DEALERs to a restarted daemon at the
same endpoint, as it would the client's own socket). Everything is relayed
byte for byte, except what a rule says:

* ``hold(kind)``: the next request of that kind is kept (never sent); `held` is set;
* ``drop_reply(kind)``: the next request of that kind is sent, its reply
  dropped; `dropped` is set once the daemon has answered it.

So a test can kill the daemon at an exact point of a RESTORE: before the daemon
read it, or after it acted on it but before the client heard back.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import zmq

from sluice.wire import decoding, protocol


class FaultProxy:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix='sl-proxy-')}/p.sock"
        self.held = threading.Event()
        self.dropped = threading.Event()
        self._hold: str | None = None
        self._drop: str | None = None
        self._drop_ids: set[tuple[bytes, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._ready.wait(10), "fault proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def hold(self, kind: str) -> None:
        with self._lock:
            self._hold = kind
            self.held.clear()

    def drop_reply(self, kind: str) -> None:
        with self._lock:
            self._drop = kind
            self.dropped.clear()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        front = ctx.socket(zmq.ROUTER)
        front.linger = 0
        front.bind(self.endpoint)
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        self._ready.set()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    frames = sock.recv_multipart()
                    if sock is front:
                        ident, rest = frames[0], frames[1:]
                        header = decoding.decode(rest, protocol.Limits()).header
                        with self._lock:
                            if self._hold == header.kind:
                                self._hold = None
                                self.held.set()
                                continue
                            if self._drop == header.kind:
                                self._drop = None
                                self._drop_ids.add((ident, header.request_id))
                        back = backs.get(ident)
                        if back is None:
                            back = backs[ident] = ctx.socket(zmq.DEALER)
                            back.linger = 0
                            back.connect(self.backend)
                            owner[back] = ident
                            poller.register(back, zmq.POLLIN)
                        back.send_multipart(rest)
                    else:
                        ident = owner[sock]
                        # (the header alone: a BATCH in a client's ring carries a reference, not its arrays)
                        rid = decoding.json_value(frames[0])["request_id"]
                        with self._lock:
                            if (ident, rid) in self._drop_ids:
                                self._drop_ids.discard((ident, rid))
                                self.dropped.set()
                                continue
                        front.send_multipart([ident, *frames])
        finally:
            for back in backs.values():
                back.close(0)
            front.close(0)
