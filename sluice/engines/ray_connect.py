"""Reaching the Ray cluster named by `--address`: within a bound, or an error naming that address and the cause.

    check_cluster("10.0.0.5:6379")        # returns, or raises EngineError within CONNECT_TIMEOUT_S
    connect(ray, "10.0.0.5:6379")         # check_cluster, then ray.init with Ray's own retries bounded

`ray.init(address=...)` alone retries its first GCS call 20 times, ~1 s
apart, and each try against a port that accepts TCP but never answers waits
two 5 s channel timeouts: 21 s for a refused auth token, minutes for a silent
port, and the error it ends with names the address Ray resolved the given one
to (a loopback address becomes the node's), not the cause. So before Ray is
asked, one deadline covers three checks, each with its own cause:

1. TCP: the host resolves and something listens (refused, no route, no
   answer within the bound, unknown host);
2. the peer speaks gRPC: it answers the HTTP/2 client preface with a SETTINGS
   frame (a peer that accepts and stays silent, or answers something else, is
   named as not a Ray GCS);
3. for a GCS address (not `ray://`): one GetClusterId call through Ray's own
   client, which carries Ray's auth token exactly as `ray.init` would, so a
   refused token is told apart from everything else and its source (the
   RAY_AUTH_TOKEN variable, the RAY_AUTH_TOKEN_PATH file, ~/.ray/auth_token,
   with the file's modification time) is named.

`auto` is Ray's own lookup of a local cluster; the address it finds is checked
the same way and named next to `auto`. Ray then rewrites a loopback address to
the node's before it connects; `connect` joins a loopback-only head (where the
rewritten address does not answer) in Ray's local-only mode instead. tests/test_ray_connect.py drives each
cause against a real peer on 127.0.0.1 (and a real token-auth Ray head in the
slow tier).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sluice.errors import EngineError

CONNECT_TIMEOUT_S = 10.0  # the whole check; docs/deploy.md states it
# Ray's own GCS connect retries once our check has passed (its default is 20 x ~1 s): a cluster that
# answered a moment ago either takes the driver now or the failure is named within these seconds.
RAY_INIT_RETRIES = 3
# The HTTP/2 client connection preface and an empty SETTINGS frame: every gRPC server answers it with
# its own SETTINGS frame (type 0x4) before anything else (RFC 9113 section 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x4
_TOKEN_DOC = "https://docs.ray.io/en/latest/ray-security/token-auth.html"


# Ray's own switch for a local-only node (what it does on macOS and Windows): every Ray process
# takes the loopback address as the node's and listens there only. Without it a local Ray started
# for one `freeze` listened on every interface (issue 27): its GCS, raylet and workers reachable
# from the network while it ran. Read by Ray at import, and by the processes it starts.
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """While a local Ray starts (or a driver joins one): its node address is 127.0.0.1, its processes listen there only.

    Ray passes `_node_ip_address="127.0.0.1"` on to the address other machines see (it "resolves"
    localhost away), so the local-only mode is switched on instead, for this process (Ray's
    constant, if Ray was imported already) and for the processes `ray.init` starts (environment);
    both are put back once it has started. tests/test_ray_engine.py checks the addresses."""
    from ray._private import ray_constants

    saved_env, saved_const = os.environ.get(_LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            os.environ.pop(_LOCAL_ONLY_ENV, None)
        else:
            os.environ[_LOCAL_ONLY_ENV] = saved_env


def _fail(address: str, cause: str) -> EngineError:
    return EngineError(f"ray engine: cannot connect to the Ray cluster at {address}: {cause}")


def split_address(address: str) -> tuple[str, str, int]:
    """(`ray` or `gcs`, host, port) of `host:port` or `ray://host:port`; EngineError naming a malformed one."""
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if parts.scheme not in ("gcs", "ray") or not host or not port:
        raise EngineError(f"ray engine: --address {address!r} is not host:port, ray://host:port or auto")
    return parts.scheme, host, port


def _remaining(deadline: float) -> float:
    return max(0.05, deadline - time.monotonic())


def _open_tcp(address: str, host: str, port: int, deadline: float, timeout_s: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=_remaining(deadline))
    except socket.gaierror as exc:
        raise _fail(address, f"the host name {host!r} does not resolve ({exc.strerror})") from exc
    except ConnectionRefusedError as exc:
        raise _fail(address, f"nothing listens on port {port} there (connection refused)") from exc
    except TimeoutError as exc:
        raise _fail(address, f"no answer to a TCP connect within {timeout_s:g} s (host down, or the port "
                             "filtered by a firewall)") from exc
    except OSError as exc:
        raise _fail(address, f"TCP connect failed ({exc.strerror or exc})") from exc


def _check_speaks_grpc(address: str, sock: socket.socket, deadline: float, timeout_s: float) -> None:
    """The peer answers the HTTP/2 preface with a SETTINGS frame, as a GCS (or Ray Client server) does."""
    not_ray = "is it the head's GCS port (`ray start --head --port`, 6379 by default) or ray://head:10001?"
    head = b""
    try:
        sock.settimeout(_remaining(deadline))
        sock.sendall(_H2_PREFACE)
        while len(head) < 9:
            sock.settimeout(_remaining(deadline))
            got = sock.recv(9 - len(head))
            if not got:
                break
            head += got
    except TimeoutError as exc:
        raise _fail(address, f"it accepts TCP connections but sent nothing within {timeout_s:g} s: not a Ray "
                             f"GCS ({not_ray})") from exc
    except ConnectionError:  # reset or broken pipe: it closed the connection, as below
        head = b""
    except OSError as exc:
        raise _fail(address, f"it accepted the TCP connection, then {exc.strerror or exc}: not a Ray GCS "
                             f"({not_ray})") from exc
    finally:
        sock.close()
    if len(head) < 9:
        raise _fail(address, f"it accepts TCP connections but closed this one without answering: not a Ray "
                             f"GCS ({not_ray})")
    if head[3] != _H2_SETTINGS:
        raise _fail(address, f"it answers, but not as a gRPC server (first bytes {head!r}): not a Ray GCS "
                             f"({not_ray})")


def token_source() -> tuple[str, str | None]:
    """(where the token Ray would send comes from, a problem with it that Ray would abort on, or None).

    Ray's order: the RAY_AUTH_TOKEN variable, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token.
    A RAY_AUTH_TOKEN_PATH that cannot be read (or is empty) stops Ray's C++ loader with an abort,
    so it is reported here instead."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the token in the RAY_AUTH_TOKEN variable", None
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        path = Path(named)
        try:
            ok = bool(path.read_text().strip())
        except OSError as exc:
            return f"RAY_AUTH_TOKEN_PATH={named}", f"it cannot be read ({exc.strerror or exc})"
        if not ok:
            return f"RAY_AUTH_TOKEN_PATH={named}", "the file is empty"
        return f"the token file {named} (RAY_AUTH_TOKEN_PATH, {_modified(path)})", None
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return f"the token file {default} ({_modified(default)})", None
    return "no token (RAY_AUTH_TOKEN unset, no RAY_AUTH_TOKEN_PATH, no ~/.ray/auth_token)", None


def _modified(path: Path) -> str:
    try:
        when = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError:
        return "modification time unknown"
    return f"written {when:%Y-%m-%d %H:%M:%S} UTC"


def _token_mode() -> bool:
    return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"


def _check_gcs(address: str, gcs: str, deadline: float) -> None:
    """One GetClusterId through Ray's client (it sends the auth token as `ray.init` would)."""
    from ray._raylet import InnerGcsClient
    from ray.exceptions import AuthenticationError

    source, problem = token_source()
    if _token_mode() and problem:
        raise _fail(address, f"RAY_AUTH_MODE=token and {source}: {problem}")
    try:
        InnerGcsClient.standalone(gcs, None, int(_remaining(deadline) * 1000))
    except AuthenticationError as exc:
        if not _token_mode():
            cause = (f"the cluster requires token authentication and RAY_AUTH_MODE is not 'token' here, so "
                     f"Ray sent no token (it would have used {source}); set RAY_AUTH_MODE=token")
        elif source.startswith("no token"):
            cause = f"the cluster refused the connection: RAY_AUTH_MODE=token but {source}"
        else:
            cause = (f"the cluster refused {source}: a stale or wrong token; put the cluster's current token "
                     f"there (`ray get-auth-token` on the head)")
        raise _fail(address, f"{cause}. See {_TOKEN_DOC}") from exc
    except Exception as exc:  # RpcError (deadline, unimplemented service): gRPC, but no GCS answering
        raise _fail(address, f"it speaks gRPC but did not answer as a Ray GCS ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else exc!r})") from exc


def _resolve_auto() -> str:
    """The address Ray's `auto` finds (RAY_ADDRESS, or the last `ray start` on this machine)."""
    from ray._private import services

    try:
        found = services.canonicalize_bootstrap_address("auto")
    except Exception as exc:  # ConnectionError: nothing recorded; ValueError: a malformed RAY_ADDRESS
        raise EngineError(f"ray engine: --address auto found no Ray cluster on this machine ({exc})") from exc
    if not found:
        raise EngineError("ray engine: --address auto found no Ray cluster on this machine "
                          "(RAY_ADDRESS unset and no `ray start` session recorded)")
    return found


def check_cluster(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """Return `address` once a Ray cluster answers there (`auto`: at the address Ray finds for it).

    Raises EngineError naming `address` (and, for `auto`, what it resolved to) and the
    cause, within about `timeout_s` seconds: unknown host, refused, no answer, a peer
    that is not a Ray GCS, a refused or unreadable auth token."""
    deadline = time.monotonic() + timeout_s
    found, named = address, address
    if address == "auto":
        found = _resolve_auto()
        named = f"{found} (--address auto)"
        # ray.init("auto") switches token mode on when a token file exists (an explicit address never
        # does); the check below must send what ray.init will send.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    scheme, host, port = split_address(found)
    sock = _open_tcp(named, host, port, deadline, timeout_s)
    _check_speaks_grpc(named, sock, deadline, timeout_s)
    if scheme == "gcs":
        _check_gcs(named, f"{host}:{port}", deadline)
    return address


def _answers(address: str, deadline: float) -> bool:
    """TCP and the gRPC preface only: does a Ray GCS (or Ray Client server) listen at `address`?"""
    _, host, port = split_address(address)
    try:
        _check_speaks_grpc(address, _open_tcp(address, host, port, deadline, 0), deadline, 0)
    except EngineError:
        return False
    return True


def connect(ray: Any, address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """`ray.init(address=...)` once `check_cluster` passed, with Ray's own GCS retries bounded.

    Ray rewrites a loopback `--address` (127.0.0.1, localhost) to this machine's node address
    before it connects; a head that listens on loopback only (Ray's local-only mode, as
    `loopback_only` starts one) is not there, and Ray would retry it for minutes. When the
    rewritten address does not answer but the given one did, the driver joins in local-only
    mode too. Raises EngineError naming `address` and the cause."""
    deadline = time.monotonic() + timeout_s
    target = check_cluster(address, timeout_s)
    local_only = False
    if target != "auto" and split_address(target)[0] == "gcs":
        from ray._private import services

        rewritten = services.canonicalize_bootstrap_address(target)
        local_only = rewritten != target and not _answers(rewritten, deadline)
    saved = os.environ.get("RAY_gcs_server_port_wait_time_s")
    # Read by ray.init when it connects (ray/_private/node.py): its GCS retries, ~1 s each.
    os.environ["RAY_gcs_server_port_wait_time_s"] = str(RAY_INIT_RETRIES)
    try:
        with loopback_only() if local_only else contextlib.nullcontext():
            ray.init(address=target, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError, ImportError (ray://)...
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _fail(address, f"it answered, but ray.init failed ({type(exc).__name__}: {cause})") from exc
    finally:
        if saved is None:
            os.environ.pop("RAY_gcs_server_port_wait_time_s", None)
        else:
            os.environ["RAY_gcs_server_port_wait_time_s"] = saved
