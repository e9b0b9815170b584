"""What `sluice.stream(...)` and `sluice run` are given, resolved: files, formats, weights, folders.

Paths, folders and globs (or a `mixture` of them by name; a folder is walked
as freeze walks it, hidden entries skipped) become `Part`s: one
manifest source per named source and format (jsonl, with .gz/.zst from the
suffix, and parquet), the absolute files each resolves to, the user's weight as
the manifest's decimal string. A bad argument is a `SpecError` naming the
argument and its value (`bad_argument`). `prepare` (runprep.py) turns the parts
into a dataset spec, a frozen manifest and a run spec.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from sluice.errors import SluiceError, SpecError

# Formats a folder or glob is read as; `.sltok` shards and webdataset tars go through a dataset spec.
STREAM_FORMATS = ("jsonl", "parquet")


@dataclass(frozen=True)
class Part:
    """One manifest source: the files of one format of one named source."""

    name: str
    fmt: str
    aliases: tuple[str, ...]  # absolute paths/globs written to the dataset spec
    files: tuple[str, ...]  # the absolute files they resolve to (for stats and training)
    weight: str  # the user's weight of the whole named source (normalized)
    split: bool  # one of several formats of its source: the weight is split by records

    @property
    def source(self) -> str:
        """The name the caller gave (`NAME` of `NAME.jsonl`)."""
        return self.name.rsplit(".", 1)[0] if self.split else self.name


def bad_argument(argument: str, value: Any, expected: str) -> SpecError:
    return SpecError(f"sluice.stream: {argument}={value!r:.200}: {expected}")


def positive_int(argument: str, value: Any, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        bound = f" no larger than {upper}" if upper is not None else ""
        raise bad_argument(argument, value, f"expected a positive integer{bound}")
    return value


def weight_of(name: str, value: Any) -> str:
    """A weight as the manifest's decimal string; floats through their shortest repr (0.7 -> "0.7")."""
    from sluice.manifest.fields import normalize_weight

    argument = f"mixture[{name!r}] weight"
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise bad_argument(argument, value, "expected a non-negative number or decimal string such as \"0.7\"")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_argument(argument, value, "expected a finite number")
    text = str(value)
    try:
        if isinstance(value, (float, Decimal)):
            text = format(Decimal(text), "f")
        return normalize_weight(text, argument)
    except (InvalidOperation, SluiceError) as exc:
        raise bad_argument(argument, value, "expected a non-negative number or decimal string such as \"0.7\"") from exc



def format_of(path: str) -> str | None:
    from sluice.manifest import formats

    low = path.lower()
    for fmt in STREAM_FORMATS:
        if low.endswith(formats.FORMAT_SUFFIXES[fmt]):
            return fmt
    return None


def suffixes() -> str:
    from sluice.manifest import formats

    return ", ".join(s for fmt in STREAM_FORMATS for s in formats.FORMAT_SUFFIXES[fmt])


def path_list(argument: str, value: Any) -> list[str]:
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, str)) or not value:
        raise bad_argument(argument, value, "expected a path, a glob, or a non-empty list of them")
    out = []
    for item in value:
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
            raise bad_argument(argument, item, "expected a path or glob string")
        out.append(os.path.abspath(os.path.expanduser(os.fspath(item))))
    return out


def resolve_entry(argument: str, entry: str) -> dict[str, tuple[list[str], list[str]]]:
    """{format: (aliases, files)} for one path, folder or glob the caller gave."""
    from sluice.manifest.freeze import walk_folder  # the folder walk freeze itself does: same files, same order

    by_fmt: dict[str, tuple[list[str], list[str]]] = {}
    if any(c in entry for c in "*?["):
        matches = sorted(glob.glob(entry, recursive=True))
        if not matches:
            raise bad_argument(argument, entry, "the glob matches no file")
        files: list[str] = []
        for m in matches:
            if os.path.isdir(m):
                files += [f for fmt in STREAM_FORMATS for f in walk_folder(m, fmt)]
            else:
                files.append(m)
        fmts = {format_of(f) for f in files}
        if None in fmts:
            odd = next(f for f in files if format_of(f) is None)
            raise bad_argument(argument, entry, f"the glob matches {odd}, which is none of {suffixes()}")
        for f in sorted(files):
            by_fmt.setdefault(format_of(f) or "", ([], []))[1].append(f)
        whole = len(by_fmt) == 1 and all(os.path.isfile(m) for m in matches)
        for fmt, (aliases, found) in by_fmt.items():
            aliases += [entry] if whole else found  # a glob of one format stays the alias freeze records
        return by_fmt
    if os.path.isdir(entry):
        for fmt in STREAM_FORMATS:
            found = walk_folder(entry, fmt)
            if found:
                by_fmt[fmt] = ([entry], found)
        if not by_fmt:
            raise bad_argument(argument, entry, f"the folder holds no data file ({suffixes()})")
        return by_fmt
    if not os.path.exists(entry):
        raise bad_argument(argument, entry, "no such file or folder")
    fmt = format_of(entry)
    if fmt is None or not os.path.isfile(entry):
        raise bad_argument(argument, entry, f"not a data file: expected a folder, a glob or a file ending in {suffixes()}")
    return {fmt: ([entry], [entry])}


def parts_of(paths: Any, mixture: Mapping[str, Any] | None) -> list[Part]:
    if mixture is None:
        if paths is None:
            raise SpecError("sluice.stream: give the data: paths (a folder, glob, file or list) or mixture=")
        sources: list[tuple[str, str, Any]] = [("data", "1", paths)]
        argument = "paths"
    else:
        if paths is not None:
            raise bad_argument("paths", paths, "give either paths or mixture= (one source, or several), not both")
        if not isinstance(mixture, Mapping) or not mixture:
            raise bad_argument("mixture", mixture, "expected a non-empty mapping {name: (paths_or_glob, weight)}")
        sources = []
        for name, value in mixture.items():
            if not isinstance(name, str) or not name or "." in name or not name.isprintable():
                raise bad_argument("mixture", name, "source names must be non-empty printable strings without '.'")
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise bad_argument(f"mixture[{name!r}]", value, "expected a pair (paths_or_glob, weight)")
            sources.append((name, weight_of(name, value[1]), value[0]))
        argument = "mixture"
    parts: list[Part] = []
    for name, weight, raw in sources:
        where = argument if mixture is None else f"mixture[{name!r}] paths"
        # dicts as ordered sets: a folder of 100k files is merged in linear time
        merged: dict[str, tuple[dict[str, None], dict[str, None]]] = {}
        for entry in path_list(where, raw):
            for fmt, (aliases, files) in resolve_entry(where, entry).items():
                merged.setdefault(fmt, ({}, {}))
                merged[fmt][0].update(dict.fromkeys(aliases))
                merged[fmt][1].update(dict.fromkeys(files))
        split = len(merged) > 1
        for fmt in STREAM_FORMATS:
            if fmt in merged:
                parts.append(Part(f"{name}.{fmt}" if split else name, fmt, tuple(merged[fmt][0]),
                                   tuple(merged[fmt][1]), weight, split))
    if all(Decimal(p.weight) == 0 for p in parts):
        raise bad_argument("mixture", dict(mixture or {}), "all weights are zero; at least one must be positive")
    return parts


def default_workdir(parts: list[Part]) -> Path:
    """`.sluice/` in the first folder given, or in the folder of the first file or glob."""
    first = parts[0].aliases[0]
    magic = [first.index(c) for c in "*?[" if c in first]
    if magic:
        return Path(os.path.dirname(first[: min(magic)])) / ".sluice"  # "/x/data/part-*" -> /x/data
    return Path(first if os.path.isdir(first) else os.path.dirname(first)) / ".sluice"


def roots_of(parts: list[Part]) -> tuple[str, ...]:
    """The folders given (or holding the files given), none inside another."""
    found = {os.path.realpath(a) for p in parts for a in p.aliases if os.path.isdir(a)}
    found |= {os.path.dirname(os.path.realpath(f)) for p in parts for f in p.files}
    kept: list[str] = []
    for root in sorted(found, key=len):  # a folder before anything inside it
        if not any(root.startswith(k.rstrip(os.sep) + os.sep) for k in kept):
            kept.append(root)
    return tuple(sorted(kept))


def file_stat(path: str) -> list[Any]:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
