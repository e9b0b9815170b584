"""`sluice manifest verify`: re-hash a manifest's objects and report every change.

Each checked object is stat'ed (local) or HEAD'ed (s3) and re-hashed with
BLAKE3 in a thread pool. Problems are collected, not raised one by one, so a
single run names every missing object, size change and digest mismatch. The
tokenizer file (when the manifest has one) is checked the same way.
`--sample F` checks a deterministic subset: `ceil(F * n)` objects chosen by
`random.Random(seed)` over the manifest's object order. `checked` and `total`
count objects only; the tokenizer is reported apart (`tokenizer_checked`).
A store that cannot be reached makes its objects "unreadable" problems (exit 1),
never a crash.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import random
from dataclasses import dataclass
from typing import Any

from sluice.errors import ManifestError, MissingExtra, ObjectMissing, SourceReadError
from sluice.manifest.formats import hash_object
from sluice.manifest.model import Manifest
from sluice.manifest.storage import S3Options, is_remote, object_info


@dataclass(frozen=True)
class Problem:
    kind: str  # "missing" | "size" | "digest" | "unreadable"
    source: str
    location: str
    expected: str
    actual: str

    def __str__(self) -> str:
        what = {
            "missing": "missing object",
            "size": "size changed",
            "digest": "digest mismatch",
            "unreadable": "unreadable object",
        }[self.kind]
        return f"{what}: source {self.source!r} object {self.location}: expected {self.expected}, found {self.actual}"

    def to_obj(self) -> dict[str, str]:
        return {"kind": self.kind, "source": self.source, "location": self.location,
                "expected": self.expected, "actual": self.actual}


@dataclass(frozen=True)
class VerifyReport:
    dataset_id: str
    checked: int  # objects re-hashed (the tokenizer is not counted here)
    total: int  # objects in the manifest
    bytes: int
    problems: tuple[Problem, ...]
    tokenizer_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_obj(self) -> dict[str, Any]:
        return {"dataset_id": self.dataset_id, "ok": self.ok, "checked": self.checked, "total": self.total,
                "tokenizer_checked": self.tokenizer_checked, "bytes": self.bytes,
                "problems": [p.to_obj() for p in self.problems]}


def _check_one(path: str, source: str, location: str, size: int, digest: str, s3: S3Options | None,
               rehash: bool = True) -> Problem | None:
    try:
        if is_remote(path):
            actual_size = object_info(path, s3).size
        else:
            if not os.path.exists(path):
                return Problem("missing", source, location, f"{size} bytes", "no such file")
            actual_size = os.path.getsize(path)
    except ObjectMissing:
        return Problem("missing", source, location, f"{size} bytes", "not in the store")
    except MissingExtra:  # not a property of this object: every object of the scheme would say it
        raise
    except (OSError, ManifestError) as exc:  # store unreachable or timed out, credentials refused, malformed URI
        return Problem("unreadable", source, location, f"{size} bytes", f"cannot reach the store ({str(exc)[:200]})")
    if actual_size != size:
        return Problem("size", source, location, f"{size} bytes", f"{actual_size} bytes")
    if not rehash:
        return None
    try:
        actual, _ = hash_object(path, s3=s3)
    except (SourceReadError, OSError) as exc:
        return Problem("unreadable", source, location, digest, str(exc)[:300])
    if actual != digest:
        return Problem("digest", source, location, digest, actual)
    return None


def verify(
    manifest: Manifest, *, sample: float = 1.0, seed: int = 0, threads: int | None = None, s3: S3Options | None = None,
    rehash: bool = True, timeout_s: float | None = None,
) -> VerifyReport:
    """Re-hash all (or a `sample` fraction of) objects; never raises for data problems.

    `rehash=False`: only reach each object and compare its size (stat, or HEAD
    on s3), reading none of its bytes; the tokenizer is then left out (its
    identity is its digest: `sluice preflight` checks it by loading it).
    `timeout_s`: objects with no answer by then are "unreadable" problems
    (a store that hangs), and the call returns without waiting for them.
    """
    if not 0.0 < sample <= 1.0:
        raise ManifestError(f"--sample must be in (0, 1], got {sample}")
    jobs = [(manifest.resolve(o.location), s.name, o.location, o.size, o.digest) for s in manifest.sources for o in s.objects]
    total = len(jobs)
    if sample < 1.0:
        k = max(1, math.ceil(sample * total))
        picked = sorted(random.Random(seed).sample(range(total), k))
        jobs = [jobs[i] for i in picked]
    objects = len(jobs)
    if manifest.tokenizer is not None and rehash:
        t = manifest.tokenizer
        path = manifest.resolve(t.location)
        size = os.path.getsize(path) if os.path.exists(path) else -1
        jobs.append((path, "<tokenizer>", t.location, size if size >= 0 else 0, t.digest))
    workers = max(1, threads or min(8, max(2, os.cpu_count() or 1)))
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sluice-verify")
    try:
        futures = [pool.submit(_check_one, *j, s3, rehash) for j in jobs]
        done, _ = cf.wait(futures, timeout=timeout_s)
        found = [f.result() if f in done else
                 Problem("unreadable", j[1], j[2], f"{j[3]} bytes", f"no answer within {timeout_s:g} s")
                 for f, j in zip(futures, jobs)]
    finally:  # (a check still hanging on its store is left to finish on its own)
        pool.shutdown(wait=timeout_s is None, cancel_futures=True)
    problems = tuple(p for p in found if p is not None)
    return VerifyReport(manifest.dataset_id, objects, total, sum(j[3] for j in jobs), problems,
                        tokenizer_checked=manifest.tokenizer is not None and rehash)
