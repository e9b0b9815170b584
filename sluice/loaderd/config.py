"""`ServerConfig`: everything one loaderd needs, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import SpecError
from sluice.loaderd.endpoint import check_endpoint
from sluice.loaderd.options import data_path_values, declared_fields
from sluice.wire import protocol, runtoken


@dataclass(frozen=True, kw_only=True)
@declared_fields("server")
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

    # The field each command-line option fills (cache_dir, queue_bytes, ...) is declared with its option in
    # options.py (`declared_fields`); docs/loaderd.md, "Options", lists them with their flags and defaults.
    manifest: Any
    spec: Any
    serve: tuple[int, ...] = (0,)
    max_pending: int = 4096
    pending_window_steps: int = 256
    switch_interval_s: float = 0.0002
    limits: protocol.Limits = field(default_factory=protocol.Limits)
    curve: Any = None  # sluice.curve.CurveServerKeys: encrypt and authenticate every connection
    token: str | None = field(default=None, repr=False)  # never printed
    # sluice.cache.roots.AllowedRoots: checked at start (cli.py) and again at every cache miss, since a
    # link inside a root may be re-pointed out of it while the daemon runs; None: no check
    allowed_roots: Any = None

    def data_path(self) -> Any:
        """The DataPathConfig of the daemon's data path."""
        from sluice.loaderd.physical.assemble import DataPathConfig

        return DataPathConfig(**data_path_values(self), window_steps=self.lead_steps, allowed_roots=self.allowed_roots)

    def __post_init__(self) -> None:
        self.spec.check_replicas(self.replicas)
        bad = [r for r in self.serve if not 0 <= r < self.replicas]
        if not self.serve or bad or len(set(self.serve)) != len(self.serve):
            raise SpecError(f"loaderd: --serve {list(self.serve)} must be distinct replicas in [0, {self.replicas})")
        if self.token is not None:
            runtoken.check_token(self.token, "loaderd: token")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, curve=self.curve is not None, token=self.token is not None)
        for name in ("workers", "lead_steps", "queue_bytes", "decoded_bytes", "max_pending"):
            if getattr(self, name) < 1:
                raise SpecError(f"loaderd: {name} must be >= 1, got {getattr(self, name)}")
        if self.memory_limit not in ("auto", "off") and not (
                isinstance(self.memory_limit, int) and self.memory_limit > 0):
            raise SpecError(f"loaderd: memory limit must be 'auto', 'off' or a positive byte count, got "
                            f"{self.memory_limit!r}")
        if self.gil_cpu not in ("auto", "off") and not (type(self.gil_cpu) is int and self.gil_cpu >= 0):
            raise SpecError(f"loaderd: gil_cpu must be 'auto', 'off' or a CPU number, got {self.gil_cpu!r}")
        if not (math.isfinite(self.request_ttl_s) and 0 < self.request_ttl_s <= 86400):
            raise SpecError(f"loaderd: request TTL must be in (0, 86400] seconds, got {self.request_ttl_s}")
