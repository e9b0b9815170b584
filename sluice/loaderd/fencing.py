"""The daemon's durable fencing record: generation and committed cursor, in LMDB.

One LMDB environment (``<state_dir>/fence.lmdb``) per daemon state directory.
Keys are scoped by run ID and dataset ID, so one state directory can hold
several runs without mixing them::

    gen/<run_id>/<dataset_id>                -> b"<generation as decimal>"
    commit/<run_id>/<dataset_id>/<replica>   -> canonical JSON {"step", "generation",
                                                "replica", "state", "unix_time"}

Rules (DESIGN.md section 6):

* `generation` only grows. `advance(g)` with g older than the current one raises
  FencedError; g equal is accepted (every rank of a restoring job sends the same
  new generation); g newer is written durably (LMDB commit with sync) before the
  caller acts on it, so a restarted daemon never accepts an older generation.
* `commit(...)` is fenced the same way and records the step and the lane states
  after it; a commit for an older step than the recorded one under the same
  generation is ignored (commits may race), a newer generation always wins.

Nothing here is pickled: values are JSON and decimal text.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sluice.errors import FencedError, StateError

_MAP_SIZE = 64 << 20  # generations and cursors are tiny; 64 MiB is room for thousands of runs


class FenceStore:
    """Durable generation + committed cursor of one (run, dataset) pair."""

    def __init__(self, state_dir: str | os.PathLike[str], run_id: str, dataset_id: str) -> None:
        import lmdb  # imported here: the client must never need lmdb

        from sluice.fsutil import reserve_lmdb_lock

        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            reserve_lmdb_lock(path / "fence.lmdb", 126)  # LMDB's default reader slots; a full disk: no SIGBUS
        except OSError as exc:
            raise StateError(f"loaderd state {path / 'fence.lmdb'}: cannot make its lock file ({exc.strerror}); "
                             "free space on its disk or pass another --state-dir") from exc
        self._env = lmdb.open(str(path / "fence.lmdb"), map_size=_MAP_SIZE, subdir=True, sync=True,
                              metasync=True, max_dbs=0, lock=True)
        self._scope = f"{run_id}/{dataset_id}"

    def close(self) -> None:
        self._env.close()

    @property
    def _gen_key(self) -> bytes:
        return f"gen/{self._scope}".encode()

    def _commit_key(self, replica: int) -> bytes:
        return f"commit/{self._scope}/{replica}".encode()

    def generation(self) -> int:
        with self._env.begin() as txn:
            raw = txn.get(self._gen_key)
        return int(raw.decode("ascii")) if raw else 0

    def advance(self, generation: int) -> int:
        """Accept `generation` if it is not older than the stored one; store it durably."""
        with self._env.begin(write=True) as txn:
            raw = txn.get(self._gen_key)
            current = int(raw.decode("ascii")) if raw else 0
            if generation < current:
                raise FencedError(f"generation {generation} is older than the daemon's generation {current}")
            if generation > current:
                txn.put(self._gen_key, str(generation).encode("ascii"))
        return generation

    def commit(self, replica: int, step: int, generation: int, state: dict[str, Any]) -> dict[str, Any]:
        """Record that `replica` durably checkpointed `step` under `generation`; returns the record kept."""
        record = {"step": step, "generation": generation, "replica": replica, "state": state,
                  "unix_time": int(time.time())}
        with self._env.begin(write=True) as txn:
            raw = txn.get(self._gen_key)
            current = int(raw.decode("ascii")) if raw else 0
            if generation < current:
                raise FencedError(
                    f"commit of step {step} carries generation {generation}, older than the daemon's {current}"
                )
            if generation > current:
                txn.put(self._gen_key, str(generation).encode("ascii"))
            old_raw = txn.get(self._commit_key(replica))
            if old_raw:
                old = json.loads(old_raw)
                if old["generation"] == generation and old["step"] >= step:
                    return old  # a late commit of an older step under the same generation
            txn.put(self._commit_key(replica), json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
        return record

    def committed(self, replica: int) -> dict[str, Any] | None:
        with self._env.begin() as txn:
            raw = txn.get(self._commit_key(replica))
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StateError(f"fence store: commit record of replica {replica} is not JSON ({exc})") from exc
