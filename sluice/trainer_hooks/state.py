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

import json
import random
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


def restore_rng(obj: dict[str, Any], where: str) -> None:
    """Set python, numpy and torch RNG states from `capture_rng()` output."""
    import torch

    if not isinstance(obj, dict) or obj.get("schema") != RNG_SCHEMA:
        raise CheckpointError(f"{where}: RNG state schema {obj.get('schema') if isinstance(obj, dict) else None!r}, "
                              f"expected {RNG_SCHEMA!r}")
    try:
        py = obj["python"]
        gauss = py["gauss_next"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]),
                         None if gauss is None else float.fromhex(gauss)))
        nps = obj["numpy"]
        np.random.set_state((nps["kind"], np.asarray(nps["keys"], dtype=np.uint32), int(nps["pos"]),
                             int(nps["has_gauss"]), float.fromhex(nps["cached_gaussian"])))
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(obj["torch"])), dtype=torch.uint8))
        if "cuda" in obj and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8) for s in obj["cuda"]]
            )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: RNG state is malformed ({exc!r})") from exc


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
