"""GET requests with the fields that are constant per connection encoded once.

The client sends one GET per micro-batch; building a `protocol.Header` and
JSON-encoding it each time was about a quarter of the client's CPU per
micro-batch from cached tokens (docs/performance.md). `GetFrames` writes the
very bytes ``encoding.encode(Header(kind=GET, ...))`` writes (tested byte for
byte), formatting only step, micro, request_id and the input wait per request,
with the writer the daemon's `encoding.BatchHeaders` uses (`encoding.HeaderWriter`).
"""

from __future__ import annotations

from sluice.wire import encoding, protocol

__all__ = ["GetFrames"]


class GetFrames:
    """GET frames of one (run, dataset, generation, replica, instance, token, samples, observe).

    `key` names those fields; the client builds a new one when any of them
    changes (a reconnect, a RESTORE's generation).
    """

    def __init__(self, *, run_id: str | None, dataset_id: str | None, generation: int, replica: int, instance: str,
                 token: str | None, samples: bool, observe: bool, packed: bool = True, ring: bool = False,
                 joined: bool = False, arena: bool = False) -> None:
        self.key = (run_id, dataset_id, generation, replica, instance, token, samples, observe, ring, joined, arena)
        j = encoding.json_bytes
        # packed: this client takes a BATCH whose arrays share frames (`decoding.decode`; docs/protocol.md);
        # ring: its arrays in the slot of the ring this connection holds (client/ring.py); joined: several ring
        # replies may come in one message (client/ring.py's `resolve`); arena: its arrays where the daemon's producer
        # wrote them (client/arena.py)
        # (keys sorted as `encoding` writes them: a GET's "release" and "release_arena" go between "packed" and
        # "ring", "arena" first)
        self._arena = b'"arena":true,' if arena else b""
        self._body_mid = b"".join((b',"joined":true' if joined else b"", b',"observe":', j(observe),
                                   b',"packed":true' if packed else b""))
        self._body_tail = b"".join((b',"ring":true' if ring else b"", b',"samples":', j(samples),
                                    b',"token":' + j(token) if token is not None else b"", b"}"))
        self._header = encoding.HeaderWriter(kind=protocol.GET, run_id=run_id, dataset_id=dataset_id,
                                             generation=generation, replica=replica, instance=instance)

    def frames(self, *, step: int, micro: int, request_id: int, input_wait_s: float, release: bytes = b"",
               count: int = 1) -> list[bytes]:
        """The frames of one GET; `input_wait_s` must be finite (a measured wait), as JSON writes it; `release`
        the body's ``release`` and ``release_arena`` members as `ClientRing.release_field` and
        `ClientArena.release_field` write them, in that order (b"": none); `count` > 1: the
        positions it asks for (docs/protocol.md, "Spans"; 1: none written)."""
        head = b'{%b"input_wait_s":' % self._arena if count == 1 else \
            b'{%b"count":%d,"input_wait_s":' % (self._arena, count)
        body = b"".join((head, repr(float(input_wait_s)).encode(), self._body_mid, release, self._body_tail))
        return [self._header.frame(arrays=b"[]", body=body, step=step, micro=micro, request_id=request_id)]
