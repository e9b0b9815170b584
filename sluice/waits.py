"""Waits that are never silent (a shared leaf): one past its first bound is said, again each time it doubles.

The daemon's step waiting on an object's worker (`loaderd/physical/entry.py`)
and the trainer waiting on a checkpoint's drain (`trainer_hooks/manager.py`)
wait for as long as the work takes; `wait_saying` makes each of them say what
it waits for. `joined` is a thread's bounded join, for a close that must not
return while a background import still runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["joined", "wait_saying"]


def wait_saying(wait: Callable[[float], bool], say: Callable[[float], None], first_s: float) -> None:
    """Wait until `wait(s)` returns True (the wait is over; False: `s` seconds passed without it), calling
    `say(waited_s)` after each False: first after `first_s`, then each time the time waited doubles."""
    waited, quiet = 0.0, first_s
    while not wait(quiet):
        waited += quiet
        say(waited)
        quiet = waited


def joined(thread: threading.Thread | None, timeout_s: float | None) -> bool:
    """Join `thread` for up to `timeout_s` seconds (None: as long as it takes); True when it is not running
    (None: never started)."""
    if thread is not None:
        thread.join(timeout_s)
    return thread is None or not thread.is_alive()
