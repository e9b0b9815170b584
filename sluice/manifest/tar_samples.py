"""Webdataset tar streams: samples (members sharing a key) validated from their headers.

Members are checked before their data is read: absolute names, `..`
components, links, devices and oversized members are refused; the stream must
end with a real end-of-archive block (tarfile alone stops quietly at a cut or
garbled header, which would freeze a truncated archive as valid with fewer
records). The key/suffix rule is webdataset's.
"""

from __future__ import annotations

import posixpath
import tarfile
from typing import Any

from sluice.errors import SourceReadError
from sluice.manifest.decode import DecodedReader

MAX_MEMBER_BYTES = 1 << 30  # refuse tar members larger than 1 GiB
MAX_TAR_MEMBERS = 10_000_000
_READ = 8 << 20


def member_key(name: str, where: str, index: int) -> tuple[str, str]:
    """Validate a tar member name and split it into (sample key, suffix)."""
    if name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        raise SourceReadError(f"{where}: tar member {index} {name!r}: absolute path refused")
    parts = name.split("/")
    if ".." in parts:
        raise SourceReadError(f"{where}: tar member {index} {name!r}: path traversal ('..') refused")
    base = posixpath.basename(name)
    if "." not in base.lstrip("."):
        raise SourceReadError(f"{where}: tar member {index} {name!r}: no suffix; cannot tell sample key from field")
    lead = len(base) - len(base.lstrip("."))
    dot = base.index(".", lead)
    prefix = name[: len(name) - len(base)]
    return prefix + base[:dot], base[dot + 1 :]


class _TarCut(Exception):
    """The archive ends inside a member header or without its end-of-archive block."""


class _StrictTarInfo(tarfile.TarInfo):
    """tarfile ends a stream quietly at a missing, partial or garbled header
    after the first member; a webdataset object must end with the zero block
    of a real end-of-archive marker, or it was truncated (fewer records)."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EmptyHeaderError as exc:
            raise _TarCut(f"ends at byte {tar.offset} after a member, without the end-of-archive blocks") from exc
        except tarfile.TruncatedHeaderError as exc:
            raise _TarCut(f"ends inside the member header at byte {tar.offset}") from exc
        except tarfile.InvalidHeaderError as exc:
            raise _TarCut(f"garbled member header at byte {tar.offset} ({exc})") from exc


def read_samples(
    src: Any, compression: str, where: str, text_field: str, check: str, collect: bool, max_line: int
) -> tuple[int, list[str] | None]:
    """(record count, texts if `collect`) of the tar stream read from `src` (a formats reader).

    Text members are read (and UTF-8 checked) when `collect` or `check == "full"`;
    a text member over `max_line` bytes is refused. Raises SourceReadError naming
    `where` and the member or sample at fault.
    """
    stream: Any = src if compression == "none" else DecodedReader(src, compression, where)
    texts: list[str] | None = [] if collect else None
    seen: set[str] = set()
    key: str | None = None
    has_text = False
    records = 0

    def close_sample() -> None:
        if key is not None and not has_text:
            raise SourceReadError(f"{where}: sample {key!r} (record {records - 1}) has no member with suffix {text_field!r}")

    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_StrictTarInfo) as tar:
            index = -1
            while (member := tar.next()) is not None:
                index += 1
                tar.members.clear()  # tarfile keeps every member it saw; a stream needs none of them
                if index >= MAX_TAR_MEMBERS:
                    raise SourceReadError(f"{where}: more than {MAX_TAR_MEMBERS} tar members")
                if member.isdir():
                    continue
                name = member.name
                if not member.isreg():
                    raise SourceReadError(f"{where}: tar member {index} {name!r}: not a regular file (links and devices refused)")
                if member.size > MAX_MEMBER_BYTES:
                    raise SourceReadError(f"{where}: tar member {index} {name!r}: {member.size} bytes exceeds {MAX_MEMBER_BYTES}")
                mkey, suffix = member_key(name, where, index)
                if mkey != key:
                    close_sample()
                    if mkey in seen:
                        raise SourceReadError(f"{where}: tar member {index} {name!r}: sample key {mkey!r} appears again after other samples")
                    seen.add(mkey)
                    key, has_text = mkey, False
                    records += 1
                if suffix == text_field:
                    if has_text:
                        raise SourceReadError(f"{where}: sample {mkey!r}: two members with suffix {text_field!r}")
                    has_text = True
                    if member.size > max_line:
                        raise SourceReadError(
                            f"{where}: sample {mkey!r} (record {records - 1}): member {name!r} is {member.size} bytes, "
                            f"longer than the document limit of {max_line}"
                        )
                    if texts is not None or check == "full":
                        fobj = tar.extractfile(member)
                        data = fobj.read() if fobj is not None else b""
                        try:
                            text = data.decode("utf-8")
                        except UnicodeDecodeError as exc:
                            raise SourceReadError(f"{where}: sample {mkey!r} (record {records - 1}): member {name!r} is not UTF-8") from exc
                        if texts is not None:
                            texts.append(text)
            close_sample()
    except _TarCut as exc:
        raise SourceReadError(f"{where}: truncated or damaged tar archive: {exc}") from exc
    except tarfile.TarError as exc:
        raise SourceReadError(f"{where}: not a valid tar archive ({exc})") from exc
    except EOFError as exc:
        raise SourceReadError(f"{where}: truncated tar archive ({exc})") from exc
    if stream is not src:
        while stream.read(_READ):  # decode to the end: a cut compressed stream is found here
            pass
    src.drain()  # hash the end-of-archive padding too
    return records, texts
