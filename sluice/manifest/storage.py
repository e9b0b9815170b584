"""Where object bytes come from: local paths and remote URIs.

Local files are opened directly; `s3://bucket/key` goes through pyarrow's
filesystem layer; `gs://`, `az://`, `abfs://`, `hf://`, `http://` and `https://`
go through fsspec (remote.py: optional extras, bounded timeouts). Every caller
asks this module (`is_remote`, `open_input`, `open_random`, `object_info`), so a
scheme added here is read the same way by freeze, verify, the cache fill and
pretokenize. S3 options are explicit (`S3Options`), or read from the
environment *at call time* (never at import): ``SLUICE_S3_ENDPOINT`` (e.g.
``http://127.0.0.1:5000``), ``SLUICE_S3_REGION``, and the usual
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import IO, Any
from urllib.parse import urlparse

from sluice.errors import ManifestError, ObjectMissing, SourceReadError
from sluice.manifest import remote


@dataclass(frozen=True, kw_only=True)
class S3Options:
    endpoint: str | None = None  # "http://127.0.0.1:5000"; None = AWS default
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None

    @classmethod
    def from_env(cls) -> S3Options:
        return cls(
            endpoint=os.environ.get("SLUICE_S3_ENDPOINT") or None,
            region=os.environ.get("SLUICE_S3_REGION", "us-east-1"),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        )


def is_s3(location: str) -> bool:
    return location.startswith("s3://")


def is_remote(location: str) -> bool:
    """True for a location read from a store (s3 or a fsspec scheme), False for a local path."""
    return is_s3(location) or remote.scheme_of(location) is not None


def scheme(location: str) -> str | None:
    """`s3`, a fsspec scheme (remote.SCHEMES) or None for a local path."""
    return "s3" if is_s3(location) else remote.scheme_of(location)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` -> ("bucket", "key"); raises ManifestError on a malformed URI."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ManifestError(f"{uri!r} is not an s3://bucket/key URI")
    return parsed.netloc, parsed.path.lstrip("/")


def s3_filesystem(options: S3Options | None = None) -> Any:
    """A pyarrow S3FileSystem for `options` (or the environment)."""
    from pyarrow import fs as pafs

    opts = options or S3Options.from_env()
    kwargs: dict[str, Any] = {"region": opts.region}
    if opts.endpoint:
        parsed = urlparse(opts.endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    if opts.access_key:
        kwargs["access_key"] = opts.access_key
        kwargs["secret_key"] = opts.secret_key or ""
    return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says about an object right now."""

    location: str
    size: int
    etag: str | None = None
    version: str | None = None


def open_input(location: str, options: S3Options | None = None) -> IO[bytes]:
    """Open `location` for streaming reads; raises SourceReadError naming it."""
    if is_s3(location):
        bucket, key = split_s3(location)
        try:
            # compression=None: pyarrow would otherwise gunzip ".gz" keys by suffix,
            # and digests are over the stored bytes.
            return s3_filesystem(options).open_input_stream(f"{bucket}/{key}", compression=None)
        except (OSError, FileNotFoundError) as exc:
            raise SourceReadError(f"object {location}: cannot open ({exc})") from exc
    if remote.scheme_of(location) is not None:
        return remote.open_remote(location)  # type: ignore[return-value]
    try:
        return open(location, "rb")
    except FileNotFoundError as exc:
        raise SourceReadError(f"object {location}: no such file") from exc
    except PermissionError as exc:
        raise SourceReadError(f"object {location}: permission denied") from exc
    except OSError as exc:
        raise SourceReadError(f"object {location}: cannot open ({exc.strerror})") from exc


def s3_head(location: str, options: S3Options | None = None) -> ObjectInfo:
    """Size, ETag and version of an S3 object (pyarrow exposes size; ETag via metadata)."""
    bucket, key = split_s3(location)
    fs = s3_filesystem(options)
    info = fs.get_file_info(f"{bucket}/{key}")
    from pyarrow import fs as pafs

    if info.type != pafs.FileType.File:
        raise ObjectMissing(f"object {location}: not found in the store")
    etag = version = None
    try:
        with fs.open_input_stream(f"{bucket}/{key}", compression=None) as stream:
            meta = stream.metadata()
        # pyarrow's metadata keys are str (values bytes); accept bytes keys too.
        def _meta(*names: str) -> str:
            for name in names:
                for key in (name, name.encode()):
                    value = meta.get(key)
                    if value:
                        return value.decode() if isinstance(value, bytes) else str(value)
            return ""

        etag = _meta("ETag", "etag").strip('"') or None
        version = _meta("VersionId", "x-amz-version-id") or None
    except (OSError, AttributeError):
        pass
    return ObjectInfo(location, int(info.size), etag, version)


def open_random(location: str, options: S3Options | None = None) -> Any:
    """A seekable file of a remote `location` (what a parquet reader needs); SourceReadError naming it."""
    if is_s3(location):
        bucket, key = split_s3(location)
        try:
            return s3_filesystem(options).open_input_file(f"{bucket}/{key}")
        except OSError as exc:
            raise SourceReadError(f"object {location}: cannot open ({exc})") from exc
    return remote.open_remote(location)


def object_info(location: str, options: S3Options | None = None) -> ObjectInfo:
    """What the store says about a remote object now (size, ETag); SourceReadError if it is not there."""
    if is_s3(location):
        return s3_head(location, options)
    details = remote.info(location)
    return ObjectInfo(location, int(details["size"]), remote.etag_of(details))
