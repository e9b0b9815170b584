"""`--allow-root` is checked on what is opened, and its default allows no place the manifest names.

Specification (issue 27, item 7; docs/cache.md, "Privacy and allowed roots"):
* A symbolic link inside an allowed root that another process keeps
  re-pointing between an inside file and an outside one never brings an outside
  byte into the cache or its quarantine: the check is made on the file opened
  (/proc/self/fd/N), not only on the name before opening it. Before, 4 of 20
  rounds of the attack put the outside file's bytes into quarantine (a digest
  mismatch copies what was read there).
* Default roots are the manifest's own folder only: s3 prefixes the manifest
  names are not allowed unless given with `--allow-root s3://...`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from sluice.cache import NodeCache
from sluice.cache.roots import AllowedRoots, check_manifest, default_roots, roots_for
from sluice.errors import DigestMismatch, LocationRefused
from sluice.manifest.model import Manifest
from sluice.manifest.sources import ObjectRecord

SECRET = b"OUTSIDE-SECRET-" * 8192  # 120 KiB: a read takes long enough for the link to move meanwhile
INSIDE = b"inside bytes, the ones the manifest promises\n" * 3000

SWAPPER = r"""
import os, sys
link, inside, outside = sys.argv[1:4]
tmp = link + ".swap"
print("ready", flush=True)
while True:
    for target in (inside, outside):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(target, tmp)
        os.replace(tmp, link)  # atomic: the link always exists, pointing at one or the other
"""


def _holds_secret(folder: Path) -> list[str]:
    """Files under `folder` holding any of the outside file's bytes."""
    marker = SECRET[:15]
    return [str(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink() and marker in p.read_bytes()]


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    """(root, outside): root/inside holds INSIDE, outside/secret holds SECRET."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (root / "inside").write_bytes(INSIDE)
    return root, outside


def test_a_link_swapped_between_check_and_open_never_brings_outside_bytes_in(tmp_path):
    root, outside = _folders(tmp_path)
    link = root / "obj"
    link.symlink_to("inside")
    obj = ObjectRecord(location="obj", digest="b3:" + blake3.blake3(INSIDE).hexdigest(), size=len(INSIDE),
                       records=1, start=0)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(link), "inside", str(outside / "secret")],
                               stdout=subprocess.PIPE, text=True)
    outcomes = {"served": 0, "refused": 0, "mismatch": 0}
    try:
        assert swapper.stdout.readline().strip() == "ready"
        with NodeCache(tmp_path / "cache", 64 << 20, allowed_roots=AllowedRoots.of([str(root)]),
                       retries=1, backoff_s=0.0, durable=False) as cache:
            # At least 200 rounds, and on until both sides of the swap were seen (a loaded machine may not run
            # the swapper for a while), within 3,000 rounds.
            rounds = 0
            while rounds < 200 or (not (outcomes["served"] and outcomes["refused"]) and rounds < 3000):
                rounds += 1
                try:
                    with cache.fetch(obj, str(link)) as got:
                        assert Path(got.path).read_bytes() == INSIDE
                    outcomes["served"] += 1
                    cache.enforce_budget(1)  # evicted: the next round is a miss again
                    cache.enforce_budget(64 << 20)
                except LocationRefused:
                    outcomes["refused"] += 1
                except DigestMismatch:  # (read while a link moved: never outside bytes, checked below)
                    outcomes["mismatch"] += 1
    finally:
        swapper.kill()
        swapper.wait(10)
    assert _holds_secret(tmp_path / "cache") == [], outcomes
    assert outcomes["served"] > 0 and outcomes["refused"] > 0, outcomes  # both sides of the swap were seen


def test_a_file_opened_outside_the_roots_is_refused_before_a_byte_is_read(tmp_path):
    """`check_opened` judges the descriptor, whatever the name says now."""
    root, outside = _folders(tmp_path)
    roots = AllowedRoots.of([str(root)])
    with open(outside / "secret", "rb") as f:  # as if the link pointed out at the moment of the open
        with pytest.raises(LocationRefused, match=r"opened '.*outside/secret', outside the allowed roots"):
            roots.check_opened(f.fileno(), str(root / "inside"), "object b3:x")
    with open(root / "inside", "rb") as f:
        roots.check_opened(f.fileno(), str(root / "inside"), "object b3:x")


def test_default_roots_are_the_manifest_folder_only_never_its_own_s3_prefixes(tmp_path):
    golden = Path(__file__).resolve().parent / "golden" / "manifest_small.json"  # local and s3 objects
    manifest = Manifest.from_bytes(golden.read_bytes(), "manifest", base_dir=str(tmp_path))
    roots = default_roots(manifest)
    assert roots.prefixes == () and roots.folders == (str(tmp_path.resolve()),)
    with pytest.raises(LocationRefused, match=r"1 object location\(s\) outside.*s3://bucket/web/p0\.parquet"):
        check_manifest(manifest, roots)
    allowed = roots_for(manifest, ["s3://bucket/web", str(tmp_path)])
    check_manifest(manifest, allowed)  # explicitly allowed: accepted
    assert json.dumps(allowed.prefixes) == '["s3://bucket/web/"]'
