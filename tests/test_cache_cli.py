"""`sluice cache stats / verify / gc / warm`: one round trip in real subprocesses, the rest in-process
through `main(argv)` (`sluice_main`: the same output and exit codes without ~0.3 s of CPU a process)."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
from support import text_objects_manifest

from sluice.cache import NodeCache
from sluice.manifest.model import Manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy
from sluice.manifest.sources import ObjectRecord, Source

KiB = 1 << 10


def b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def payload(seed: int, size: int) -> bytes:
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size)


def write_manifest(folder: Path, blobs: dict[str, bytes], *, lie_about: str | None = None) -> Path:
    """Write the blobs next to a manifest that lists them (one source), as freeze would."""
    objects, start = [], 0
    for name, data in blobs.items():
        (folder / name).write_bytes(data)
        digest = b3(b"not " + data) if name == lie_about else b3(data)
        objects.append(ObjectRecord(location=name, digest=digest, size=len(data), records=2, start=start))
        start += 2
    source = Source(name="web", format="jsonl", text_field="text", weight="1", exhaustion="stop",
                    paths=tuple(blobs), objects=tuple(objects))
    manifest = Manifest(name="cache-cli", tokenizer=None, packing=PackingPolicy(seq_len=16, eos_id=0),
                        mixture=MixturePolicy(), sources=(source,))
    path = folder / "manifest.json"
    path.write_bytes(manifest.canonical_bytes())
    return path


def test_warm_then_stats_json_then_warm_again_hits(tmp_path, sluice_cli):
    blobs = {f"part-{i}.jsonl": payload(i, 50 * KiB) for i in range(3)}
    manifest = write_manifest(tmp_path, blobs)
    cache = tmp_path / "cache"
    res = sluice_cli("cache", "warm", manifest, cache, "--budget", "1M", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["objects"], out["filled"], out["present"], out["failed"]) == (3, 3, 0, 0)
    res = sluice_cli("cache", "warm", manifest, cache)  # budget recorded in the index
    assert res.returncode == 0, res.stderr
    assert "0 filled (0 bytes), 3 already present, 0 failed" in res.stdout
    res = sluice_cli("cache", "stats", cache, "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert {k: stats[k] for k in ("objects", "bytes", "fills", "hits", "misses", "quarantined")} == {
        "objects": 3, "bytes": 150 * KiB, "fills": 3, "hits": 3, "misses": 3, "quarantined": 0}
    assert stats["budget_bytes"] == 1 << 20
    human = sluice_cli("cache", "stats", cache)
    assert human.returncode == 0 and "objects" in human.stdout and "150" not in human.stderr


def test_warm_reports_every_bad_object_and_exits_nonzero(tmp_path, sluice_main):
    blobs = {"good.jsonl": payload(10, 4 * KiB), "bad.jsonl": payload(11, 4 * KiB)}
    manifest = write_manifest(tmp_path, blobs, lie_about="bad.jsonl")
    res = sluice_main("cache", "warm", manifest, tmp_path / "cache", "--budget", "1M", "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["filled"] == 1 and out["failed"] == 1
    assert "'bad.jsonl'" in out["errors"][0] and "expected digest" in out["errors"][0]
    stats = json.loads(sluice_main("cache", "stats", tmp_path / "cache", "--json").stdout)
    assert stats["quarantined"] == 4  # 1 + 3 retries, each quarantined


def test_warm_a_new_cache_needs_a_budget(tmp_path, sluice_main):
    manifest = write_manifest(tmp_path, {"a.jsonl": b"{}\n{}\n"})
    res = sluice_main("cache", "warm", manifest, tmp_path / "cache")
    assert res.returncode == 2 and "create one with `sluice cache warm MANIFEST DIR --budget SIZE`" in res.stderr


def test_verify_exits_nonzero_on_damage_and_repairs_the_index(tmp_path, sluice_main):
    blobs = {"a.jsonl": payload(20, 30 * KiB), "b.jsonl": payload(21, 30 * KiB)}
    manifest = write_manifest(tmp_path, blobs)
    cache_dir = tmp_path / "cache"
    assert sluice_main("cache", "warm", manifest, cache_dir, "--budget", "1M", "--json").returncode == 0
    res = sluice_main("cache", "verify", cache_dir, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["ok"] == 2
    with NodeCache(cache_dir, 1 << 20) as cache, cache.lookup(b3(blobs["b.jsonl"])) as obj:
        path = Path(obj.path)
    data = bytearray(path.read_bytes())
    data[7] ^= 0x40
    path.write_bytes(data)
    res = sluice_main("cache", "verify", cache_dir)
    assert res.returncode == 1
    assert f"DAMAGED {b3(blobs['b.jsonl'])}" in res.stdout and "checked 2, ok 1, damaged 1" in res.stdout
    res = sluice_main("cache", "verify", cache_dir, "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"checked": 1, "ok": 1, "damaged": [], "busy": []}
    stats = json.loads(sluice_main("cache", "stats", cache_dir, "--json").stdout)
    assert (stats["objects"], stats["verify_failures"], stats["quarantined"]) == (1, 1, 1)


def test_gc_collects_debris_and_enforces_a_lower_budget(tmp_path, sluice_main):
    blobs = {f"p{i}.jsonl": payload(30 + i, 40 * KiB) for i in range(3)}
    manifest = write_manifest(tmp_path, blobs)
    cache_dir = tmp_path / "cache"
    assert sluice_main("cache", "warm", manifest, cache_dir, "--budget", "1M", "--json").returncode == 0
    (cache_dir / "tmp" / f"{'ab' * 32}.4242.0.part").write_bytes(b"left by a killed fill")
    res = sluice_main("cache", "gc", cache_dir, "--budget", "100K", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tmp_files"] == 1 and out["evicted"] == 1 and out["objects"] == 2
    assert out["bytes"] <= out["budget_bytes"] == 100 * KiB
    assert list((cache_dir / "tmp").iterdir()) == []


def test_commands_on_a_folder_that_is_not_a_cache_fail_clearly(tmp_path, sluice_main):
    for command in ("stats", "verify", "gc"):
        res = sluice_main("cache", command, tmp_path / "nope")
        assert res.returncode == 2
        assert "not a node cache (no index/ folder)" in res.stderr
    res = sluice_main("cache", "warm", tmp_path / "missing.json", tmp_path / "c", "--budget", "1M")
    assert res.returncode == 2 and "missing.json: no such file" in res.stderr


@pytest.mark.slow
def test_ctrl_c_during_warm_tokens_exits_at_once_saying_what_was_done(tmp_path, tokenizer_file, sluice_cli):
    """Ctrl-C (SIGINT to the terminal's process group) while the token pool works: exit 130 within
    seconds, not after the queued objects are tokenized; one line naming the command, the cache and
    what was kept; no traceback; the cache verifies and a new warm completes it."""
    from support import ctrl_c_once_working

    manifest = text_objects_manifest(tmp_path, tokenizer_file, objects=4, size=12 << 20)  # ~8 s of tokenizing on 2 cores
    cache = tmp_path / "cache"
    rc, waited, err = ctrl_c_once_working(
        ["cache", "warm", str(manifest), str(cache), "--budget", "1G", "--tokens", "--token-workers", "2", "--progress"],
        f"tokens {cache.name}", tmp_path / "stderr")
    assert rc == 130, err
    assert waited < 4, f"exit {waited:.1f} s after SIGINT"
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"sluice: interrupted: cache warm {cache}: tokens of ") and "of 4 text objects kept" in last
    res = sluice_cli("cache", "verify", cache)
    assert res.returncode == 0, res.stdout + res.stderr
