"""A full node-cache disk during a token fill: serving goes on (issue 27, item 4; docs/cache.md, "A full disk").

Specification: raw objects already in the cache are still served when the
disk under it refuses the token file (ENOSPC, EDQUOT, EIO): the fill falls
back to tokenizing the object into memory (bounded by the DocSource's
budget), the out-of-order reader whose spool is refused stops and its records
wait for that fill, every step equals `sluice plan` on an intact cache, each
object's fall-back is counted and logged once naming the object and the
cause, and `sluice plan --cache` on that disk exits 0 with the same output.
Before the fix the spool's OSError became "bug in sluice: OSError(28, ...)"
and the token file's ENOSPC an ObjectReadError: steps failed, `plan` exited 3.

Two ways to fill the disk: a real size-limited tmpfs (needs root and mount;
skipped with the reason otherwise), and an injected refusal of every write
under the cache's tmp/ folder (`refuse_writes_under`, always runs).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.errors import CacheError, CacheWriteError
from sluice.loaderd.logical import Plan, micro_batches_digest
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec
from sluice.tokenize import encoder_for_manifest
from sluice.tokenize.tokcache import fill_tokens

STEPS = 60


@pytest.fixture(scope="module", params=["jsonl.zst", "jsonl"])
def corpus(request, tmp_path_factory, tokenizer_file) -> Path:
    """Two objects: compressed (its out-of-order reader spools decoded bytes) or plain (line index)."""
    return build_corpus(tmp_path_factory.mktemp("full-disk") / "c", request.param, tokenizer_file,
                        docs=600, objects=2)


def mount_tmpfs(path: Path, size: str) -> Path:
    """A real size-limited tmpfs at `path` (the caller unmounts it); skips where that is not possible."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root; the injected-refusal tests cover the logic")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); the injected-refusal tests cover the logic")
    return path


@pytest.fixture
def full_disk(tmp_path, corpus):
    """(cache folder, corpus) on a real 4 MiB tmpfs: the raw objects cached, then every free byte taken."""
    mnt = mount_tmpfs(tmp_path / "disk", "4m")
    try:
        manifest = load_manifest(corpus / "manifest.json")
        with NodeCache(mnt / "cache", 1 << 30) as cache:
            for obj in manifest.sources[0].objects:
                cache.fetch(obj, manifest.resolve(obj.location)).close()
        with open(mnt / "junk", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        yield mnt / "cache", corpus
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def serve(corpus: Path, cache_dir: Path, steps: int = STEPS, **docs_kw) -> tuple[list[str], DocSource]:
    """The digests of steps [0, steps) read through a DocSource over `cache_dir` (closed on return)."""
    manifest = load_manifest(corpus / "manifest.json")
    spec = load_runspec(corpus / "run.toml")
    with NodeCache(cache_dir, 1 << 30) as cache:
        docs = DocSource(manifest, cache, encoder_for_manifest(manifest, cache=cache), **docs_kw)
        try:
            plan = Plan(manifest, spec)
            state, digests = plan.initial_state(), []
            for _ in range(steps):
                batch, state = plan.step(state, docs)
                digests.append(micro_batches_digest(plan.replica_micro_batches(batch, 1, 0)))
            assert docs.wait_filled(60)
        finally:
            docs.close()
    return digests, docs


@pytest.fixture(scope="module")
def expected(corpus, tmp_path_factory) -> list[str]:
    """The digests on an intact disk (what `sluice plan` prints)."""
    return serve(corpus, tmp_path_factory.mktemp("intact") / "cache")[0]


def _fallback_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "fallback", None) == "memory"]


def _check_fallen_back(docs: DocSource, caplog, manifest_dir: Path) -> None:
    """Both objects were served from memory, counted and logged once each, naming object and cause."""
    objects = load_manifest(manifest_dir / "manifest.json").sources[0].objects
    assert docs.not_kept["memory"] == len(objects)
    logs = _fallback_logs(caplog)
    assert len(logs) == len(objects)
    for obj in objects:
        mine = [m for m in logs if obj.digest in m]
        assert len(mine) == 1 and obj.location in mine[0]
        assert "ENOSPC" in mine[0] and "tokenized again into memory" in mine[0]


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2048], ids=["one-chunk", "small-chunks"])
def test_a_real_full_disk_serves_every_step_from_memory(full_disk, expected, caplog, chunk_bytes):
    cache_dir, corpus = full_disk
    caplog.set_level(logging.WARNING, "sluice.loaderd")
    got, docs = serve(corpus, cache_dir, chunk_bytes=chunk_bytes)
    assert got == expected
    _check_fallen_back(docs, caplog, corpus)
    assert list((cache_dir / "tmp").iterdir()) == []  # no partial token file left on the full disk
    with NodeCache(cache_dir, 1 << 30) as cache:
        assert cache.stats().objects == 2  # the raw objects only: nothing published, nothing lost
        assert cache.verify_all().damaged == ()


def test_sluice_plan_on_a_real_full_disk_exits_0_with_the_intact_output(full_disk, tmp_path):
    cache_dir, corpus = full_disk

    def plan(cache: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sluice.cli", "plan", str(corpus / "manifest.json"),
                               str(corpus / "run.toml"), "--steps", "0:30", "--json", "--no-progress",
                               "--cache", str(cache)], capture_output=True, text=True, timeout=300)

    full, intact = plan(cache_dir), plan(tmp_path / "intact")
    assert full.returncode == 0, full.stderr
    assert intact.returncode == 0, intact.stderr
    assert full.stdout == intact.stdout and full.stdout.count("\n") == 30
    assert "bug in sluice" not in full.stderr
    # (a fill still running when the 30 steps are out is stopped: its object may log nothing)
    assert full.stderr.count("tokenized again into memory") <= 2  # logged at most once per object


@pytest.mark.slow
def test_a_real_full_disk_with_fill_worker_processes(full_disk, expected, caplog):
    """worker_kind="process": the worker's ENOSPC crosses the process pool; the thread fills into memory."""
    cache_dir, corpus = full_disk
    caplog.set_level(logging.WARNING, "sluice.loaderd")
    got, docs = serve(corpus, cache_dir, worker_kind="process")
    assert got == expected
    _check_fallen_back(docs, caplog, corpus)


# --------------------------------------------------------------------- injected (no root needed)
@pytest.fixture
def refuse_writes_under(monkeypatch):
    """`refuse(folder, after=k)`: from the (k+1)-th on, every os.pwrite to a file under `folder` fails with
    ENOSPC, as a disk that fills up meanwhile; other files (memory files included) are written."""
    real = os.pwrite
    state = {"folder": None, "left": 0, "refused": 0}

    def pwrite(fd, data, offset):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if state["folder"] is not None and target.startswith(state["folder"]):
            if state["left"] <= 0:
                state["refused"] += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            state["left"] -= 1
        return real(fd, data, offset)

    def refuse(folder: Path, after: int = 0) -> dict:
        state.update(folder=str(folder.resolve()) + os.sep, left=after)
        monkeypatch.setattr(os, "pwrite", pwrite)
        return state

    return refuse


@pytest.mark.parametrize("after", [0, 40], ids=["at-once", "part-way"])
def test_an_injected_full_disk_serves_every_step_from_memory(corpus, expected, tmp_path, caplog,
                                                             refuse_writes_under, after):
    """`after=40`: the disk fills while the token file is being written: the documents already served
    from it keep being served until the second fill (in memory) has passed them."""
    caplog.set_level(logging.WARNING, "sluice.loaderd")
    manifest = load_manifest(corpus / "manifest.json")
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        for obj in manifest.sources[0].objects:
            cache.fetch(obj, manifest.resolve(obj.location)).close()
    state = refuse_writes_under(tmp_path / "cache" / "tmp", after=after)
    got, docs = serve(corpus, tmp_path / "cache", chunk_bytes=2048)
    assert state["refused"] > 0
    assert got == expected
    _check_fallen_back(docs, caplog, corpus)


def test_the_memory_fall_back_is_bounded_and_its_error_names_the_object(corpus, tmp_path, refuse_writes_under):
    manifest = load_manifest(corpus / "manifest.json")
    obj = manifest.sources[0].objects[0]
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        enc = encoder_for_manifest(manifest, cache=cache)
        cache.fetch(obj, manifest.resolve(obj.location)).close()
        refuse_writes_under(tmp_path / "cache" / "tmp")
        with pytest.raises(CacheWriteError, match="ENOSPC"):  # no fall-back asked for: the refusal itself
            fill_tokens(cache, manifest, 0, 0, enc)
        with pytest.raises(CacheError, match=r"held in memory, it would take \d+ bytes, more than the 10000") as info:
            fill_tokens(cache, manifest, 0, 0, enc, memory_bytes=10_000)
        assert obj.location in str(info.value) and obj.digest in str(info.value)
        got = fill_tokens(cache, manifest, 0, 0, enc, memory_bytes=1 << 30)
        try:
            assert got.pin is None and got.held == "memory" and got.stats.documents == obj.records
            assert got.reader.doc(obj.records - 1).size > 0
        finally:
            got.reader.close()
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []


@pytest.mark.slow
def test_a_daemon_on_a_real_full_disk_serves_the_plan_and_counts_the_fall_back(full_disk):
    """The finding as reported: loaderd with a full cache disk answered every step with "bug in sluice:
    OSError 28". Now it serves the plan; the metric and the log name what fell back."""
    import time
    import urllib.request

    from loaderd_support import Daemon, reference
    from test_loaderd import check_equal, take

    cache_dir, corpus = full_disk
    steps = 30
    ref = reference(corpus, steps, 1)
    state = cache_dir.parent.parent / "state"  # the fencing record needs a disk with room (next test)
    with Daemon(corpus, cache=cache_dir, extra=("--metrics-port", "0", "--state-dir", str(state))) as d:
        c = d.client(0, 1)
        got = check_equal(take(c, steps), ref, 0, c.info["micro_per_step"])
        assert sorted(got) == list(range(steps))
        c.close()
        url = f"http://127.0.0.1:{d.info['metrics_port']}/metrics"
        deadline = time.monotonic() + 60  # both objects' fills end (in memory) while the daemon runs
        while True:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            line = [x for x in text.splitlines() if x.startswith("sluice_tokens_not_kept_total") and 'held="memory"' in x]
            if line and float(line[0].split()[-1]) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert line and float(line[0].split()[-1]) == 2, line
    log = d.log.read_text()
    assert "bug in sluice" not in log
    for obj in load_manifest(corpus / "manifest.json").sources[0].objects:
        assert sum(obj.digest in x and "tokenized again into memory" in x for x in log.splitlines()) == 1


FRESH = r"""
import sys
from sluice.cache import NodeCache
from sluice.errors import CacheError
try:
    NodeCache(sys.argv[1], 1 << 30)
except CacheError as exc:
    print(exc)
    sys.exit(2)
"""


def test_a_fresh_cache_or_daemon_state_on_a_full_disk_is_a_clear_error_not_sigbus(full_disk, tmp_path):
    """LMDB maps its lock file: made sparse on a full disk, its first write killed the process with
    SIGBUS (a daemon started there died before printing a line). Now the lock file's blocks are
    allocated first, and a full disk is an error naming the folder (exit 2)."""
    cache_dir, corpus = full_disk
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(cache_dir.parent / "fresh-cache")],
                           capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 2, (fresh.returncode, fresh.stderr[-2000:])
    assert "fresh-cache/index: cannot make its lock file (No space left on device)" in fresh.stdout
    daemon = subprocess.run([sys.executable, "-m", "sluice.loaderd.cli", str(corpus / "manifest.json"),
                             str(corpus / "run.toml"), "--cache", str(cache_dir), "--log-level", "warning"],
                            capture_output=True, text=True, timeout=120)
    assert daemon.returncode == 2, (daemon.returncode, daemon.stderr[-2000:])
    assert "loaderd-state/fence.lmdb: cannot make its lock file (No space left on device)" in daemon.stderr
    assert "--state-dir" in daemon.stderr
