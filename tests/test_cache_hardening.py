"""Attacks on the node cache (issue 10 items 4, 10, 17, 21): each test failed before its fix.

Real files, real LMDB, real processes; `sluice` commands run in-process through
`main(argv)` where one process suffices, in subprocesses where concurrency is
the point.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from sluice.cache import NodeCache
from sluice.cli import main
from sluice.errors import LocationRefused
from sluice.manifest.model import Manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy
from sluice.manifest.sources import ObjectRecord, Source

KiB = 1 << 10


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def payload(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def write_manifest(folder: Path, objects: dict[str, bytes], *, locations: dict[str, str] | None = None) -> Path:
    """A manifest in `folder` listing `objects` (written next to it unless `locations` says where)."""
    records, start = [], 0
    for name, data in objects.items():
        location = (locations or {}).get(name, name)
        if location == name:
            (folder / name).write_bytes(data)
        records.append(ObjectRecord(location=location, digest=b3(data), size=len(data), records=1, start=start))
        start += 1
    source = Source(name="web", format="jsonl", text_field="text", weight="1", exhaustion="stop",
                    paths=tuple(objects), objects=tuple(records))
    manifest = Manifest(name="cache-hardening", tokenizer=None, packing=PackingPolicy(seq_len=16, eos_id=0),
                        mixture=MixturePolicy(), sources=(source,))
    path = folder / "manifest.json"
    path.write_bytes(manifest.canonical_bytes())
    return path


def modes(root: Path) -> dict[str, int]:
    """Permission bits of every folder and file under `root` (links are not followed)."""
    out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


# ------------------------------------------------------------ item 10: privacy
@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_cache_and_quarantine_are_private_whatever_the_umask(tmp_path, umask, capsys):
    good, bad = payload(1, 8 * KiB), payload(2, 8 * KiB)
    data = tmp_path / "data"
    data.mkdir()
    manifest = write_manifest(data, {"good.jsonl": good, "bad.jsonl": bad})
    (data / "bad.jsonl").write_bytes(bad[::-1])  # changed after freezing: its bytes go to quarantine
    old = os.umask(umask)
    try:
        assert main(["cache", "warm", str(manifest), str(tmp_path / "cache"), "--budget", "1M", "--json"]) == 1
    finally:
        os.umask(old)
    found = modes(tmp_path / "cache")
    assert any(k.startswith("quarantine/") and k.endswith(".bad") for k in found)
    assert any(k.startswith("objects/") and len(k) > 20 for k in found)
    for rel, mode in found.items():
        is_dir = (tmp_path / "cache" / rel).is_dir()
        assert mode == (0o700 if is_dir else 0o600), f"{rel}: {oct(mode)}"


def test_a_symbolic_link_inside_the_cache_folder_is_refused_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "cache"
    root.mkdir()
    (root / "quarantine").symlink_to(elsewhere)
    with pytest.raises(Exception, match=r"quarantine/ is not a folder but a symbolic link"):
        NodeCache(root, 1 << 20)
    assert list(elsewhere.iterdir()) == []


def test_a_symbolic_link_planted_as_an_object_file_is_never_served(tmp_path):
    data = payload(3, 4 * KiB)
    src = tmp_path / "a.bin"
    src.write_bytes(data)
    obj = ObjectRecord(location="a.bin", digest=b3(data), size=len(data), records=1, start=0)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * len(data))  # same size: only the link check stops it
    with NodeCache(tmp_path / "cache", 1 << 20) as cache:
        with cache.fetch(obj, str(src)) as got:
            path = Path(got.path)
        path.unlink()
        path.symlink_to(secret)
        with cache.fetch(obj, str(src)) as again:  # dropped as damage, refilled from the source
            assert Path(again.path).read_bytes() == data and not Path(again.path).is_symlink()
    assert secret.read_bytes() == b"x" * len(data)


# ---------------------------------------------------------- item 10: allowed roots
def test_warm_refuses_a_location_outside_the_allowed_roots_before_reading_anything(tmp_path, capsys):
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"not yours\n")
    secret.chmod(0o600)
    data = tmp_path / "data"
    data.mkdir()
    manifest = write_manifest(data, {"ok.jsonl": payload(4, KiB), "secret": b"guess\n"},
                              locations={"secret": str(secret)})
    cache = tmp_path / "cache"
    assert main(["cache", "warm", str(manifest), str(cache), "--budget", "1M", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice: error: ") and "Traceback" not in err
    assert f"object {str(secret)!r}" in err and f"allowed roots ({data.resolve()})" in err and "--allow-root" in err
    assert not cache.exists()  # refused before the cache was even created
    # Allowed explicitly, it is read (and, not matching, quarantined privately).
    assert main(["cache", "warm", str(manifest), str(cache), "--budget", "1M", "--json",
                 "--allow-root", str(data), "--allow-root", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["filled"], out["failed"]) == (1, 1)


def test_a_link_inside_an_allowed_root_cannot_point_out_of_it(tmp_path):
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"guess\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "innocent.jsonl").symlink_to(secret)
    obj = ObjectRecord(location="innocent.jsonl", digest=b3(b"guess\n"), size=6, records=1, start=0)
    from sluice.cache.roots import AllowedRoots

    with NodeCache(tmp_path / "cache", 1 << 20, allowed_roots=AllowedRoots.of([str(data)])) as cache:
        with pytest.raises(LocationRefused, match=r"location '.*innocent.jsonl' is outside the allowed roots"):
            cache.fetch(obj, str(data / "innocent.jsonl"))
        assert cache.stats().fills == 0


def test_loaderd_refuses_a_manifest_with_a_location_outside_its_allowed_roots(tmp_path):
    from sluice.loaderd.cli import add_arguments, config_from_args

    data = tmp_path / "data"
    data.mkdir()
    manifest = write_manifest(data, {"ok.jsonl": payload(5, KiB), "pw": b"root:x:0:0\n"},
                              locations={"pw": "/etc/passwd"})
    runspec = tmp_path / "run.toml"
    runspec.write_text("")  # never read: the manifest is refused first
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(manifest), str(runspec), "--cache", str(tmp_path / "cache")])
    with pytest.raises(LocationRefused, match=r"outside the allowed roots .*object '/etc/passwd'"):
        config_from_args(args)


# ------------------------------------------------- item 17: concurrent warmers
@pytest.mark.slow  # three processes
def test_concurrent_warmers_print_counts_that_sum_to_the_total(tmp_path):
    objects = {f"p{i}.jsonl": payload(100 + i, 256 * KiB) for i in range(24)}
    manifest = write_manifest(tmp_path, objects)
    cmd = [sys.executable, "-m", "sluice.cli", "cache", "warm", str(manifest), str(tmp_path / "cache"),
           "--budget", "64M", "--json"]
    NodeCache(tmp_path / "cache", 64 << 20).close()  # both warmers find a cache (no creation race)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    for out in outs:
        assert out["filled"] + out["present"] + out["failed"] == out["objects"] == 24, out
    assert sum(out["filled"] for out in outs) == 24  # each object filled exactly once, by someone


# ------------------------------------------------- item 21: lock.mdb deleted
@pytest.mark.slow  # three processes
def test_deleting_lock_mdb_under_a_running_process_is_harmless_and_refused_loudly(tmp_path, caplog):
    """A holder (this process, like a daemon) keeps working; two warmers started after the
    deletion are refused with exit 2 instead of writing through a second lock file."""
    objects = {f"w{i}.jsonl": payload(200 + i, 16 * KiB) for i in range(4)}
    manifest = write_manifest(tmp_path, objects)
    root = tmp_path / "cache"
    first = ObjectRecord(location="w0.jsonl", digest=b3(objects["w0.jsonl"]), size=16 * KiB, records=1, start=0)
    holder = NodeCache(root, 1 << 20)
    holder.fetch(first, str(tmp_path / "w0.jsonl")).close()
    (root / "index" / "lock.mdb").unlink()
    cmd = [sys.executable, "-m", "sluice.cli", "cache", "warm", str(manifest), str(root), "--json"]
    warmers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for w in warmers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 2, err
        assert "lock.mdb is missing, but other processes have the index open" in err and "Traceback" not in err
    # The holder still fills, hits and verifies through its (unlinked) lock file, and says what happened.
    second = ObjectRecord(location="w1.jsonl", digest=b3(objects["w1.jsonl"]), size=16 * KiB, records=1, start=1)
    with caplog.at_level("WARNING", logger="sluice.cache"):
        holder.fetch(second, str(tmp_path / "w1.jsonl")).close()
    assert "lock.mdb was deleted or replaced" in caplog.text
    assert holder.verify_all().ok == 2
    holder.close()
    # With every user gone, the next warmer opens normally (LMDB makes a new lock.mdb).
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["filled"] == 2 and (root / "index" / "lock.mdb").exists()


# ------------------------------------------------- own attack: gc during fills
@pytest.mark.slow  # about 5 s of threads on a loaded machine
def test_debris_collection_and_eviction_running_during_fills_never_break_an_entry(tmp_path):
    """One thread runs `gc` (collect_debris + enforce_budget) in a loop while three fill and read."""
    import threading

    objs = []
    for i in range(12):
        data = payload(300 + i, 12 * KiB)
        (tmp_path / f"g{i}.bin").write_bytes(data)
        objs.append((ObjectRecord(location=f"g{i}.bin", digest=b3(data), size=len(data), records=1, start=i),
                     str(tmp_path / f"g{i}.bin")))
    cache = NodeCache(tmp_path / "cache", 6 * 12 * KiB, durable=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def gc() -> None:
        try:
            while not stop.is_set():
                cache.collect_debris()
                cache.enforce_budget()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def reader(k: int) -> None:
        try:
            for i in range(60):
                obj, path = objs[(k * 5 + i) % len(objs)]
                with cache.fetch(obj, path) as got:
                    assert b3(Path(got.path).read_bytes()) == obj.digest
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    collector = threading.Thread(target=gc)
    collector.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    collector.join(60)
    assert not errors, errors[0]
    assert cache.verify_all().damaged == () and cache.collect_debris().dropped_entries == 0
    cache.close()


def test_a_stray_file_in_quarantine_does_not_break_pruning(tmp_path):
    """A file someone dropped into quarantine/ (not named <key>.<ns>.<pid>.<n>.bad) goes first, no crash."""
    from sluice.cache.layout import Layout, Quarantine

    root = tmp_path / "cache"
    (root / "quarantine").mkdir(parents=True)
    q = Quarantine(Layout(root), keep=1)
    stray = root / "quarantine" / "x.bad"
    stray.write_bytes(b"?")
    ours = root / "quarantine" / f"{'0' * 64}.{10**18}.1.0.bad"
    ours.write_bytes(b"!")
    assert q.prune() == 1
    assert not stray.exists() and ours.exists()
