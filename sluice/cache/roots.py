"""Where a manifest may make the cache read from: the operator's allowed roots.

A manifest names its objects' locations, and `cache warm` or the daemon copy
whatever they name into the cache (and into quarantine when the digest does
not match), so a hostile manifest could otherwise copy any file the process
can read (`/etc/passwd`, a 0600 key). Every location must therefore lie within
an allowed root: a local folder (compared after resolving symbolic links, so
a link inside a root cannot point out of it) or a URL prefix of a remote store
(`s3://bucket/prefix/`, `gs://bucket/prefix/`, `az://container/prefix/`,
`abfs://...`, `hf://datasets/org/name/`, `https://host/path/`, `http://...`),
compared as text after a "/" is added: `https://host` allows
`https://host/...`, never `https://host.evil/...`. A remote location with a
`.`/`..` segment (literal or %-encoded), a backslash or a fragment is refused
whatever the roots (remote.check_url): a server could resolve it out of the prefix.

The check that counts is on what was opened (`check_opened`: the path the
kernel gives for the open descriptor, /proc/self/fd/N), not only on the name
before opening it: a link swapped between a check and an open could otherwise
bring an outside file's bytes in (into quarantine, as a digest mismatch).

Default roots (no `--allow-root`): the manifest's own folder only. The remote
prefixes a manifest names are not allowed by default (they would be whatever
the manifest says, with the node's credentials): remote objects need an explicit
`--allow-root s3://bucket/prefix/` (or https://host/path/, gs://..., ...).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.errors import LocationRefused, SluiceError
from sluice.manifest import remote
from sluice.manifest.model import Manifest
from sluice.manifest.storage import is_remote, scheme

_SHOWN = 5  # refused objects named in one error; the rest are counted
_EXAMPLE = "s3://bucket/prefix/, https://host/path/"


@dataclass(frozen=True)
class AllowedRoots:
    """Local folders (real paths) and remote URL prefixes (ending in "/") a location may lie within."""

    folders: tuple[str, ...]
    prefixes: tuple[str, ...] = ()

    @classmethod
    def of(cls, roots: Iterable[str]) -> AllowedRoots:
        """From `--allow-root` values: URL prefixes as given (a "/" is added), folders resolved."""
        folders: list[str] = []
        prefixes: list[str] = []
        for root in roots:
            if is_remote(root):
                prefixes.append(root if root.endswith("/") else root + "/")
            else:
                folders.append(os.path.realpath(root))
        return cls(tuple(dict.fromkeys(folders)), tuple(dict.fromkeys(prefixes)))

    def allows(self, location: str) -> bool:
        """True if the resolved `location` lies within one of the roots."""
        if is_remote(location):
            if "/../" in location or location.endswith("/.."):
                return False
            if not location.startswith("s3://"):
                try:
                    remote.check_url(location, "location")
                except SluiceError:
                    return False
            return any(location.startswith(p) for p in self.prefixes)
        return self._holds(os.path.realpath(location))

    def _holds(self, real: str) -> bool:
        """True if the resolved path `real` is one of the folders or lies within one."""
        return any(real == f or real.startswith(f.rstrip(os.sep) + os.sep) for f in self.folders)

    def check_opened(self, fd: int, location: str, what: str) -> None:
        """Raise LocationRefused unless the file open as `fd` (opened from the local `location`) lies
        within a root: the check is on the file opened, whatever a link pointed at when it was checked.

        The opened file's path is the kernel's (/proc/self/fd/N); where there is none, `location` is
        resolved again and must name the very file (device and inode) that is open."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        if not real.startswith(os.sep):  # no /proc (or not a path): the same file as the name resolves to
            real = os.path.realpath(location)
            try:
                named, opened = os.stat(real), os.fstat(fd)
            except OSError:
                named = opened = None
            if named is None or opened is None or (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
                raise LocationRefused(f"{what}: location {location!r} changed while it was opened; refused")
        if not self._holds(real):
            raise LocationRefused(
                f"{what}: location {location!r} opened {real!r}, outside the allowed roots ({self.describe()}) "
                "(a link changed after the check?); nothing was read"
            )

    def describe(self) -> str:
        roots = [*self.folders, *self.prefixes]
        return ", ".join(roots) if roots else "(none)"

    def check(self, location: str, what: str) -> None:
        """Raise LocationRefused naming `what`, the location and the roots if it lies outside."""
        if not self.allows(location):
            raise LocationRefused(
                f"{what}: location {location!r} is outside the allowed roots ({self.describe()}); "
                f"pass --allow-root FOLDER (or a URL prefix: {_EXAMPLE}) to allow it"
            )


def default_roots(manifest: Manifest) -> AllowedRoots:
    """The manifest's own folder, only: never a place the manifest itself names (s3 prefixes included)."""
    return AllowedRoots.of([manifest.base_dir or "."])


def roots_for(manifest: Manifest, allow: Iterable[str] | None) -> AllowedRoots:
    """`--allow-root` values if any were given, else the manifest's defaults."""
    given = list(allow or ())
    return AllowedRoots.of(given) if given else default_roots(manifest)


def check_manifest(manifest: Manifest, roots: AllowedRoots, where: str = "manifest") -> None:
    """Refuse a manifest with any object outside `roots`, naming the objects and the roots, or one whose
    objects need an optional package that is not installed (MissingExtra naming the scheme and extra)."""
    refused = [
        (src.name, obj.location, manifest.resolve(obj.location))
        for src in manifest.sources
        for obj in src.objects
        if not roots.allows(manifest.resolve(obj.location))
    ]
    if refused:
        shown = "; ".join(f"source {s!r} object {loc!r} (resolves to {real!r})" for s, loc, real in refused[:_SHOWN])
        more = f"; and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else ""
        raise LocationRefused(
            f"{where}: {len(refused)} object location(s) outside the allowed roots ({roots.describe()}): "
            f"{shown}{more}; pass --allow-root FOLDER (or a URL prefix: {_EXAMPLE}) to allow them"
        )
    schemes = {scheme(manifest.resolve(obj.location)) for src in manifest.sources for obj in src.objects}
    remote.require({s for s in schemes if s}, where)  # a missing extra now, not at the first miss
