"""When a producer starts loading the fast path's compiled kernel (`jitload.KernelLoader.start`).

Loading through numba holds the daemon's GIL for ~0.35 s of CPU (import numba 0.14 s,
numba's typing and lowering registries 0.12 s, the 12 cached overloads 0.04 s;
none of it can be skipped: a load that left the registries out crashed at the
first call), which beside a busy producer halves its rate for ~0.8 s; the
kernel then saves 0.2-0.25 ms of producer CPU a step (`bench/fused_mix.py
--jit on`). So the load is worth it in a run that goes on for more than
~1,500-2,000 steps, and costs nothing where the producer would wait anyway.
`StartRule.due` says when, at the first of:

* ``ready``: this machine's cache holds the kernels compiled ahead of time
  (`jitaot`): loading them is a millisecond and no numba, so every run
  starts it after its first call;
* ``max_steps``: the run spec's `max_steps` leaves at least
  `START_AFTER_STEPS` steps after the one just made: the load pays back
  within the run, so it starts at the first chance (after the first call,
  never on the start path: the first batch, a RESTORE's step);
* ``idle``: the producer has waited for room (its consumer is slower)
  `IDLE_START_S` in all (a wait is counted when it ends): a trainer's steps
  (0.1-1 s each) get there within a few steps, one that builds its model
  before asking for its first batch at that batch; the load's GIL time then
  falls in time the daemon has nothing to do. A consumer that
  takes batches as fast as they come (bench/peers) leaves the producer ~0.1 s
  of waits in its first 2,000 steps (a garbage collection in its process);
* ``steps``: `START_AFTER_STEPS` steps made, the length of the run unknown
  and the producer busy: the ski-rental rule, load once the kernel-less path's
  extra cost reaches the load's (break-even 1,300-2,100 steps, measured), so
  no run loses more than about the load's cost. A lower count only moves the
  runs that lose it (those just past the count) to shorter ones
  (docs/logical.md, "Compiled kernel").

None of them starts the load while some object's tokens are being made from
text: every step is then `Plan.step`'s; the load waits for the last such
object, and its log line names the step after which it was first due
(steploop.py, `StepLoop._start_kernel`).
"""

from __future__ import annotations

__all__ = ["IDLE_START_S", "START_AFTER_STEPS", "StartRule"]

START_AFTER_STEPS = 2048
IDLE_START_S = 0.5


class StartRule:
    """One producer loop's rule: `due(...)` names the first condition met (the load should start), else None.

    `max_steps`: the run spec's (0: unbounded, the length unknown)."""

    def __init__(self, max_steps: int, *, after_steps: int = START_AFTER_STEPS,
                 idle_s: float = IDLE_START_S) -> None:
        self.max_steps = max_steps
        self.after_steps = after_steps
        self.idle_s = idle_s

    def due(self, produced: int, idle_s: float, step: int | None, ready: bool = False) -> str | None:
        """`produced`: the steps this loop has handed over; `idle_s`: the seconds it has waited for room in all;
        `step`: the last step made (None: none, or the stream ended there); `ready`: the ahead-of-time module is
        built (`KernelLoader.ready`). The reason the load should start now, or None."""
        if ready and step is not None:
            return "ready: the kernels' compiled module is on disk"
        if self.max_steps and step is not None and self.max_steps - (step + 1) >= self.after_steps:
            return f"max_steps: {self.max_steps - (step + 1)} steps to go"
        if idle_s >= self.idle_s:
            return f"idle: the producer waited {idle_s:.2f} s for its consumer"
        if produced >= self.after_steps:
            return f"steps: {self.after_steps} made, the run's length unknown"
        return None
