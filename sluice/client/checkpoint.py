"""`CheckpointedData`: the client as the checkpoint's data Stateful.

A checkpoint stores the *data state* itself (``sluice.data-state``: dataset
ID, run-spec digest, step and the lanes this rank served), not the client's
connection details, so the checkpoint manager can check its identity on
restore and merge the ranks' lanes after a resize. This adapter gives the
manager exactly that, and wires the manager's generation into the client:

    data = CheckpointedData(client)
    mgr = CheckpointManager(dir, {"model": model, "optim": opt, "data": data},
                            on_commit=data.on_commit, on_restore=data.on_restore)
    report = mgr.restore(expected_dataset_id=..., expected_runspec_digest=...)
    data.begin(report.generation, fresh=report.step is None)  # fences older trainers

Order on restore (the manager's): `on_restore(G)` then `load_state_dict(state)`,
which sends RESTORE(G, lanes) to the daemon; the daemon keeps the lanes this
replica serves. `on_commit(step, G)` sends COMMIT after the checkpoint is
durable; a daemon that is restarting at that moment cannot record it, which is
logged and not an error (the checkpoint is the source of truth, and the next
COMMIT records a later step).
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.client.iterator import CLIENT_STATE_KIND, CLIENT_STATE_SCHEMA, Client, DaemonUnavailable
from sluice.errors import StateError

log = logging.getLogger("sluice.client")


class CheckpointedData:
    """torch Stateful over a `Client` whose state is the bare data state."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.generation: int | None = None

    def state_dict(self) -> dict[str, Any]:
        data = self.client.state_dict()["data"]
        if data is None:
            raise StateError("checkpoint before the first step completed: the client holds no data state yet")
        return data

    def load_state_dict(self, state: dict[str, Any]) -> None:
        c = self.client
        wrapped = {"kind": CLIENT_STATE_KIND, "schema": CLIENT_STATE_SCHEMA, "run_id": c.run_id,
                   "dataset_id": c.dataset_id, "step": state.get("step"), "data": state}
        c.load_state_dict(wrapped, generation=self.generation)

    def on_restore(self, generation: int) -> None:
        self.generation = generation

    def begin(self, generation: int, *, fresh: bool = False) -> None:
        """Adopt the manager's generation after `restore()`.

        `fresh=True` (no checkpoint was restored) also starts the stream over at
        step 0, even if the daemon already served step 0 to a trainer that died
        before its first checkpoint.
        """
        self.generation = generation
        if fresh:
            self.client.start_over(generation)
        else:
            self.client.set_generation(generation)

    def on_commit(self, step: int, generation: int) -> None:
        try:
            self.client.on_commit(step, generation)
        except DaemonUnavailable as exc:
            log.warning("COMMIT of step %d not delivered (%s); the checkpoint is durable", step, exc)
