"""RNG and data state as JSON: captured, encoded and restored without pickle.

RNG states of python `random`, numpy's global generator and torch's CPU
generator (plus CUDA generators when CUDA is initialised) are part of every
checkpoint. They are stored as JSON (integers, hex strings, ``float.hex`` for
numpy's cached gaussian) so restoring them never unpickles anything.

The data state is whatever the data Stateful's ``state_dict()`` returns: a
JSON-serializable dict (lane states of strings and integers). Its top-level
fields ``step``, ``dataset_id`` and ``runspec_digest`` (when present) are copied
into the checkpoint manifest: `sluice ckpt list` shows them and restore checks
the identity against what the caller expects.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.errors import CheckpointError, StateError

RNG_SCHEMA = "sluice.rng/1"
IDENTITY_FIELDS = ("step", "dataset_id", "runspec_digest")


def capture_rng() -> dict[str, Any]:
    """The current RNG states as a JSON-able dict (see module docstring)."""
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    obj: dict[str, Any] = {
        "schema": RNG_SCHEMA,
        "python": {"version": version, "state": list(internal), "gauss_next": None if gauss is None else float(gauss).hex()},
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached).hex()},
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        obj["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return obj


@dataclass(frozen=True)
class RngState:
    """RNG states parsed and checked, ready to apply: `apply()` cannot fail on a malformed value."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: bytes
    cuda: tuple[bytes, ...] = ()

    def apply(self) -> None:
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(torch.frombuffer(bytearray(self.torch), dtype=torch.uint8))
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in self.cuda])


def parse_rng(obj: Any, where: str) -> RngState:
    """Check a `capture_rng()` object field by field; CheckpointError naming what is malformed."""
    import torch

    if not isinstance(obj, dict) or obj.get("schema") != RNG_SCHEMA:
        raise CheckpointError(f"{where}: RNG state schema {obj.get('schema') if isinstance(obj, dict) else None!r:.80}, "
                              f"expected {RNG_SCHEMA!r}")
    try:
        py = obj["python"]
        gauss = py["gauss_next"]
        internal = tuple(int(x) for x in py["state"])
        if len(internal) != 625 or not all(0 <= x < 1 << 32 for x in internal[:-1]) or not 0 <= internal[-1] <= 624:
            raise ValueError("python state is not 624 words of 32 bits and a position")
        python = (int(py["version"]), internal, None if gauss is None else float.fromhex(gauss))
        nps = obj["numpy"]
        keys = [int(k) for k in nps["keys"]]
        if len(keys) != 624 or not all(0 <= k < 1 << 32 for k in keys) or not 0 <= int(nps["pos"]) <= 624:
            raise ValueError("numpy state is not 624 words of 32 bits and a position")
        numpy = (str(nps["kind"]), np.asarray(keys, dtype=np.uint32), int(nps["pos"]), int(nps["has_gauss"]),
                 float.fromhex(nps["cached_gaussian"]))
        cpu = bytes.fromhex(obj["torch"])
        if len(cpu) != torch.get_rng_state().numel():
            raise ValueError(f"torch state has {len(cpu)} bytes, this torch uses {torch.get_rng_state().numel()}")
        cuda = tuple(bytes.fromhex(s) for s in obj.get("cuda", ()))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise CheckpointError(f"{where}: RNG state is malformed ({exc!r:.200})") from exc
    return RngState(python, numpy, cpu, cuda)


def restore_rng(obj: Any, where: str) -> None:
    """Set python, numpy and torch RNG states from `capture_rng()` output."""
    parse_rng(obj, where).apply()


def encode_json_state(state: Any, what: str) -> bytes:
    """Encode a Stateful's JSON state; refuses NaN and non-JSON types with a clear error."""
    try:
        return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise StateError(
            f"{what}: state_dict() must return JSON-serializable data (strings, integers, lists, dicts): {exc}"
        ) from exc


def decode_json_state(data: bytes, where: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply") from None


def data_summary(key: str, state: Any) -> dict[str, Any]:
    """The manifest's `data` block: the data state's step, dataset ID and run-spec digest."""
    out: dict[str, Any] = {"key": key}
    for name in IDENTITY_FIELDS:
        value = state.get(name) if isinstance(state, dict) else None
        out[name] = value if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    return out


def check_identity(summary: dict[str, Any] | None, where: str, *, dataset_id: str | None,
                   runspec_digest: str | None) -> None:
    """Refuse a checkpoint whose data state names another dataset or run spec.

    A check is skipped when the caller expects nothing for that field; when the
    caller expects a value and the checkpoint carries none, that is also a refusal
    (a state that cannot prove it belongs to this run).
    """
    for name, expected in (("dataset_id", dataset_id), ("runspec_digest", runspec_digest)):
        if expected is None:
            continue
        found = (summary or {}).get(name)
        if found != expected:
            raise StateError(
                f"{where}: data state belongs to {name} {found!r}, but this run expects {name} {expected!r}; "
                f"refusing to combine a checkpoint with another "
                f"{'dataset' if name == 'dataset_id' else 'run spec'}"
            )


def merge_data_states(states: list[Any]) -> dict[str, Any]:
    """One data state holding the lanes of every rank's state (for a resized restore).

    `DataState.merge` over the ranks' states: dataset ID, run-spec digest and
    step must agree, and a lane held by two ranks must hold the same value.
    The checkpoint does not know the run spec, so each state is parsed against
    the first one's identity and source count (every field typed and ranged);
    the daemon checks the merged state against its manifest and run spec on
    RESTORE, and each client then serves its own lanes.
    """
    from sluice.datastate import MAX_STATE_INT, DataState

    first = states[0] if states else None
    lanes = first.get("lanes") if isinstance(first, dict) else None
    if not isinstance(lanes, dict) or not lanes:
        raise StateError("data states cannot be merged for a resize (the first has no 'lanes' object)")
    lane = next(iter(lanes.values()))
    sources = lane.get("sources") if isinstance(lane, dict) else None
    parsed = [DataState.from_state_dict(state, dataset_id=first.get("dataset_id"),
                                        runspec_digest=first.get("runspec_digest"),
                                        n_sources=len(sources) if isinstance(sources, list) else 0,
                                        n_lanes=MAX_STATE_INT) for state in states]
    return functools.reduce(DataState.merge, parsed).state_dict()
