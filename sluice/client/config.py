"""What a `Client` is given: where it connects and as whom (`ClientConfig`), how long it waits
(`Timeouts`), and what it asks for and yields (`StreamOptions`). Frozen; checked when made.

    from sluice.client import Client, ClientConfig, StreamOptions, Timeouts

    config = ClientConfig(endpoint="ipc:///run/sluice/loaderd.sock", replica=rank, replicas=world,
                          timeouts=Timeouts(max_wait_s=300))
    client = Client(config, stream=StreamOptions(as_numpy=True))

    client = Client("ipc:///run/sluice/loaderd.sock", rank, world, max_wait_s=300, as_numpy=True)  # the same

The keyword form is the one every release so far took: `settings` sorts its
keywords into the three objects, and refuses a keyword none of them has, as
Python refuses an unknown argument (TypeError naming it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sluice.wire import runtoken

__all__ = ["ClientConfig", "StreamOptions", "Timeouts", "settings"]


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long a client waits, in seconds.

    `timeout_s`: silence before it probes the daemon; `reconnect_s`: how long it
    looks for a restarted daemon; `connect_s`: after this long, a first
    connection with nothing listening at the endpoint fails, naming it (a daemon
    that is there but slow is waited for); `max_wait_s` (> 0): the longest wait
    for one micro-batch from a live daemon before DaemonTimeout.
    """

    timeout_s: float = 10.0
    reconnect_s: float = 60.0
    connect_s: float = 5.0
    max_wait_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where a client connects and as whom.

    `endpoint` (ipc:// or tcp://); `replica` r of `replicas` R; `run_id` and
    `dataset_id` (checked by the daemon; None: read from the daemon at the first
    connect); `token` (the run token; None: $SLUICE_TOKEN, read when the Client
    is made; never printed); `curve` (a `sluice.curve.CurveClientKeys` for a
    daemon started with CurveZMQ keys); `timeouts`.
    """

    endpoint: str
    replica: int = 0
    replicas: int = 1
    run_id: str | None = None
    dataset_id: str | None = None
    token: str | None = field(default=None, repr=False)
    curve: Any = None
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if self.token is not None:
            runtoken.check_token(self.token, "client token")


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """What a client asks for and yields.

    `credits` (>= 1): micro-batches asked for and not yet returned by `next()` (a reply
    that came ahead still counts; docs/protocol.md, "Flow control"); `peers`: ranks sharing this replica
    (e.g. tensor-parallel peers: the daemon keeps each step until that many
    distinct clients got it); `samples`: ask for sample IDs per micro-batch;
    `observe`: read without consuming (the daemon does not count this client's
    deliveries when it releases steps; for tools such as `sluice peek
    --observe`); `start_step`: first step when no state is loaded (default: the
    daemon's oldest held step); `end_step`: stop before this step, never
    requesting it; `as_numpy`: yield numpy arrays instead of tensors; `ring`:
    on an ipc:// endpoint, take the arrays through the shared memory the daemon
    offers (docs/protocol.md, "Ring"), else through the socket.
    """

    credits: int = 16
    peers: int = 1
    samples: bool = False
    observe: bool = False
    start_step: int | None = None
    end_step: int | None = None
    as_numpy: bool = False
    ring: bool = True

    def __post_init__(self) -> None:
        if self.credits < 1:
            raise ValueError(f"credits must be >= 1, got {self.credits}")


_CONFIG = {f.name for f in dataclasses.fields(ClientConfig)} - {"endpoint", "replica", "replicas", "timeouts"}
_TIMEOUTS = {f.name for f in dataclasses.fields(Timeouts)}
_STREAM = {f.name for f in dataclasses.fields(StreamOptions)}


def settings(config: ClientConfig | str | None, replica: int | None, replicas: int | None,
             stream: StreamOptions | None, keywords: dict[str, Any]) -> tuple[ClientConfig, StreamOptions]:
    """`Client`'s arguments as (ClientConfig, StreamOptions).

    Either a `ClientConfig` (and `stream`, or StreamOptions fields by keyword), or an endpoint (positional, or
    the keyword ``endpoint``) with `replica`, `replicas` and any field of the three objects by keyword.
    TypeError names what does not fit.
    """
    if "endpoint" in keywords:
        if config is not None:
            raise TypeError("Client() got multiple values for argument 'endpoint'")
        keywords = dict(keywords)
        config = keywords.pop("endpoint")
    unknown = sorted(set(keywords) - _CONFIG - _TIMEOUTS - _STREAM)
    if unknown:
        raise TypeError(f"Client() got an unexpected keyword argument {unknown[0]!r}")
    streamed = {k: v for k, v in keywords.items() if k in _STREAM}
    if stream is not None and streamed:
        raise TypeError(f"Client(): give stream= or {sorted(streamed)[0]}=, not both")
    stream = stream if stream is not None else StreamOptions(**streamed)
    if isinstance(config, ClientConfig):
        rest = sorted(set(keywords) - _STREAM)
        if replica is not None or replicas is not None or rest:
            named = rest[0] if rest else "replica" if replica is not None else "replicas"
            raise TypeError(f"Client(): {named} is the ClientConfig's; give it there, not beside it")
        return config, stream
    if not isinstance(config, str):
        raise TypeError(f"Client(): expected a ClientConfig or an endpoint string, got {type(config).__name__}")
    return ClientConfig(endpoint=config, replica=0 if replica is None else replica,
                        replicas=1 if replicas is None else replicas,
                        timeouts=Timeouts(**{k: v for k, v in keywords.items() if k in _TIMEOUTS}),
                        **{k: v for k, v in keywords.items() if k in _CONFIG}), stream
