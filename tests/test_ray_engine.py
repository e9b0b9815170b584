"""The Ray engine prepares a corpus exactly as the local engine does.

A real local Ray (num_cpus=2), real corpora (jsonl.zst and parquet from the
standard library's sources), a real tokenizer. Specifications:

* `manifest freeze --engine ray` writes the same manifest bytes (the same
  dataset ID) as the local engine; `pretokenize` on Ray writes the same shard
  bytes and the same derived manifest;
* a worker killed with SIGKILL in the middle of the run is retried by Ray and
  the result is still byte-identical;
* a bad object fails the call with an error naming it, and no manifest is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import skip_unless_installed  # noqa: E402

skip_unless_installed("ray", "ray is not installed (pip install 'sluice[ray]')")  # not imported: ~0.5 s of CPU
pytestmark = pytest.mark.slow  # a Ray cluster takes seconds to start

from loaderd_support import build_corpus  # noqa: E402

from sluice.engines import ray_engine  # noqa: E402
from sluice.errors import DigestMismatch, SourceReadError  # noqa: E402
from sluice.manifest.freeze import freeze  # noqa: E402
from sluice.manifest.model import load_manifest  # noqa: E402
from sluice.tokenize.pretokenize import pretokenize  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray (2 CPUs) for the module; the engine uses an initialized Ray as it is."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=ray_engine.LOCAL_OBJECT_STORE)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer_file) -> dict[str, Path]:
    """Two corpora (jsonl.zst, parquet) of 4 objects each, frozen by the local engine."""
    return {kind: build_corpus(tmp_path_factory.mktemp(kind.replace(".", "-")), kind, tokenizer_file,
                               docs=160, objects=4) for kind in ("jsonl.zst", "parquet")}


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((folder / "shards").iterdir())}


def test_cli_freeze_on_a_local_ray_writes_the_local_engines_bytes(corpora, tmp_path):
    root = corpora["jsonl.zst"]
    out = root / "manifest-ray.json"  # beside the local one: locations are relative to the manifest's folder
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(root / "dataset.toml"),
                           "-o", str(out), "--engine", "ray", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert out.read_bytes() == (root / "manifest.json").read_bytes()
    assert summary["dataset_id"] == load_manifest(root / "manifest.json").dataset_id
    assert summary["objects"] == 4


def test_freeze_and_pretokenize_on_ray_are_byte_identical(corpora, ray_local, tmp_path):
    for kind, root in corpora.items():
        m = ray_engine.freeze_ray(root / "dataset.toml", root / "manifest-ray.json", progress=False)
        assert (root / "manifest-ray.json").read_bytes() == (root / "manifest.json").read_bytes(), kind
        assert m.dataset_id == load_manifest(root / "manifest.json").dataset_id
        local = pretokenize(m, tmp_path / f"{kind}-local", workers=1, progress=False)
        on_ray = ray_engine.pretokenize_ray(m, tmp_path / f"{kind}-ray", progress=False)
        assert on_ray.dataset_id == local.dataset_id, kind
        assert Path(on_ray.path).read_bytes() == Path(local.path).read_bytes()
        assert shard_bytes(tmp_path / f"{kind}-ray") == shard_bytes(tmp_path / f"{kind}-local")
        assert len(shard_bytes(tmp_path / f"{kind}-ray")) == 4 and on_ray.tokens == local.tokens > 0


def test_a_worker_killed_mid_run_is_retried_and_the_output_is_identical(corpora, ray_local, tmp_path, monkeypatch):
    import psutil

    root = corpora["jsonl.zst"]
    m = load_manifest(root / "manifest.json")
    local = pretokenize(m, tmp_path / "local", workers=1, progress=False)
    for what in ("pretokenize", "freeze"):
        marker = tmp_path / f"killed-{what}"
        monkeypatch.setenv(ray_engine.FAULT_ENV, str(marker))
        if what == "pretokenize":
            res = ray_engine.pretokenize_ray(m, tmp_path / "ray", progress=False)
            assert Path(res.path).read_bytes() == Path(local.path).read_bytes()
            assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")
        else:
            ray_engine.freeze_ray(root / "dataset.toml", root / "manifest-killed.json", progress=False)
            assert (root / "manifest-killed.json").read_bytes() == (root / "manifest.json").read_bytes()
        # the fault fired: a worker process wrote its pid and is gone (SIGKILL)
        pid = int(marker.read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_s3_objects_are_read_where_they_are_on_ray(corpora, ray_local, tmp_path, s3_bucket_factory):
    """Objects on a (loopback) S3 store: Ray workers read them with the driver's S3 settings
    (the workers' own environment has none); same manifest and shards as the local engine."""
    src = corpora["jsonl.zst"]
    s3_bucket_factory("ray-raw", {p.name: p.read_bytes() for p in sorted((src / "shards").glob("c-*.jsonl.zst"))})
    root = tmp_path / "s3"
    root.mkdir()
    shutil.copy(src / "tokenizer.json", root / "tokenizer.json")
    (root / "dataset.toml").write_text((src / "dataset.toml").read_text().replace("shards/c-*.jsonl.zst", "s3://ray-raw/"))
    local = freeze(root / "dataset.toml", root / "manifest.json", progress=False)
    on_ray = ray_engine.freeze_ray(root / "dataset.toml", root / "manifest-ray.json", progress=False)
    assert (root / "manifest-ray.json").read_bytes() == (root / "manifest.json").read_bytes()
    assert on_ray.sources[0].objects[0].location.startswith("s3://ray-raw/")
    a = pretokenize(local, tmp_path / "tok-local", workers=1, progress=False)
    b = ray_engine.pretokenize_ray(on_ray, tmp_path / "tok-ray", progress=False)
    assert a.dataset_id == b.dataset_id and shard_bytes(tmp_path / "tok-local") == shard_bytes(tmp_path / "tok-ray")


def test_a_bad_object_names_itself_and_no_manifest_is_written(corpora, ray_local, tmp_path):
    src = corpora["jsonl.zst"]
    root = tmp_path / "bad"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("cache*", "manifest*"))
    import zstandard

    bad = root / "shards" / "c-2.jsonl.zst"
    bad.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "fine"}\n{"text": broken\n'))
    with pytest.raises(SourceReadError) as err:
        ray_engine.freeze_ray(root / "dataset.toml", root / "manifest.json", progress=False)
    assert str(bad) in str(err.value) and "line 2" in str(err.value)
    assert not (root / "manifest.json").exists() and list(root.glob("*.tmp*")) == []

    # pretokenize: an object changed after freezing is refused by name, no derived manifest
    m = load_manifest(src / "manifest.json")
    raw = Path(m.resolve(m.sources[0].objects[1].location))
    saved = raw.read_bytes()
    try:
        raw.write_bytes(saved + b"\n")
        with pytest.raises(DigestMismatch) as err2:
            ray_engine.pretokenize_ray(m, tmp_path / "tok", progress=False)
        assert m.sources[0].objects[1].location in str(err2.value)
        assert not (tmp_path / "tok" / "manifest.json").exists()
    finally:
        raw.write_bytes(saved)


def test_engine_flags_are_checked(corpora, tmp_path):
    root = corpora["jsonl.zst"]
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(root / "dataset.toml"),
                           "-o", str(tmp_path / "m.json"), "--address", "auto"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "sluice: error:" in proc.stderr and "--engine ray" in proc.stderr
    assert not (tmp_path / "m.json").exists()
    # an unreachable cluster is named within a bounded wait (Ray itself would retry for minutes)
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(root / "dataset.toml"),
                           "-o", str(tmp_path / "m.json"), "--engine", "ray", "--address", "127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot connect to the Ray cluster at 127.0.0.1:9" in proc.stderr and "refused" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m.json").exists()


LISTENERS = r"""
import json, sys
import ray  # imported before the session starts Ray: the engine's switch must still take effect
import psutil
from sluice.engines.ray_engine import ray_session

with ray_session() as r:
    session = r._private.worker._global_node.get_session_dir_path()
    procs = [p for p in psutil.process_iter(["cmdline"])
             if p.info["cmdline"] and any(session in c for c in p.info["cmdline"])]
    procs.append(psutil.Process())
    listening = sorted({(p.name(), c.laddr.ip, c.laddr.port) for p in procs
                        for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
    print(json.dumps({"nodes": [n["NodeManagerAddress"] for n in r.nodes()],
                      "gcs": r.get_runtime_context().gcs_address, "listening": listening,
                      "processes": len(procs)}))
"""


def test_a_local_ray_started_by_the_engine_listens_on_loopback_only():
    """`freeze --engine ray` without --address starts a local Ray: its node address is 127.0.0.1 and
    every socket its processes listen on is a loopback one (before: GCS, raylet and workers on every
    interface, "::" and 0.0.0.0)."""
    proc = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["nodes"] == ["127.0.0.1"] and got["gcs"].startswith("127.0.0.1:")
    assert len(got["listening"]) >= 3 and got["processes"] >= 3  # GCS, raylet, workers seen
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    assert [entry for entry in got["listening"] if entry[1] not in loopback] == [], got["listening"]
