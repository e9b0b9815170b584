"""`Client.from_env()`: a rank's client from environment variables, as torchrun's ranks find each other.

torchrun gives every rank ``RANK`` and ``WORLD_SIZE``; rank r is replica r of
R = WORLD_SIZE (docs/deploy.md, "How many daemons"). The node's launcher adds
where the node's daemon listens and how to prove who the rank is:

    variable              meaning                                              default
    SLUICE_ENDPOINT       the daemon's endpoint (ipc://... or tcp://host:port)  -
    SLUICE_ENDPOINT_FILE  instead: the file loaderd --endpoint-file wrote        -
    SLUICE_REPLICA        this rank's replica                                  $RANK / peers, else 0
    SLUICE_REPLICAS       replicas R of the run                                $WORLD_SIZE / peers, else 1
    SLUICE_PEERS          ranks reading the same replica (tensor parallel:     1
                          consecutive ranks, so rank r reads replica r // peers)
    SLUICE_TOKEN          the run token                                        -
    SLUICE_TOKEN_FILE     instead: a 0600 file holding it                      -
    SLUICE_CURVE_SECRET   this rank's CurveZMQ secret key file (.key_secret)   -
    SLUICE_CURVE_SERVER   the daemon's public key file (.key)                  -
    SLUICE_NODE_FILE      a per-node file of the endpoint, token file and key   -
                          files (`sluice.client.nodefile`); the environment wins

Without RANK and WORLD_SIZE (one process, no launcher) the client is replica
0 of 1. Every problem is a SpecError naming the variable: a missing endpoint,
RANK without WORLD_SIZE, a value that is not a number or out of range, a
token given twice, one CURVE key file without the other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sluice.errors import SpecError

ENDPOINT, ENDPOINT_FILE = "SLUICE_ENDPOINT", "SLUICE_ENDPOINT_FILE"
TOKEN_FILE = "SLUICE_TOKEN_FILE"
CURVE_SECRET, CURVE_SERVER = "SLUICE_CURVE_SECRET", "SLUICE_CURVE_SERVER"


def _int(env: Mapping[str, str], name: str, low: int) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise SpecError(f"Client.from_env: ${name} is {text[:40]!r}; expected an integer >= {low}")
    return value


def _first(env: Mapping[str, str], names: tuple[str, str], low: int) -> tuple[int | None, str | None]:
    """(value, variable) of the first of `names` set in `env`, else (None, None)."""
    for name in names:
        value = _int(env, name, low)
        if value is not None:
            return value, name
    return None, None


def _endpoint(env: Mapping[str, str]) -> str:
    endpoint, path = env.get(ENDPOINT, "").strip(), env.get(ENDPOINT_FILE, "").strip()
    if endpoint and path:
        raise SpecError(f"Client.from_env: both ${ENDPOINT} and ${ENDPOINT_FILE} are set; give one")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                endpoint = f.read(4096).strip()
        except OSError as exc:
            raise SpecError(f"Client.from_env: ${ENDPOINT_FILE} {path}: cannot read it ({exc.strerror or exc}); "
                            "loaderd writes it with --endpoint-file once it listens") from None
        if not endpoint:
            raise SpecError(f"Client.from_env: ${ENDPOINT_FILE} {path} is empty")
    if not endpoint:
        raise SpecError(f"Client.from_env: ${ENDPOINT} is not set (the daemon's endpoint, e.g. tcp://10.0.0.7:5555 "
                        f"or the ipc:// path loaderd printed), nor ${ENDPOINT_FILE}")
    if not endpoint.startswith(("ipc://", "tcp://")):
        raise SpecError(f"Client.from_env: the endpoint {endpoint[:80]!r} is not ipc://... or tcp://host:port")
    return endpoint


def _token(env: Mapping[str, str]) -> str | None:
    from sluice.wire import runtoken

    token, path = env.get(runtoken.TOKEN_ENV, ""), env.get(TOKEN_FILE, "").strip()
    if token and path:
        raise SpecError(f"Client.from_env: both ${runtoken.TOKEN_ENV} and ${TOKEN_FILE} are set; give one")
    if path:
        try:
            return runtoken.read_token_file(path)
        except SpecError as exc:
            raise SpecError(f"Client.from_env: ${TOKEN_FILE}: {exc}") from None
    return runtoken.check_token(token, f"Client.from_env: ${runtoken.TOKEN_ENV}") if token else None


def _curve(env: Mapping[str, str]) -> Any:
    secret, server = env.get(CURVE_SECRET, "").strip(), env.get(CURVE_SERVER, "").strip()
    if not secret and not server:
        return None
    if not (secret and server):
        missing, given = (CURVE_SERVER, CURVE_SECRET) if secret else (CURVE_SECRET, CURVE_SERVER)
        raise SpecError(f"Client.from_env: ${given} is set but ${missing} is not (CurveZMQ needs this rank's "
                        "secret key file and the daemon's public key file)")
    from sluice.curve import load_client_keys

    try:
        return load_client_keys(secret, server)
    except SpecError as exc:  # names the file; the variable says where the path came from
        raise SpecError(f"Client.from_env: ${CURVE_SECRET} / ${CURVE_SERVER}: {exc}") from None


def client_args(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`Client` keyword arguments from `env` (default os.environ): endpoint, replica, replicas, peers, token,
    curve; SpecError naming the variable on any problem (module docstring)."""
    from sluice.client.nodefile import with_node_file

    env = with_node_file(os.environ if env is None else env)
    replica, replica_var = _first(env, ("SLUICE_REPLICA", "RANK"), 0)
    replicas, replicas_var = _first(env, ("SLUICE_REPLICAS", "WORLD_SIZE"), 1)
    if (replica_var is None) != (replicas_var is None):
        given, missing = (replica_var, "WORLD_SIZE") if replicas_var is None else (replicas_var, "RANK")
        raise SpecError(f"Client.from_env: ${given} is set but ${missing} is not (torchrun sets RANK and "
                        "WORLD_SIZE; rank r reads replica r of WORLD_SIZE; SLUICE_REPLICA and SLUICE_REPLICAS "
                        "override them)")
    peers = _int(env, "SLUICE_PEERS", 1) or 1
    if replica is None or replicas is None:  # no launcher: one process
        replica, replicas = 0, 1
    else:
        if replica_var == "RANK":  # a replica's peers are consecutive ranks (tensor parallel innermost)
            replica //= peers
        if replicas_var == "WORLD_SIZE":
            if replicas % peers:
                raise SpecError(f"Client.from_env: $WORLD_SIZE {replicas} is not a multiple of $SLUICE_PEERS {peers}")
            replicas //= peers
        if replica >= replicas:
            raise SpecError(f"Client.from_env: ${replica_var} {env[replica_var].strip()} gives replica {replica}, "
                            f"not below {replicas} replicas (${replicas_var} {env[replicas_var].strip()}"
                            f"{f', $SLUICE_PEERS {peers}' if peers > 1 else ''})")
    return {"endpoint": _endpoint(env), "replica": replica, "replicas": replicas, "peers": peers,
            "token": _token(env), "curve": _curve(env)}
