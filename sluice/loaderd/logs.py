"""Structured (one JSON object per line) logs for the daemon.

Every record carries ``ts``, ``level``, ``msg`` and, when known, ``run_id``,
``dataset_id``, ``generation``, ``replica`` and ``step`` (passed via
``extra=`` or bound by `ContextFilter`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = ("run_id", "dataset_id", "generation", "replica", "step", "micro", "code", "peer", "error",
           "seconds", "endpoint", "metrics_port", "pid", "running", "runspec_digest", "replicas", "tokens_per_step")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


class ContextFilter(logging.Filter):
    """Adds the daemon's run ID, dataset ID and current generation to every record."""

    def __init__(self, run_id: str, dataset_id: str, generation: Any) -> None:
        super().__init__()
        self.run_id = run_id
        self.dataset_id = dataset_id
        self.generation = generation  # a callable returning the current generation

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id = getattr(record, "run_id", None) or self.run_id
        record.dataset_id = getattr(record, "dataset_id", None) or self.dataset_id
        if getattr(record, "generation", None) is None:
            record.generation = self.generation()
        return True


def setup(level: str, run_id: str, dataset_id: str, generation: Any) -> logging.Handler:
    """Send the `sluice.loaderd` logger to stderr as JSON lines; returns the handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter(run_id, dataset_id, generation))
    logger = logging.getLogger("sluice.loaderd")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return handler
