"""The client's state and fencing: torch's Stateful plus sluice's FencedStateful protocol.

`Client` inherits these methods; they only touch the client's position (the
state after the last completed step, the cursor, the history of recent
states) and its generation, and reach the daemon through the client's
`connect()` (RESTORE) and `_call()` (COMMIT)::

    state_dict() / state_dict_at(step)   the data state after a completed step (JSON)
    fence(generation)                    the checkpoint writer's fencing token; never goes down
    reset(state=None)                    RESTORE now: resume after `state`, or start over at step 0
    load_state_dict(state)               torch's name for reset(state)
    commit(step)                         COMMIT: the checkpoint of that step's state is durable
    check_resize(saved, world)           refuse a resize the run spec's `resume` contract forbids
    resume_contract                      that contract, as the daemon's HELLO_OK names it
    steps(start)                         iterate whole global steps from where the trainer resumes
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sluice.client.replies import state_value
from sluice.datastate import STATE_KIND, check_resize
from sluice.errors import DaemonUnavailable, HandshakeRefused, ProtocolError, StateError
from sluice.wire import protocol

HISTORY = 1024  # states of recent steps kept for commit() and state_dict_at()

log = logging.getLogger("sluice.client")


class FencedState:
    """State and fencing methods of `Client` (see the module docstring)."""

    # Set by Client.__init__ and its transport path.
    replica: int
    generation: int
    dataset_id: str | None
    info: dict[str, Any]
    _sock: Any
    _last: int | None
    _history: OrderedDict[int, dict[str, Any] | bytes]
    _cursor: tuple[int, int] | None
    _start_step: int | None
    _skip_before: tuple[int, int] | None
    _ended: bool
    _start_over: bool
    _fenced: bool
    _bump: bool
    _need_restore: bool

    if TYPE_CHECKING:  # provided by Client
        def connect(self) -> None: ...

        def _header(self, kind: str, *, step: int = -1, micro: int = -1, body: dict[str, Any] | None = None,
                    request_id: int | None = None) -> protocol.Header: ...

        def _call(self, h: protocol.Header) -> protocol.Message: ...

        def __next__(self) -> dict[str, Any]: ...

    @property
    def _state(self) -> dict[str, Any] | None:
        """The data state after the last completed step (None before the first, or after reset())."""
        return None if self._last is None else self._held(self._last)

    def _hold(self, step: int, state: dict[str, Any] | bytes) -> None:
        """Keep `state` (a dict, or a BATCH's checked JSON: replies.held_state) as the state after `step`, the
        last completed one; the oldest beyond HISTORY go."""
        self._history[step] = state
        self._last = step
        while len(self._history) > HISTORY:
            self._history.popitem(last=False)

    def _held(self, step: int) -> dict[str, Any] | None:
        """The state after `step` if still held, its JSON decoded on first use (and kept: the same dict after)."""
        state = self._history.get(step)
        if type(state) is bytes:
            value = state_value(state, step)
            if self._history.get(step) is state:  # (not evicted meanwhile: never put back a step that left)
                self._history[step] = value
            return value
        return state

    def state_dict(self) -> dict[str, Any]:
        """The data state after the last step this client completed (JSON: kind, schema, dataset
        ID, run-spec digest, step, this replica's lanes); StateError before the first step."""
        state = self._state
        if state is None:
            raise StateError(f"client of replica {self.replica}: no step completed yet, so there is no data state "
                             "to checkpoint (save after the first step)")
        return state

    def state_dict_at(self, step: int) -> dict[str, Any]:
        """As `state_dict()`, for one of the last completed steps still held (StateError otherwise)."""
        state = self._held(step)
        if state is None:
            raise StateError(f"client of replica {self.replica}: step {step} is not among the last {HISTORY} "
                             "steps it completed")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """torch's name for `reset(state)`."""
        self.reset(state)

    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Resume after `state` (a data state from `state_dict()`), or start over at step 0 (None).

        Sends RESTORE now (connecting if needed), so a state the daemon refuses
        (another dataset or run spec, lanes it does not serve) raises here, not
        at the first batch. The generation is the one given to `fence()` since
        the last reset; without one, the generation after the daemon's, which
        fences every older reader of this replica. Starting over serves step 0
        again even if the daemon already served and released it to a trainer
        that died before its first checkpoint.
        """
        if state is not None:
            self._check_state(state)
        self._start_over = state is None
        self._history.clear()
        self._last = None
        if state is not None:
            self._hold(int(state["step"]), state)
        self._cursor = (0, 0) if state is None else (int(state["step"]) + 1, 0)
        self._skip_before = None
        self._ended = False
        self._bump = not self._fenced
        self._fenced = False
        self._need_restore = True
        self.connect()

    def fence(self, generation: int) -> None:
        """Use `generation` (the checkpoint writer's fencing token) from now on; it never goes down."""
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < self.generation:
            raise StateError(f"client of replica {self.replica}: generation {generation!r} is older than this "
                             f"client's {self.generation} (a fencing token never goes down)")
        self.generation = generation
        self._fenced = True

    def commit(self, step: int) -> int | None:
        """Tell the daemon the checkpoint holding the state after `step` is durable; the daemon's committed step.

        Advisory (the checkpoint is the source of truth): a daemon that does not
        answer, e.g. while it restarts, is logged and None returned; the next
        commit records a later step. FencedError if a newer trainer took over.
        """
        state = self._held(step)
        if state is None:
            raise StateError(f"client of replica {self.replica}: commit of step {step}, which is not among the "
                             f"last {HISTORY} steps it completed")
        try:
            if self._sock is None:
                self.connect()
            h = self._header(protocol.COMMIT, step=step, body={"state": state})
            reply = self._call(h)
        except HandshakeRefused:
            raise  # not a restarting daemon: this client may not speak to it
        except DaemonUnavailable as exc:
            log.warning("COMMIT of step %d not delivered (%s); the checkpoint is durable", step, exc)
            return None
        committed = reply.body.get("committed_step")
        if type(committed) is not int or committed < -1:  # a stranger's reply: our error, not int()'s
            raise ProtocolError(f"loaderd at {self.endpoint}: COMMIT_OK body field committed_step must be an "
                                f"integer >= -1, got {committed!r:.80}")
        return committed

    @property
    def resume_contract(self) -> str:
        """The run spec's `resume` contract (exact, exact-elastic, coverage, distributional), from the daemon."""
        if self._sock is None:
            self.connect()  # the daemon knows the run spec; the client learns it at HELLO
        return str(self.info.get("resume", "exact"))  # a daemon older than the field: the run spec's default

    def check_resize(self, saved_world_size: int, world_size: int) -> None:
        """Raise ResizeRefused if the run's resume contract forbids resuming a state saved by
        `saved_world_size` data-parallel ranks on `world_size` ranks (only `exact` does)."""
        check_resize(self.resume_contract, saved_world_size, world_size, f"client of replica {self.replica}")

    def _check_state(self, state: Any) -> None:
        """Refuse a state that is not a data state of this client's dataset and run spec, naming both values."""
        where = f"client of replica {self.replica}: data state"
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            raise StateError(f"{where}: not a sluice data state (kind "
                             f"{state.get('kind') if isinstance(state, dict) else type(state).__name__!r:.60})")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < -1:
            raise StateError(f"{where}: step {step!r:.60} is not an integer >= -1")
        if self._sock is None:
            self.connect()  # learn the daemon's identity before judging the state's
        for name, ours in (("dataset_id", self.dataset_id), ("runspec_digest", self.info.get("runspec_digest"))):
            if state.get(name) != ours:
                raise StateError(f"{where}: {name} {state.get(name)!r:.80} differs from this run's {ours!r}; "
                                 "refusing to resume a stream of another dataset or run spec")

    def steps(self, start: int | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Yield (step, this replica's micro-batches of that global step), from step `start` on.

        `start` is where the trainer resumes (``CheckpointManager.restore()``'s
        answer); StateError if this client stands elsewhere (a reset or restore
        was missed). None: from wherever the client stands. Ends at `end_step`
        or the end of the stream, always at a step boundary.
        """
        if start is not None:
            if self._cursor is None and self._state is None and not self._start_over:
                self._start_step = start  # not connected yet: begin there
            elif self._cursor != (start, 0):
                where = "not started" if self._cursor is None else f"at step {self._cursor[0]} micro {self._cursor[1]}"
                raise StateError(f"client of replica {self.replica} is {where}, the trainer resumes at step {start}: "
                                 "reset the client to the checkpoint's data state first (CheckpointManager.restore())")
        while True:
            try:
                first = next(self)
            except StopIteration:
                return
            step, micros = first["step"], [first]
            mps = int(self.info["micro_per_step"])
            while len(micros) < mps:
                try:
                    micros.append(next(self))
                except StopIteration:
                    raise ProtocolError(f"loaderd: the stream ended inside step {step} ({len(micros)} of {mps} "
                                        "micro-batches)") from None
            yield step, micros
