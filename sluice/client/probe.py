"""Is anything listening at a ZeroMQ endpoint? (So a client fails fast only when nothing is.)

ZeroMQ connects in the background and never says "nobody there", so the client
asks the operating system directly: a plain connect to the ipc socket file or
the tcp port. A refused connection or a missing socket file means no daemon;
anything else (accepted, a timeout, a permission error) counts as "maybe", and
the client keeps waiting for a slow or starting daemon as before. The probe
sends nothing and closes at once.
"""

from __future__ import annotations

import socket


def nothing_listens(endpoint: str, timeout_s: float = 0.5) -> bool:
    """True only when the OS says no one listens at `endpoint` (ipc:// or tcp://)."""
    try:
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            if path.startswith("@"):  # Linux abstract namespace
                path = "\0" + path[1:]
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
        elif endpoint.startswith("tcp://"):
            host, _, port = endpoint[len("tcp://"):].rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                pass
        else:
            return False
    except (FileNotFoundError, ConnectionRefusedError):
        return True
    except (OSError, ValueError):
        return False
    return False
