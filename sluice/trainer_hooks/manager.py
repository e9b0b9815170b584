"""CheckpointManager: model, optimizer, RNG and data state committed together, in five lines.

::

    client = Client(endpoint, replica=rank, replicas=world)      # identity read from HELLO
    mgr = CheckpointManager("ckpt/", {"model": model, "optim": opt, "data": client}, every=500)
    start = mgr.restore()           # fences, restores model/optim/data, or starts the data over
    for step, batch in client.steps(start):     # one global step's micro-batches for this rank
        ...
        mgr.maybe_save(step)        # commits data with the model; tells the daemon

A checkpoint is a distributed commit (DESIGN.md section 7). The manager is a
facade over one module per seam:

    config.py      CheckpointConfig (validated), SaveReport, RestoreReport
    protocol.py    Stateful and FencedStateful: what the manager calls, and in which order
    collective.py  rank-0 decisions broadcast as int64; all-or-none outcomes
    writer.py      stage -> write shards -> coverage -> manifest (last) -> fenced publish
    restore.py     choose -> read exactly the listed files -> apply -> retire
    torchio.py     torch.save / DCP; reads that never unpickle (torchzip.py, dcpmeta.py)
    verify.py      manifests, digests, coverage, deep loadability (`sluice ckpt verify`)
    signing.py     optional HMAC over the manifest, keyed outside the folder

Statefuls are named objects. One that speaks `FencedStateful` (the data
client: ``state_dict``, ``load_state_dict``, ``reset(state=None)``,
``fence(generation)``, ``commit(step)``, ``check_resize(saved, world)``) has a JSON state, stored as its own
JSON shard per rank and never pickled; the manager fences it with the
generation it acquired, so no user passes a generation by hand. Every other
stateful (torch's protocol) is stored with torch.save (or DCP).

Async mode: `save` stages an immutable host copy and returns after that (the
exposed pause C); a background thread drains it to storage. The backlog is one
drain: a save that arrives while a drain runs either waits (``policy="block"``,
the wait is part of C) or is dropped (``policy="skip"``, counted in
`skipped_saves` and logged). ``commit(step)`` of an async save is delivered on
the caller's thread at the next `maybe_save`/`save`/`poll`/`wait` (ZeroMQ
sockets are not thread-safe, so the client's COMMIT must be sent from the
trainer's thread).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from sluice.errors import CheckpointError, SluiceError
from sluice.trainer_hooks.collective import Collective
from sluice.trainer_hooks.config import RNG_KEY, CheckpointConfig, Context, RestoreReport, SaveReport
from sluice.trainer_hooks.layout import Paths, is_plain_name
from sluice.trainer_hooks.protocol import is_fenced
from sluice.trainer_hooks.restore import Restorer
from sluice.trainer_hooks.retention import GcReport
from sluice.trainer_hooks.runrecord import RunRecord
from sluice.trainer_hooks.signing import Signer
from sluice.trainer_hooks.torchio import ModelOptimState
from sluice.trainer_hooks.writer import Staged, Writer
from sluice.waits import joined, wait_saying

__all__ = ["CheckpointConfig", "CheckpointManager", "ModelOptimState", "RestoreReport", "SaveReport"]

log = logging.getLogger("sluice.trainer_hooks")
SAY_AFTER_S = 30.0  # a wait for a drain longer than this is logged, again each time it doubles


def join_saying(drain: threading.Thread, who: str) -> None:
    """Join `drain` (an async checkpoint's write, `sluice-ckpt-drain-STEP`), never in silence: a wait past
    `SAY_AFTER_S` is a warning naming `who` waits and the drain's step (a slow or hung filesystem), again
    each time it doubles. Unbounded, as the write it waits for; a failed write's error is raised by `poll`."""
    wait_saying(lambda s: joined(drain, s), lambda s: log.warning(
        "%s has waited %.1f s for the checkpoint drain %s to be durable (a slow or hung filesystem?); still waiting",
        who, s, drain.name), SAY_AFTER_S)


class CheckpointManager:
    """Save and restore named statefuls as one fenced, verified checkpoint in `root`.

    Options are CheckpointConfig's fields as keywords (``every=500``,
    ``keep_last=3``, ``async_save=True``, ...), or one ``config=``. With a
    torch.distributed process group (the default group when it has more than
    one rank, or `process_group`), every rank constructs a manager and calls
    restore/maybe_save/save alike.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        statefuls: Mapping[str, Any],
        *,
        config: CheckpointConfig | None = None,
        process_group: Any | None = None,
        history: int = 64,
        **options: Any,
    ) -> None:
        self.config = CheckpointConfig.from_options(config, options)
        self._coll = Collective.detect(process_group)
        if self._coll.world > 1 and (self.config.async_save or self.config.format != "torch"):
            raise CheckpointError(
                f"checkpoint config: with {self._coll.world} ranks only format='torch' with async_save=False is "
                f"supported (collectives from a drain thread, and DCP across ranks, are not implemented)"
            )
        self.paths = Paths(Path(root))
        self.record = RunRecord(self.paths.root)
        for name, obj in statefuls.items():
            if name in (RNG_KEY, "dcp") or not is_plain_name(name):
                raise CheckpointError(f"stateful name {name!r} is reserved ('rng', 'dcp') or not a plain name "
                                      f"(letters, digits, '_', '.', '-'; not starting with '.' or '-')")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise CheckpointError(f"stateful {name!r} ({type(obj).__name__}) lacks state_dict()/load_state_dict()")
        self.statefuls = dict(statefuls)
        self.fenced_names = tuple(sorted(n for n, o in self.statefuls.items() if is_fenced(o)))
        signer = (Signer.from_file(self.config.hmac_key_file, self.paths.root)
                  if self.config.hmac_key_file is not None else None)
        ctx = Context(self.config, self._coll, self.paths, self.record, self.statefuls, self.fenced_names, signer)
        self._writer = Writer(ctx)
        self._restorer = Restorer(ctx)
        self.generation: int | None = None
        self.last_restore: RestoreReport | None = None
        self.history: deque[SaveReport] = deque(maxlen=history)
        self.skipped_saves = 0
        self._drain: threading.Thread | None = None
        self._drain_error: BaseException | None = None
        self._pending_commits: deque[int] = deque(maxlen=4)
        self._lock = threading.Lock()
        self._last_save_start: float | None = None
        self._pauses: deque[float] = deque(maxlen=5)

    @property
    def last_gc(self) -> GcReport | None:
        return self._writer.last_gc

    # ------------------------------------------------------------------ restore
    def restore(self, *, step: int | None = None, expected_dataset_id: str | None = None,
                expected_runspec_digest: str | None = None) -> int:
        """Acquire a new generation, restore the newest good checkpoint, and return the first step to train.

        Every fenced stateful is fenced with the new generation, then reset to the
        checkpoint's state, or to the start of its stream (step 0) when the folder
        holds no checkpoint. A checkpoint that is damaged, or whose shards cannot
        be loaded, is skipped (logged, and listed in `last_restore.skipped`) for
        the next older one, up to `rollback_window` of them; checkpoints above the
        restored one are retired (moved to DIR/retired/). `step` picks an older
        checkpoint (an explicit rollback). The expected_* values, when given, are
        checked against the checkpoint's data state before anything is loaded.

        Raises CheckpointError when checkpoints exist but none within the window
        can be restored, CheckpointMismatch when a good one lacks a stateful this
        manager has, and StateError when the data state names another dataset or
        run spec (refused by the check here or by the data stateful's reset), or
        ResizeRefused when the checkpoint's data-parallel size differs from this
        run's and a fenced stateful's contract forbids that (the run spec's `resume = "exact"`).
        """
        if self._drain is not None:
            self.wait()
        self.generation = self._acquire()
        self.last_restore = self._restorer.restore(self.generation, step=step,
                                                   expected_dataset_id=expected_dataset_id,
                                                   expected_runspec_digest=expected_runspec_digest)
        return self.last_restore.start

    def _acquire(self) -> int:
        generation = self._coll.shared(self.record.acquire, "acquire a generation", str(self.paths.root))
        log.info("checkpoint writer in %s acquired generation %d", self.paths.root, generation)
        return generation

    def _require_generation(self) -> int:
        """The writer's generation; a save before any restore acquires one and fences the fenced statefuls."""
        if self.generation is None:
            self.generation = self._acquire()
            for name in self.fenced_names:
                self.statefuls[name].fence(self.generation)
        return self.generation

    # ------------------------------------------------------------------ cadence
    @property
    def interval_s(self) -> float | None:
        """Young's interval sqrt(2*C*M) for every='auto' (None before C is measured)."""
        if self.config.every != "auto" or not self._pauses:
            return None
        cost = sum(self._pauses) / len(self._pauses)
        return math.sqrt(2.0 * cost * float(self.config.mtbf_s or 0.0))

    def should_save(self, step: int) -> bool:
        """Whether the cadence asks for a save at `step` (with several ranks, every rank calls this)."""
        every = self.config.every
        if every is None:
            return False
        if every == "auto":
            # A time-based decision could differ between ranks and deadlock the
            # collective save: rank 0 decides for everyone (one int64 broadcast).
            return bool(self._coll.broadcast_int(int(self._auto_due()) if self._coll.rank == 0 else 0))
        return step % every == 0

    def _auto_due(self) -> bool:
        if self._last_save_start is None:
            return True  # measure C once
        interval = self.interval_s
        return interval is None or time.perf_counter() - self._last_save_start >= interval

    def maybe_save(self, step: int) -> SaveReport | None:
        """save(step) if the cadence says so (also delivers pending async commits)."""
        if self.should_save(step):
            return self.save(step)
        self.poll()
        return None

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> SaveReport:
        """Checkpoint every stateful at `step` (the state after training step `step`).

        Raises FencedError if a newer writer took over, CheckpointError if the
        write failed (the previous checkpoint and `latest` are unchanged), and
        re-raises the error of a failed earlier async drain.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
        t_call = time.perf_counter()
        self.poll()
        generation = self._require_generation()
        mode: Literal["sync", "async"] = "async" if self.config.async_save else "sync"
        blocked = 0.0
        if self._drain is not None and self._drain.is_alive():
            if self.config.policy == "skip":
                self.skipped_saves += 1
                log.warning("checkpoint step %d skipped: the previous save is still draining (policy=skip, %d skipped)",
                            step, self.skipped_saves)
                report = SaveReport(step=step, generation=generation, mode=mode, skipped=True,
                                    exposed_pause_s=time.perf_counter() - t_call)
                self.history.append(report)
                return report
            t_block = time.perf_counter()
            join_saying(self._drain, f"checkpoint step {step} (policy=block)")
            blocked = time.perf_counter() - t_block
            log.info("checkpoint step %d waited %.3f s for the previous drain (policy=block)", step, blocked)
            self.poll()
        self._last_save_start = t_call
        staged = self._writer.stage(step, generation, t_call, clone=self.config.async_save)
        staged.blocked_s = blocked
        if not self.config.async_save:
            report = self._publish(staged)
            self._pauses.append(report.exposed_pause_s)
            self._deliver_commits()
            return report
        staged.exposed_s = time.perf_counter() - t_call
        self._pauses.append(staged.exposed_s)
        self._drain = threading.Thread(target=self._drain_main, args=(staged,), name=f"sluice-ckpt-drain-{step}",
                                       daemon=True)
        self._drain.start()
        return SaveReport(step=step, generation=generation, mode="async", exposed_pause_s=staged.exposed_s,
                          blocked_s=blocked, data_bytes=staged.data_bytes, data_seconds=staged.data_seconds)

    def _publish(self, staged: Staged) -> SaveReport:
        report = self._writer.write_and_publish(staged)
        with self._lock:
            self.history.append(report)
            self._pending_commits.append(staged.step)
        return report

    def _drain_main(self, staged: Staged) -> None:
        try:
            self._publish(staged)
        except BaseException as exc:  # surfaced on the trainer thread at the next call
            with self._lock:
                self._drain_error = exc
            log.error("async checkpoint of step %d failed: %s", staged.step, exc)

    # ------------------------------------------------------------------ async plumbing
    def poll(self) -> None:
        """Raise a failed drain's error; deliver commit(step) for drains that finished."""
        with self._lock:
            err, self._drain_error = self._drain_error, None
        if err is not None:
            if isinstance(err, SluiceError):
                raise err
            raise CheckpointError(f"async checkpoint drain failed: {err!r}") from err
        self._deliver_commits()

    def _deliver_commits(self) -> None:
        while True:
            with self._lock:
                if not self._pending_commits:
                    return
                step = self._pending_commits.popleft()
            for name in self.fenced_names:
                self.statefuls[name].commit(step)

    def wait(self) -> SaveReport | None:
        """Wait for a running drain, deliver its commit, and return the newest durable report."""
        if self._drain is not None:
            join_saying(self._drain, "the trainer")
        self.poll()
        for report in reversed(self.history):
            if report.durable:
                return report
        return None

    def close(self) -> None:
        """Finish any drain (raising its error)."""
        self.wait()
