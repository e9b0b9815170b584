"""CurveZMQ keys: what lets loaderd listen on TCP beyond loopback.

Without keys the daemon binds only ipc:// (in a 0700 directory) or loopback
TCP. With keys, every connection is encrypted and authenticated: the daemon
holds a secret key and a folder of allowed client public keys; a client holds
its own key pair and the daemon's public key. Key files are pyzmq/ZeroMQ
certificate files (`zmq.auth`), read as text, never unpickled.

    sluice curve-keys keys/ loaderd       # keys/loaderd.key, keys/loaderd.key_secret (0600)
    sluice curve-keys keys/ trainer-07
    loaderd ... --endpoint tcp://0.0.0.0:5555 \\
        --curve-secret keys/loaderd.key_secret --curve-clients allowed/   # allowed/ holds trainer-*.key
    Client(endpoint, ..., curve=load_client_keys("keys/trainer-07.key_secret", "keys/loaderd.key"))
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import SpecError


@dataclass(frozen=True)
class CurveServerKeys:
    public: bytes
    secret: bytes
    clients_dir: str  # folder of allowed client public keys (*.key)


@dataclass(frozen=True)
class CurveClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


_CERT_MAX_BYTES = 64 << 10  # a ZeroMQ certificate is a few hundred bytes


def _parse_certificate(data: bytes) -> tuple[bytes | None, bytes | None]:
    """(public, secret) Z85 keys from certificate text, as `zmq.auth.load_certificate` reads them."""
    public = secret = None
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"#"):
            continue
        if line.startswith(b"public-key") and b"=" in line:
            public = line.split(b"=", 1)[1].strip(b" \t'\"")
        if line.startswith(b"secret-key") and b"=" in line:
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    return public, secret


def _load(path: str | os.PathLike[str], need_secret: bool, what: str) -> tuple[bytes, bytes | None]:
    """The keys in a certificate file. A secret key file is read like a token file
    (`fsutil.read_secret_file`: this user's own regular file, mode 0600 or stricter), SpecError otherwise."""
    if need_secret:
        from sluice.fsutil import read_secret_file

        public, secret = _parse_certificate(read_secret_file(path, what, _CERT_MAX_BYTES))
        if public is None:
            raise SpecError(f"{what} {path}: not a ZeroMQ certificate (no public-key line)")
        if not secret:
            raise SpecError(f"{what} {path}: holds no secret key (give the .key_secret file)")
        return public, secret
    import zmq.auth

    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} {path}: not a readable ZeroMQ certificate ({exc})") from exc


def load_server_keys(secret_file: str | os.PathLike[str], clients_dir: str | os.PathLike[str]) -> CurveServerKeys:
    """The daemon's key pair and the folder of client public keys it accepts."""
    public, secret = _load(secret_file, True, "loaderd curve secret")
    folder = Path(clients_dir)
    if not folder.is_dir() or not any(folder.glob("*.key")):
        raise SpecError(f"loaderd curve clients {folder}: not a folder holding client public keys (*.key)")
    assert secret is not None
    return CurveServerKeys(public, secret, str(folder))


def load_client_keys(secret_file: str | os.PathLike[str], server_public_file: str | os.PathLike[str]) -> CurveClientKeys:
    """A client's key pair and the daemon's public key."""
    public, secret = _load(secret_file, True, "client curve secret")
    server_public, _ = _load(server_public_file, False, "loaderd curve public key")
    assert secret is not None
    return CurveClientKeys(public, secret, server_public)


def generate(folder: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret (0600) into `folder`; returns both paths."""
    import zmq.auth

    Path(folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    os.chmod(secret, 0o600)
    return public, secret


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "curve-keys",
        help="create a CurveZMQ key pair (for loaderd on TCP beyond loopback)",
        description="Writes DIR/NAME.key (public; give it to the other side) and DIR/NAME.key_secret (0600).",
    )
    p.add_argument("dir", help="folder for the keys (created if missing)")
    p.add_argument("name", help="key name: NAME.key and NAME.key_secret (e.g. loaderd, trainer-07)")
    p.set_defaults(func=_generate_cmd)


def _generate_cmd(args: argparse.Namespace) -> int:
    from sluice.errors import SpecError

    try:
        public, secret = generate(args.dir, args.name)
    except OSError as exc:  # DIR is a file, not writable, or NAME names a missing folder
        raise SpecError(f"curve-keys: cannot write {args.name!r:.80} keys into {args.dir} ({exc.strerror or exc})") from exc
    print(f"public {public}\nsecret {secret}")
    return 0
