"""Reading small local input files (specs, manifests, states) without surprises.

Every user-named file is opened the same way: it must be a regular file (a
folder, FIFO or device such as /dev/zero is refused, so a read can neither hang
nor grow without end), it is read up to a stated byte limit, and parsing turns
every failure the standard library can raise (bad UTF-8, invalid TOML/JSON,
nesting deeper than the parser's recursion limit, integers beyond Python's
4300-digit conversion limit) into the caller's error class, naming the file.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from sluice.errors import SluiceError

MAX_SPEC_BYTES = 16 << 20  # dataset spec, run spec, data state file
MAX_MANIFEST_BYTES = 1 << 30  # a manifest of millions of objects is a few hundred MB


def read_input(path: str | os.PathLike[str], what: str, limit: int, error: type[SluiceError]) -> bytes:
    """Bytes of the regular file `path`, at most `limit` of them.

    Raises `error` naming `what` and the path when the file is missing, not a
    regular file, unreadable or larger than `limit`.
    """
    p = Path(path)
    where = f"{what} {p}"
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # O_NONBLOCK: a FIFO must not block open()
    except FileNotFoundError as exc:
        raise error(f"{where}: no such file") from exc
    except IsADirectoryError as exc:
        raise error(f"{where}: is a folder, expected a file") from exc
    except OSError as exc:
        raise error(f"{where}: cannot open ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{where}: is a folder, expected a file")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{where}: not a regular file (a FIFO, socket or device is refused)")
        if st.st_size > limit:
            raise error(f"{where}: {st.st_size} bytes, more than the limit of {limit}")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{where}: cannot read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(data) > limit:  # the file grew while being read
        raise error(f"{where}: more than the limit of {limit} bytes")
    return data


def decode_utf8(data: bytes, where: str, error: type[SluiceError]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc


def parse_toml(data: bytes, where: str, error: type[SluiceError]) -> dict[str, Any]:
    """Parse TOML bytes; every parser failure becomes `error` naming `where`."""
    text = decode_utf8(data, where, error)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: invalid TOML: {exc}") from exc
    except RecursionError as exc:
        raise error(f"{where}: invalid TOML: nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer beyond the 4300-digit conversion limit
        raise error(f"{where}: invalid TOML: {exc}") from exc


def not_json_hint(path: Path, data: bytes) -> str:
    """For `where`: why a .toml file given as a manifest is not JSON (a new user's first mix-up), else ''."""
    if path.suffix != ".toml" or data.lstrip()[:1] == b"{":
        return ""
    return (" (a TOML file, a dataset or run spec? The manifest is the JSON file "
            "`sluice manifest freeze DATASET.toml -o manifest.json` writes)")
