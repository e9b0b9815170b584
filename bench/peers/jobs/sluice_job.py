"""sluice: an embedded daemon (`sluice.client.embedded_client`) serving the
manifest; micro-batches of 8 x 2048 (global_batch = micro_batch = 8: one
micro-batch per step), read as torch tensors (the client's default), as every
loader of the bench delivers them.

`fast_path`: the daemon's STATS block after the measured stream (steps per
producer path, fall-backs per reason; None from a tree without it, `--base`).
The producer thread counts a step when it makes it, before it is served, so
one read after the stream covers every step consumed.

Variants (cfg["variant"]): "onfly" (raw jsonl.zst manifest, a fresh node cache:
fetch, decode, tokenize on the fly), "tokcache" (the same manifest, a node
cache warmed with `sluice cache warm --tokens`), "pretok" (the manifest of
`sluice tokenize pretokenize`, a warmed cache).

Restore, two figures from the data state after the step at 90% of the
measured stream, each to the first micro-batch:
* restore_running_s: a new client in this process attached to the daemon that
  kept running (`close(keep_daemon=True)`, `daemon.client()`), reset(state):
  a trainer restarted under a node daemon that outlives it (docs/deploy.md);
* restore_s: a new embedded daemon, reset(state) (the node cache is kept, as
  on a real node): a trainer that restarts its own daemon.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common import config, consume, emit, timed_first

cfg = config()
sys.path.insert(0, cfg["repo"])
from sluice.client import embedded_client  # noqa: E402


args = (cfg["manifest"], cfg["runspec"])
cache = Path(cfg["cache"])
# The client's silence timeout (default 10 s) before it probes the daemon and re-sends its GETs: a cold
# first batch slower than that met OUT_OF_RANGE (bench/results/peers-log.md, "A bug found on the way",
# fixed since), so the bench can raise it.
kwargs = {"timeout_s": cfg["client_timeout_s"]} if cfg.get("client_timeout_s") else {}
client = embedded_client(*args, cache_dir=cache, daemon_args=tuple(cfg.get("daemon_args", ())), **kwargs)
daemon = client.daemon
# A tree from before `daemon.client()` (a --base run) has no running-daemon restore.
attach = getattr(daemon, "client", None)
try:
    at = int(cfg["batches"] * 0.9)
    result = consume(client, cfg["batches"], at=at, on_at=lambda i: client.state_dict_at(i - 1))
    result["fast_path"] = client.stats().get("fast_path")
except BaseException:
    client.close()
    raise
if attach is not None:
    client.close(keep_daemon=True)
else:
    client.close()
state = result["saved"]
box = []


def attached():
    fresh = attach(**kwargs)
    box.append(fresh)
    fresh.reset(state)
    return fresh


if attach is not None:
    try:
        result["restore_running_s"] = timed_first(attached)
    finally:
        for c in box:
            c.close()
        daemon.close()
        box.clear()


def restored():
    fresh = embedded_client(*args, cache_dir=cache, daemon_args=tuple(cfg.get("daemon_args", ())), **kwargs)
    box.append(fresh)
    fresh.reset(state)
    return fresh


try:
    result["restore_s"] = timed_first(restored)
    result["restore_note"] = "new daemon + RESTORE"
finally:
    for c in box:
        c.close()
emit(result)
