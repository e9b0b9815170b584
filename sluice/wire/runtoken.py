"""The run token: its form, reading it from a file, and the daemon's constant-time check of a request's."""

from __future__ import annotations

from typing import Any

# A per-run capability (docs/hardening.md): the launcher writes a secret to a
# 0600 file, loaderd reads it with --token-file, and clients send it as
# body["token"] of every request. The daemon compares it in constant time and
# answers UNAUTHORIZED otherwise. It is never echoed, logged or sent back.
TOKEN_ENV = "SLUICE_TOKEN"
TOKEN_USER = "sluice"  # ZMTP PLAIN user name; the token is the password (loaderd/endpoint.py)
TOKEN_MAX_CHARS = 256


def check_token(token: str, where: str) -> str:
    """`token` if it is 16..256 printable ASCII characters without spaces; SpecError naming `where` otherwise."""
    from sluice.errors import SpecError

    if not isinstance(token, str) or not 16 <= len(token) <= TOKEN_MAX_CHARS or not all(
            33 <= ord(c) < 127 for c in token):
        raise SpecError(f"{where}: a run token must be 16 to {TOKEN_MAX_CHARS} printable ASCII characters "
                        "without spaces (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return token


def read_token_file(path: str) -> str:
    """The token in `path` (one line); refuses a file of another user, one other users can read, a link, a
    FIFO or a folder (`fsutil.read_secret_file`), or a malformed token: SpecError naming the file."""
    from sluice.errors import SpecError
    from sluice.fsutil import read_secret_file

    raw = read_secret_file(path, "token file", TOKEN_MAX_CHARS + 2)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SpecError(f"token file {path}: not ASCII text") from None
    return check_token(text, f"token file {path}")


def token_matches(expected: str, given: Any) -> bool:
    """Constant-time comparison of the run token with what a request carried."""
    import hmac

    if not isinstance(given, str) or len(given) > TOKEN_MAX_CHARS:
        return False
    return hmac.compare_digest(expected.encode("ascii"), given.encode("utf-8", "replace"))
