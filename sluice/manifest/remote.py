"""Remote objects through fsspec: `gs://`, `az://` and `abfs://`, `hf://`, `http://` and `https://`.

`s3://` keeps its pyarrow path (storage.py); every other remote scheme goes
through one fsspec filesystem per scheme, which this module builds with bounded
timeouts and wraps so that every failure is a SluiceError naming the object and
the cause. The filesystems themselves are optional extras:

| scheme            | fsspec filesystem  | package          | extra              |
| ----------------- | ------------------ | ---------------- | ------------------ |
| `gs://`           | gcsfs              | gcsfs            | `sluice[gcs]`      |
| `az://`, `abfs://` | adlfs             | adlfs            | `sluice[azure]`    |
| `hf://`           | HfFileSystem       | huggingface_hub  | `sluice[hfhub]`    |
| `http(s)://`      | HTTPFileSystem     | aiohttp          | `sluice[http]`     |

Listing (what `manifest freeze` needs): gs/az/hf list and glob like a folder
tree; http(s) cannot list, so each object must be named by its own URL (its
size is the response's Content-Length).

Bounds: `SLUICE_REMOTE_TIMEOUT_S` (default 30 s, read at call time) limits
connecting and each wait for bytes (http: aiohttp's connect and sock_read;
gs: gcsfs' requests_timeout; az: adlfs' connection and read timeouts; hf:
huggingface_hub's own `HF_HUB_DOWNLOAD_TIMEOUT`). Tries are the caller's:
the node cache retries a fill `1 + retries` times with backoff.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Any

from sluice.errors import ManifestError, MissingExtra, ObjectMissing, SluiceError, SourceReadError

TIMEOUT_ENV = "SLUICE_REMOTE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
BLOCK_BYTES = 8 << 20  # one ranged GET: big enough that per-request cost vanishes, small enough to retry


@dataclass(frozen=True)
class Scheme:
    protocol: str  # fsspec's name for it
    package: str  # the module that implements it
    extra: str  # `pip install 'sluice[extra]'`
    lists: bool  # can list a folder / expand a glob


SCHEMES: dict[str, Scheme] = {
    "gs": Scheme("gs", "gcsfs", "gcs", True),
    "az": Scheme("az", "adlfs", "azure", True),
    "abfs": Scheme("abfs", "adlfs", "azure", True),
    "hf": Scheme("hf", "huggingface_hub", "hfhub", True),
    "http": Scheme("http", "aiohttp", "http", False),
    "https": Scheme("https", "aiohttp", "http", False),
}

_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$", re.DOTALL)
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f\\]")


def scheme_of(location: str) -> str | None:
    """The scheme of a fsspec location (`gs`, `az`, `abfs`, `hf`, `http`, `https`), else None."""
    m = _URL.match(location)
    return m.group(1) if m and m.group(1) in SCHEMES else None


def has_magic(url: str) -> bool:
    """Whether the path part of a listable URL is a glob (`*`, `?`, `[`)."""
    return any(c in url.split("://", 1)[-1] for c in "*?[")


def check_url(url: str, where: str, error: type[SluiceError] = ManifestError) -> str:
    """`url` if it is a well-formed location of a known scheme; raises `error` naming `where` otherwise.

    Refused: no host/bucket, control characters, spaces or backslashes, a `#fragment`, `.`/`..`
    path segments (literal or %-encoded: a server may resolve them out of an allowed prefix). A `?`
    is a query string in http(s), a glob character elsewhere."""
    scheme = scheme_of(url)
    if scheme is None:
        raise error(f"{where}: {url!r:.200} is not a URL of a known scheme ({', '.join(sorted(SCHEMES))}, s3)")
    rest = url.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    why = ""
    if not netloc:
        why = "it names no host, bucket or container"
    elif _BAD_CHARS.search(url):
        why = "it holds a space, a control character or a backslash"
    elif "#" in url:
        why = "it holds a #fragment"
    else:
        segments = path.split("?", 1)[0].split("/") if scheme.startswith("http") else path.split("/")
        if any(s.lower().replace("%2e", ".") in (".", "..") for s in segments):
            why = "it holds a '.' or '..' path segment"
    if why:
        raise error(f"{where}: {url!r:.200} is not a usable {scheme}:// location: {why}")
    return url


def timeout_s() -> float:
    """`SLUICE_REMOTE_TIMEOUT_S` (seconds, > 0), read now; ManifestError naming the variable if malformed."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 86400:
        raise ManifestError(f"environment {TIMEOUT_ENV}={raw!r}: expected seconds, a number in (0, 86400)")
    return value


def missing(scheme: str, where: str, exc: BaseException | None = None) -> MissingExtra:
    """The error for a scheme whose package is not installed: names the scheme, package and extra."""
    spec = SCHEMES[scheme]
    cause = f" ({exc})" if exc is not None else ""
    return MissingExtra(f"{where}: reading {scheme}:// locations needs the optional package {spec.package!r}, "
                        f"which is not installed{cause}; install it with: pip install 'sluice[{spec.extra}]'")


def _kwargs(scheme: str, timeout: float) -> dict[str, Any]:
    """Constructor arguments that bound each scheme's waits (see the module docstring)."""
    if scheme in ("http", "https"):
        import aiohttp

        # total=None: a big object may take long; what must not happen is a wait with no bytes.
        bound = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout, sock_read=timeout)
        return {"block_size": BLOCK_BYTES, "client_kwargs": {"timeout": bound}}
    if scheme == "gs":
        return {"requests_timeout": timeout}
    if scheme in ("az", "abfs"):
        return {"connection_timeout": int(max(1, timeout)), "read_timeout": int(max(1, timeout))}
    return {}


def filesystem(scheme: str, where: str) -> Any:
    """The fsspec filesystem for `scheme` (cached by fsspec per process and arguments).

    Raises MissingExtra naming the scheme and the extra when its package is not installed."""
    timeout = timeout_s()
    try:
        import fsspec

        return fsspec.filesystem(SCHEMES[scheme].protocol, **_kwargs(scheme, timeout))
    except ImportError as exc:
        raise missing(scheme, where, exc) from exc


def require(schemes: set[str], where: str) -> None:
    """Raise MissingExtra if the package of any of `schemes` (fsspec schemes; others ignored) is missing."""
    for scheme in sorted(s for s in schemes if s in SCHEMES):
        if not (_installed("fsspec") and (_installed(SCHEMES[scheme].package) or _registered(scheme))):
            raise missing(scheme, where)


def _registered(scheme: str) -> bool:
    """Whether fsspec already holds a filesystem class for `scheme` (imported, or registered by the user)."""
    from fsspec.registry import registry

    return SCHEMES[scheme].protocol in registry


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a cloud SDK's import costs seconds)."""
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are refused
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def describe(exc: BaseException) -> str:
    """A one-line cause: the exception and what it was raised from (fsspec wraps, e.g. a timeout in
    FileNotFoundError after its HEAD and GET both failed)."""
    parts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(parts) < 4:
        seen.add(id(cur))
        text = " ".join(str(cur).split()) or "no message"  # one line: aiohttp's messages hold newlines
        status = getattr(cur, "status", None)
        parts.append(f"{type(cur).__name__}{f' HTTP {status}' if isinstance(status, int) else ''}: {text[:200]}")
        cur = cur.__cause__ or cur.__context__
    return "; caused by ".join(parts)


def _not_found(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    while cur is not None:
        if getattr(cur, "status", None) == 404:
            return True
        cur = cur.__cause__
    return isinstance(exc, FileNotFoundError) and exc.__cause__ is None


def _timed_out(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, TimeoutError):  # asyncio's and fsspec's FSTimeoutError are TimeoutErrors
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _fail(url: str, doing: str, exc: BaseException) -> SourceReadError:
    if _timed_out(exc):
        return SourceReadError(f"object {url}: {doing} timed out: the store sent nothing for {timeout_s():g} s "
                               f"({TIMEOUT_ENV}) ({describe(exc)})")
    if _not_found(exc):
        return ObjectMissing(f"object {url}: not found in the store ({doing}: {describe(exc)})")
    return SourceReadError(f"object {url}: {doing} failed ({describe(exc)})")


def info(url: str) -> dict[str, Any]:
    """fsspec's info of one object: size (int), type and what the store reports (ETag, ...)."""
    scheme = scheme_of(url) or ""
    fs = filesystem(scheme, f"object {url}")
    try:
        found = fs.info(url)
    except SluiceError:
        raise
    except Exception as exc:  # the store's library raises its own kinds (aiohttp, azure, google)
        raise _fail(url, "asking for its size", exc) from exc
    final = found.get("url")
    if scheme.startswith("http") and isinstance(final, str) and final != url:
        # The allowed roots are checked on the URL named; bytes from wherever it redirects would
        # bypass them, so reads never follow a redirect (open_remote) and this refuses it up front.
        raise SourceReadError(f"object {url}: the server redirects it to {final}; sluice reads only the URL "
                              f"named (the one --allow-root is checked on), never a redirect: name {final} instead")
    if found.get("type", "file") != "file":
        raise SourceReadError(f"object {url}: is a folder, not an object")
    if not isinstance(found.get("size"), int):
        raise SourceReadError(f"object {url}: the store reports no size (no Content-Length); "
                              "sluice needs each object's size to verify it")
    return found


def etag_of(details: dict[str, Any]) -> str | None:
    value = details.get("ETag") or details.get("etag")
    return str(value).strip('"') or None if value else None


def list_alias(url: str, suffixes: tuple[str, ...], fmt: str, where: str) -> list[tuple[str, int]]:
    """(url, size) of every object `url` names for freeze: the object itself, every object under a
    folder (with one of `suffixes`), or every object a glob matches. http(s) cannot list: a glob or a
    folder URL is refused, naming what to write instead."""
    scheme = scheme_of(url) or ""
    check_url(url, where)
    if not SCHEMES[scheme].lists:
        if has_magic(url.split("?", 1)[0]) or url.split("?", 1)[0].endswith("/"):
            raise ManifestError(f"{where}: {scheme}:// cannot be listed, so {url!r} (a glob or a folder) cannot "
                                "be expanded; name each object by its own URL in `paths`")
        return [(url, int(info(url)["size"]))]
    fs = filesystem(scheme, where)
    try:
        if has_magic(url):
            found = fs.glob(url, detail=True)
            files = {p: i for p, i in found.items() if i.get("type") == "file"}
            if not files:
                raise ManifestError(f"{where}: glob {url} matches no objects")
        else:
            one = fs.info(url)
            if one.get("type") == "file":
                return [(url, int(one["size"]))]
            found = fs.find(url, detail=True)
            files = {p: i for p, i in found.items() if p.lower().endswith(suffixes)}
            if not files:
                raise ManifestError(f"{where}: {url} holds no {fmt} objects ({', '.join(suffixes)})")
    except SluiceError:
        raise
    except FileNotFoundError as exc:
        raise ManifestError(f"{where}: no such object or folder {url}") from exc
    except Exception as exc:  # the store's library raises its own kinds
        raise ManifestError(f"{where}: cannot list {url} ({describe(exc)})") from exc
    out = []
    for path, detail in files.items():
        full = path if "://" in path else f"{scheme}://{path.lstrip('/')}"
        if not isinstance(detail.get("size"), int):
            raise ManifestError(f"{where}: the store reports no size for {full}")
        out.append((check_url(full, where), int(detail["size"])))
    return sorted(out)


class RemoteReader(io.RawIOBase):
    """A seekable reader over a fsspec file whose every failure is a SourceReadError naming the object.

    `metadata()` gives the store's ETag the way pyarrow's S3 stream does (formats._store_identity)."""

    def __init__(self, url: str, handle: Any, details: dict[str, Any]) -> None:
        super().__init__()
        self.url = url
        self._f = handle
        self._details = details

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def metadata(self) -> dict[str, str]:
        etag = etag_of(self._details)
        return {"ETag": etag} if etag else {}

    def _do(self, doing: str, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except SluiceError:
            raise
        except Exception as exc:  # aiohttp's payload and timeout errors, the store library's own
            raise _fail(self.url, f"{doing} at byte {self._safe_tell()}", exc) from exc

    def _safe_tell(self) -> int:
        try:
            return int(self._f.tell())
        except Exception:  # a closed or broken handle: the position is only for the message
            return -1

    def read(self, n: int | None = -1) -> bytes:
        return self._do("reading", self._f.read, -1 if n is None else n)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._do("seeking", self._f.seek, offset, whence)

    def tell(self) -> int:
        return int(self._f.tell())

    def close(self) -> None:
        if not self.closed:
            try:
                self._f.close()
            except Exception:  # closing a read-only handle: nothing of ours is lost
                pass
        super().close()


def open_remote(url: str) -> RemoteReader:
    """Open `url` for reading (ranged reads of BLOCK_BYTES where the store allows them)."""
    scheme = scheme_of(url) or ""
    check_url(url, f"object {url}", SourceReadError)
    fs = filesystem(scheme, f"object {url}")
    details = info(url)
    try:
        # readahead: sequential reads fetch each byte once (fsspec's default "bytes" cache fetched one
        # 8 MiB range twice in 64 MiB read 256 KiB at a time: 9 requests instead of 8).
        if scheme.startswith("http"):  # a redirect is not followed: its body fails the digest, nothing else read
            handle = fs.open(url, "rb", block_size=BLOCK_BYTES, cache_type="readahead", size=details["size"],
                             allow_redirects=False)
        else:
            handle = fs.open(url, "rb", block_size=BLOCK_BYTES, cache_type="readahead")
    except SluiceError:
        raise
    except Exception as exc:  # the store's library raises its own kinds
        raise _fail(url, "opening", exc) from exc
    return RemoteReader(url, handle, details)
