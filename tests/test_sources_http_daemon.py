"""A dataset frozen from http:// URLs, warmed into the node cache and served by a real loaderd:
the stream is the local-file stream, bit for bit (the server on 127.0.0.1 supports Range requests).

The order of a run is keyed by its dataset ID, which covers the objects' locations, so the oracle
is the reference plan of the http manifest with its objects read from the local files (a cache
filled from them: objects are addressed by digest).
"""

from __future__ import annotations

import json
import shutil

import pytest

from http_objects import ObjectServer
from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.cache import NodeCache
from sluice.manifest.model import load_manifest

pytestmark = pytest.mark.slow  # a freeze, a warm and a daemon: three processes


def _take(client, steps: int) -> list[dict]:
    import numpy as np

    out = []
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v) for k, v in mb.items()})
        if mb["step"] == steps - 1 and mb["micro"] + 1 == client.info["micro_per_step"]:
            return out
    return out


def test_http_sources_serve_the_local_file_stream(tmp_path, tokenizer_file, sluice_cli):
    local = build_corpus(tmp_path / "local", "jsonl.zst", tokenizer_file, docs=120, objects=3)
    shards = sorted((local / "shards").iterdir())
    files = {f"/corpus/shards/{p.name}": p.read_bytes() for p in shards}
    site = tmp_path / "http"
    site.mkdir()
    for name in ("tokenizer.json", "run.toml"):
        shutil.copy(local / name, site / name)
    steps = 8
    with ObjectServer(files) as srv:
        root = srv.url("/corpus/")
        urls = [srv.url(p) for p in files]
        spec = (local / "dataset.toml").read_text().replace('paths = ["shards/c-*.jsonl.zst"]',
                                                            f"paths = {json.dumps(urls)}")
        assert spec != (local / "dataset.toml").read_text()
        (site / "dataset.toml").write_text(spec)
        r = sluice_cli("manifest", "freeze", site / "dataset.toml", "-o", site / "manifest.json", "--no-progress")
        assert r.returncode == 0, r.stderr
        m, ml = load_manifest(site / "manifest.json"), load_manifest(local / "manifest.json")
        assert [o.location for o in m.sources[0].objects] == urls
        assert [o.digest for o in m.sources[0].objects] == [o.digest for o in ml.sources[0].objects]
        with NodeCache(tmp_path / "from-local-files", 1 << 30) as mirror:
            for obj, local_obj in zip(m.sources[0].objects, ml.sources[0].objects):
                mirror.fetch(obj, ml.resolve(local_obj.location)).close()
        ref = reference(site, steps, 1, cache_dir=tmp_path / "from-local-files")

        warm = ("cache", "warm", site / "manifest.json", tmp_path / "cache", "--budget", "256MiB", "--json")
        r = sluice_cli(*warm)
        assert r.returncode == 2 and "outside the allowed roots" in r.stderr, r.stderr  # no URL root given
        r = sluice_cli(*warm, "--allow-root", root)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["filled"] == len(files)
        assert len(srv.ranges) >= len(files)
        # A cold cache: the daemon fills every object over http itself, at its misses.
        before = len(srv.ranges)
        _check_served(site, tmp_path / "cold-cache", root, steps, ref)
        assert len(srv.ranges) >= before + len(files)
    # The server is gone: the daemon serves what the warm verified into the cache.
    _check_served(site, tmp_path / "cache", root, steps, ref)


def _check_served(site, cache, root: str, steps: int, ref) -> None:
    with Daemon(site, cache=cache, extra=("--allow-root", root)) as d:
        c = d.client(0, 1, samples=True)
        batches = _take(c, steps)
        got = stream_digests(batches, c.info["micro_per_step"])
        c.close()
    assert sorted(got) == list(range(steps))
    for step, digest in got.items():
        assert digest == ref[(step, 0)][0], f"step {step} differs from the local-file stream"
    first = [s for b in batches if b["step"] == 2 for s in b["samples"]]
    assert list(dict.fromkeys(first)) == ref[(2, 0)][1]  # the same sample IDs: they follow the bytes
