"""The two contracts a CheckpointManager drives: `Stateful` and `FencedStateful`.

`Stateful` is torch's protocol (``state_dict()`` / ``load_state_dict()``): a
model, an optimizer, anything whose state lives in this process.

`FencedStateful` is a stateful whose state also lives in another process that
must refuse an older trainer once a newer one restored: the data client, whose
daemon holds the stream position. The manager owns the fencing token (the
checkpoint folder's generation), so a user never passes one by hand::

    restore():  fence(G)            G: the generation restore just acquired
                reset(state)        resume after `state` (the checkpoint's), or
                reset(None)         start over at step 0 (no checkpoint)
                check_resize(S, W)  only when the checkpoint's S ranks differ from this run's W,
                                    before reset: raise (e.g. ResizeRefused) if the stateful's
                                    contract forbids the resize; the restore then stops
    save(k):    state_dict()        JSON (strings, integers, lists, dicts): stored as a
                                    JSON shard, never pickled; per rank
    published:  commit(k)           the checkpoint holding the state after step k is
                                    durable (advisory: a failure to deliver is logged
                                    by the implementation, not raised; FencedError is raised)

``load_state_dict(state)`` is ``reset(state)`` (torch's name for the same act).
A fenced state that is a sluice data state (``lanes`` object) is merged over
the saved ranks when the data-parallel size changed.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """torch's Stateful protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class FencedStateful(Protocol):
    """A stateful fenced by the checkpoint generation (see the module docstring for the call order)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...

    def reset(self, state: dict[str, Any] | None = None) -> Any: ...

    def fence(self, generation: int) -> Any: ...

    def commit(self, step: int) -> Any: ...

    def check_resize(self, saved_world_size: int, world_size: int) -> Any: ...


def is_fenced(obj: Any) -> bool:
    """Whether `obj` implements FencedStateful (every method present and callable)."""
    return all(callable(getattr(obj, name, None))
               for name in ("state_dict", "load_state_dict", "reset", "fence", "commit", "check_resize"))
