"""$SLUICE_NODE_FILE: a node's daemon endpoint and keys in one small file, for `Client.from_env()`.

On many nodes every node runs the same trainer command; what differs is where
the node's daemon listens and which keys prove the ranks to it. The node file
holds those, written once when the node is provisioned (the same file as
``/etc/sluice/node.env``, which also carries the daemon's ``SLUICE_NODE_RANK``)::

    # /etc/sluice/node.env
    SLUICE_NODE_RANK=1
    SLUICE_ENDPOINT_FILE=/run/sluice/endpoint     # loaderd --endpoint-file writes it
    SLUICE_CURVE_SECRET=keys/trainer.key_secret   # relative: to this file's folder
    SLUICE_CURVE_SERVER=keys/loaderd.key
    SLUICE_TOKEN_FILE=token

Format: ``NAME=value`` lines as systemd's EnvironmentFile and a shell's ``.``
read them (``#`` comments, blank lines, an optional ``export``, a value in
matching quotes), taken literally: no expansion. Names: the node-level
variables of `sluice.client.env` (`NODE_VARIABLES`) and the daemon's
``SLUICE_NODE_RANK`` and ``SLUICE_RANKS_PER_NODE`` (ignored here). A variable
set in the environment wins over the file's entry for the same thing
(``SLUICE_ENDPOINT`` and ``SLUICE_ENDPOINT_FILE`` are one thing, as are the
token pair and the CurveZMQ key pair), so a launcher can still override one
node's setting. Every problem is a SpecError naming the file and line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sluice.errors import SpecError

NODE_FILE = "SLUICE_NODE_FILE"
# Each group is one setting: the environment giving any of a group replaces the file's whole group.
# (The token itself is never read from the node file: a secret belongs in its own 0600 file.)
GROUPS = (("SLUICE_ENDPOINT", "SLUICE_ENDPOINT_FILE"), ("SLUICE_TOKEN", "SLUICE_TOKEN_FILE"),
          ("SLUICE_CURVE_SECRET", "SLUICE_CURVE_SERVER"))
NODE_VARIABLES = tuple(name for group in GROUPS for name in group if name != "SLUICE_TOKEN")
PATHS = ("SLUICE_ENDPOINT_FILE", "SLUICE_TOKEN_FILE", "SLUICE_CURVE_SECRET", "SLUICE_CURVE_SERVER")
DAEMON_ONLY = ("SLUICE_NODE_RANK", "SLUICE_RANKS_PER_NODE")
MAX_BYTES = 64 << 10  # a node file is a handful of lines


def _value(text: str, where: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text[:1] in ("'", '"') or text[-1:] in ("'", '"'):
        raise SpecError(f"{where}: unmatched quote in {text[:80]!r}")
    return text


def parse_node_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The node-level variables `path` sets, relative paths made absolute against its folder."""
    where = f"Client.from_env: ${NODE_FILE} {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise SpecError(f"{where}: over {MAX_BYTES} bytes; a node file is a few NAME=value lines")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{where}: not UTF-8 text") from None
    folder = Path(path).resolve().parent
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        at = f"{where} line {number}"
        name, eq, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not eq:
            raise SpecError(f"{at}: expected NAME=value, got {line[:80]!r}")
        if name in DAEMON_ONLY:
            continue
        if name not in NODE_VARIABLES:
            raise SpecError(f"{at}: {name[:80]!r} is not a node setting (one of {', '.join(NODE_VARIABLES)}, "
                            f"or the daemon's {', '.join(DAEMON_ONLY)})")
        if name in out:
            raise SpecError(f"{at}: {name} is set twice")
        other = {"SLUICE_ENDPOINT": "SLUICE_ENDPOINT_FILE", "SLUICE_ENDPOINT_FILE": "SLUICE_ENDPOINT"}.get(name)
        if other in out:
            raise SpecError(f"{at}: {name} and {other} (set above) say the same thing; give one")
        value = _value(value, at)
        if not value:
            raise SpecError(f"{at}: {name} is empty")
        out[name] = str(folder / value) if name in PATHS else value
    return out


def with_node_file(env: Mapping[str, str]) -> Mapping[str, str]:
    """`env` with the entries of its $SLUICE_NODE_FILE added where `env` does not give that setting itself."""
    path = env.get(NODE_FILE, "").strip()
    if not path:
        return env
    from_file = parse_node_file(path)
    merged = dict(env)
    for group in GROUPS:
        if not any(env.get(name, "").strip() for name in group):
            merged.update({name: from_file[name] for name in group if name in from_file})
    return merged
