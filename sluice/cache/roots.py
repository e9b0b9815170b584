"""Where a manifest may make the cache read from: the operator's allowed roots.

A manifest names its objects' locations, and `cache warm` or the daemon copy
whatever they name into the cache (and into quarantine when the digest does
not match), so a hostile manifest could otherwise copy any file the process
can read (`/etc/passwd`, a 0600 key). Every location must therefore lie within
an allowed root: a local folder (compared after resolving symbolic links, so
a link inside a root cannot point out of it) or an `s3://bucket/prefix/`.

Default roots (no `--allow-root`): the manifest's own folder, and the s3
prefixes (each object's parent "folder") the manifest names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.errors import LocationRefused
from sluice.manifest.model import Manifest

_SHOWN = 5  # refused objects named in one error; the rest are counted


@dataclass(frozen=True)
class AllowedRoots:
    """Local folders (real paths) and s3 prefixes (ending in "/") a location may lie within."""

    folders: tuple[str, ...]
    prefixes: tuple[str, ...] = ()

    @classmethod
    def of(cls, roots: Iterable[str]) -> AllowedRoots:
        """From `--allow-root` values: s3:// prefixes as given (a "/" is added), folders resolved."""
        folders: list[str] = []
        prefixes: list[str] = []
        for root in roots:
            if root.startswith("s3://"):
                prefixes.append(root if root.endswith("/") else root + "/")
            else:
                folders.append(os.path.realpath(root))
        return cls(tuple(dict.fromkeys(folders)), tuple(dict.fromkeys(prefixes)))

    def allows(self, location: str) -> bool:
        """True if the resolved `location` lies within one of the roots."""
        if location.startswith("s3://"):
            if "/../" in location or location.endswith("/.."):
                return False
            return any(location.startswith(p) for p in self.prefixes)
        real = os.path.realpath(location)
        return any(real == f or real.startswith(f.rstrip(os.sep) + os.sep) for f in self.folders)

    def describe(self) -> str:
        roots = [*self.folders, *self.prefixes]
        return ", ".join(roots) if roots else "(none)"

    def check(self, location: str, what: str) -> None:
        """Raise LocationRefused naming `what`, the location and the roots if it lies outside."""
        if not self.allows(location):
            raise LocationRefused(
                f"{what}: location {location!r} is outside the allowed roots ({self.describe()}); "
                "pass --allow-root FOLDER (or s3://bucket/prefix/) to allow it"
            )


def default_roots(manifest: Manifest) -> AllowedRoots:
    """The manifest's own folder and the s3 prefixes of the objects it names."""
    prefixes = [
        obj.location.rsplit("/", 1)[0] + "/"
        for src in manifest.sources
        for obj in src.objects
        if obj.location.startswith("s3://")
    ]
    return AllowedRoots.of([manifest.base_dir or ".", *prefixes])


def roots_for(manifest: Manifest, allow: Iterable[str] | None) -> AllowedRoots:
    """`--allow-root` values if any were given, else the manifest's defaults."""
    given = list(allow or ())
    return AllowedRoots.of(given) if given else default_roots(manifest)


def check_manifest(manifest: Manifest, roots: AllowedRoots, where: str = "manifest") -> None:
    """Refuse a manifest with any object outside `roots`, naming the objects and the roots."""
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
            f"{shown}{more}; pass --allow-root FOLDER (or s3://bucket/prefix/) to allow them"
        )
