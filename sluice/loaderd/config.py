"""`ServerConfig`: everything one loaderd needs, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sluice import wire
from sluice.errors import SpecError
from sluice.loaderd.endpoint import check_endpoint


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything a daemon needs; `loaderd --help` documents each field's flag.

    Bounds: `queue_bytes` per replica (assembled micro-batches), `lead_steps`
    (steps produced ahead of the oldest unreleased one), `decoded_bytes`
    (decoded/tokenized objects shared by all replicas), `max_pending` GETs per
    replica, `request_ttl_s` after which a parked GET is answered
    ERROR(EXPIRED) (a live client asks again; a vanished one's credit is
    released) and after twice which a silent client's HELLO `peers` claim
    lapses. `token`: the run's capability (every request must carry it); None
    only where the endpoint's permissions already keep strangers out.
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
    # False: the metrics' run_id and dataset_id labels say METRICS_HIDDEN, since every local user can read
    # the loopback metrics port (docs/observe.md); True: they carry the IDs
    metrics_ids: bool = False
    # Bound on the daemon's anonymous memory, held by resetting every connection when exceeded
    # (memguard.py): "auto" (the data path's declared bounds + memguard.HEADROOM over the memory at
    # start), a byte count, or "off". Off by default: a Server embedded in a trainer's process shares
    # that process's memory; the daemon's own process (cli.py) turns it on.
    memory_limit: int | str = "off"
    workers: int = 2
    worker_kind: str = "thread"  # or "process": decode+tokenize in worker processes
    demand_workers: int = 0  # processes tokenizing records out of order (0: threads in the daemon)
    # Encoder threads of the daemon (`--tokenizer-threads`; worker processes share them out). None: the
    # process's environment decides (a Server made inside another program leaves that program's setting).
    tokenizer_threads: int | None = None
    producer: str = "thread"  # or "process": each replica's producer (logical plane) in its own process
    manifest_path: str | None = None  # needed by producer="process" (the child loads the same files)
    runspec_path: str | None = None
    lead_steps: int = 8
    queue_bytes: int = 256 << 20
    decoded_bytes: int = 256 << 20
    scrub_rate: int = 32 << 20  # bytes/s of mapped cache objects verified again in the background (0: off)
    max_pending: int = 4096
    pending_window_steps: int = 256
    request_ttl_s: float = 60.0
    verify_on_read: bool = True
    jit: str = "auto"  # the fused path's compiled kernel (numba): "auto" (loaded after 2,048 steps) or "off"
    switch_interval_s: float = 0.0002
    limits: wire.Limits = field(default_factory=wire.Limits)
    curve: Any = None  # sluice.curve.CurveServerKeys: encrypt and authenticate every connection
    token: str | None = field(default=None, repr=False)  # never printed
    # sluice.cache.roots.AllowedRoots: checked at start (cli.py) and again at every cache miss, since a
    # link inside a root may be re-pointed out of it while the daemon runs; None: no check
    allowed_roots: Any = None

    def data_path(self) -> Any:
        """The DataPathConfig of the daemon's own data path (with producer processes the children
        decode and tokenize; then this one only serves stats)."""
        from sluice.loaderd.physical.assemble import DataPathConfig

        return DataPathConfig(
            cache_dir=self.cache_dir, cache_budget=self.cache_budget_bytes, verify_on_read=self.verify_on_read,
            decoded_bytes=self.decoded_bytes, workers=self.workers, window_steps=self.lead_steps,
            worker_kind=self.worker_kind if self.producer == "thread" else "thread", allowed_roots=self.allowed_roots,
            demand_workers=self.demand_workers if self.producer == "thread" else 0, jit=self.jit,
            scrub_rate=self.scrub_rate if self.producer == "thread" else 0,  # (else each producer process scrubs)
            tokenizer_threads=self.tokenizer_threads)

    def __post_init__(self) -> None:
        self.spec.check_replicas(self.replicas)
        bad = [r for r in self.serve if not 0 <= r < self.replicas]
        if not self.serve or bad or len(set(self.serve)) != len(self.serve):
            raise SpecError(f"loaderd: --serve {list(self.serve)} must be distinct replicas in [0, {self.replicas})")
        if self.token is not None:
            wire.check_token(self.token, "loaderd: token")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, curve=self.curve is not None, token=self.token is not None)
        if self.producer not in ("thread", "process"):
            raise SpecError(f"loaderd: producer {self.producer!r} is not 'thread' or 'process'")
        if self.producer == "process" and not (self.manifest_path and self.runspec_path):
            raise SpecError("loaderd: producer='process' needs manifest_path and runspec_path")
        for name in ("workers", "lead_steps", "queue_bytes", "decoded_bytes", "max_pending"):
            if getattr(self, name) < 1:
                raise SpecError(f"loaderd: {name} must be >= 1, got {getattr(self, name)}")
        if self.memory_limit not in ("auto", "off") and not (
                isinstance(self.memory_limit, int) and self.memory_limit > 0):
            raise SpecError(f"loaderd: memory limit must be 'auto', 'off' or a positive byte count, got "
                            f"{self.memory_limit!r}")
        if not (math.isfinite(self.request_ttl_s) and 0 < self.request_ttl_s <= 86400):
            raise SpecError(f"loaderd: request TTL must be in (0, 86400] seconds, got {self.request_ttl_s}")
