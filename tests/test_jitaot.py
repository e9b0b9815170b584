"""The kernels compiled ahead of time (`sluice/loaderd/physical/jitaot.py`): loaded at every run's first call, safe.

Built once a session into NUMBA_CACHE_DIR (conftest's `aot_kernel`); the
properties of tests/test_logical_jit.py and the attacks of
tests/test_attack_kernel_queue.py run on this build as on numba's. Here: a
run too short to pay back numba's load gets the module after its first call
and serves the plan's stream; an argument of a type the module was not
compiled for raises TypeError (pycc's own wrappers would crash the process);
a damaged module is never imported; a failed build is not tried again; two
compile children started together on a cold folder build the module once; a
compile child ends soon after its daemon is killed with -9.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loaderd_support import Daemon, build_corpus, reference, stream_digests
from support import copy_numba_cache, skip_unless_installed
from test_loaderd_jit import started_by

from sluice.loaderd.logical import jit
from sluice.loaderd.physical import jitaot, jitload

skip_unless_installed("numba", "numba is not installed (pip install numba)")  # not imported at collection

READY = "ready: the kernels' compiled module is on disk"


def test_a_short_run_loads_the_module_after_its_first_call_and_serves_the_plan(aot_kernel, tmp_path,
                                                                                tokenizer_file):
    """max_steps 300 (numba's load would not pay back, so it never started before): with the module built the
    load starts after the first call, takes milliseconds, and the kernel serves most of the run."""
    corpus = build_corpus(tmp_path, "sltok", tokenizer_file, docs=600, lanes=4, global_batch=8, micro_batch=4,
                          seq_len=64, max_steps=300)
    with Daemon(corpus, cache=corpus / "cache", extra=("--log-level", "info")) as d:
        c = d.client()
        batches = [{k: v.copy() if hasattr(v, "copy") and k != "samples" else v for k, v in mb.items()} for mb in c]
        fast = c.stats()["fast_path"]
        c.close()
    why, step, held = started_by(d.log)
    assert why == READY and step < 16 and held is None, d.log.read_text()[-2000:]
    line = next(ln for ln in d.log.read_text().splitlines() if "fused kernel active after" in ln)
    assert "ahead-of-time" in line, line
    assert fast["kernel_loaded"] == 1 and fast["kernel_ahead_of_time"] == 1, fast
    assert fast["kernel"] == {"state": "active", "cause": None}, fast
    assert fast["steps_by_path"]["fused-kernel"] >= 250, fast
    got = stream_digests(batches, 2)
    ref = reference(corpus, 300, 1)
    assert sorted(got) == list(range(300))
    assert all(digest == ref[(s, 0)][0] for s, digest in got.items())


BAD_CALLS = """
import sys
import numpy as np
from sluice.loaderd.physical import jitaot
draws, rows = jitaot.load(sys.argv[1])
i8 = np.zeros(16, dtype=np.int64)
ro = np.zeros(16, dtype=np.int32)
ro.flags.writeable = False
cases = {
    "gather, float tokens": lambda: rows.gather(np.zeros(8), 0, np.zeros((1, 8), dtype=np.int64), i8.astype(np.int32),
                                                i8, 4, 4, 12),
    "gather, 2-d tokens": lambda: rows.gather(np.zeros((2, 4), dtype=np.uint16), 0, np.zeros((1, 8), dtype=np.int64),
                                              i8.astype(np.int32), i8, 4, 4, 12),
    "gather, strided tokens": lambda: rows.gather(np.zeros(16, dtype=np.uint16)[::2], 0,
                                                  np.zeros((1, 8), dtype=np.int64), i8.astype(np.int32), i8, 4, 4, 12),
    "finish, an int64 block for int32": lambda: rows.finish(i8, i8.astype(np.int32), i8, 1, 1, 4),
    "finish, a read-only block": lambda: rows.finish(ro, i8.astype(np.int32), i8, 1, 1, 4),
    "finish, a float count": lambda: rows.finish(i8.astype(np.int32), i8, i8, 1.5, 1, 4),
    "finish, an int past int64": lambda: rows.finish(i8.astype(np.int32), i8, i8, 1 << 70, 1, 4),
    "finish, a bool count": lambda: rows.finish(i8.astype(np.int32), i8, i8, True, 1, 4),
    "finish, a big-endian block": lambda: rows.finish(i8.astype(">i4"), i8, i8, 1, 1, 4),
    "feistel, a list": lambda: draws.feistel_many([1, 2], np.ones(2, dtype=np.uint64), np.uint64(1), np.uint64(1),
                                                  np.uint64(2), i8),
    "walk, too few arguments": lambda: draws.walk(1, 2, 3),
}
for name, call in cases.items():
    try:
        call()
        print(name, "ACCEPTED")
    except TypeError:
        print(name, "TypeError")
"""


def test_arguments_of_other_types_raise_type_error_instead_of_crashing(aot_kernel):
    """pycc's wrappers do not check array types (an int32 array where int64 was compiled crashes the process);
    every call goes through `jitaot.Checked`, which refuses it as numba's dispatcher would. In a child: were a
    check missing, the crash must not take the test session with it."""
    out = subprocess.run([sys.executable, "-c", BAD_CALLS, os.environ["NUMBA_CACHE_DIR"]], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    lines = out.stdout.splitlines()
    assert len(lines) == 11 and all(ln.endswith(" TypeError") for ln in lines), out.stdout


def _copy_module(to: Path) -> tuple[Path, Path]:
    so, meta, _ = jitaot.paths(os.environ["NUMBA_CACHE_DIR"])
    to.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(so, to)), Path(shutil.copy(meta, to))


def test_a_damaged_module_is_never_imported(aot_kernel, tmp_path):
    """One byte changed in the module: its digest (in the JSON beside it) no longer matches, and it is refused
    before its import; a JSON of another shape is refused too. Each error names the file."""
    so, meta = _copy_module(tmp_path / "damaged")
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0x40
    so.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match the digest") as err:
        jitaot.load(tmp_path / "damaged")
    assert so.name in str(err.value)
    so, meta = _copy_module(tmp_path / "bad-json")
    good = json.loads(meta.read_text())
    for text in ("{", json.dumps({"blake3": 1, "exports": {}}), json.dumps([1])):
        meta.write_text(text)
        with pytest.raises(ValueError, match="not a kernel module's description") as err:
            jitaot.load(tmp_path / "bad-json")
        assert meta.name in str(err.value)
    # one argument's dtype changed (uint16 tokens read as uint32: wrong tokens served, or a crash)
    damaged = json.loads(json.dumps(good).replace('"uint16"', '"uint32"', 1))
    meta.write_text(json.dumps(damaged))
    with pytest.raises(ValueError, match="exports do not match their digest") as err:
        jitaot.load(tmp_path / "bad-json")
    assert meta.name in str(err.value)


def test_a_module_others_may_have_written_is_never_imported(aot_kernel, tmp_path):
    """The module, intact, in a folder every user may write (or, as root can arrange, owned by another user): it
    could have been put there by anyone, so it is refused before its import, naming the path."""
    so, meta = _copy_module(tmp_path / "shared")
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(PermissionError, match="writable by every user") as err:
        jitaot.load(tmp_path / "shared")
    assert str(tmp_path / "shared") in str(err.value)
    (tmp_path / "shared").chmod(0o755)
    jitaot.load(tmp_path / "shared")  # (the same bytes load from a folder of this user's)
    if os.getuid() == 0:  # (giving a file to another user needs root)
        os.chown(so, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to user 65534"):
            jitaot.load(tmp_path / "shared")


def test_numbas_cache_folder_is_made_where_the_environment_names_a_missing_one(jit_kernel, tmp_path, monkeypatch):
    """NUMBA_CACHE_DIR naming a folder not made yet (numba takes it at its import): the loader makes it, private,
    before its compile child locks a file in it (before, `--jit numba` then failed to load the kernel)."""
    import numba

    where = tmp_path / "not" / "made"
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(where))
    assert jitload._cache_dir(tmp_path / "other") == str(where)
    assert where.is_dir() and where.stat().st_mode & 0o777 == 0o700


@pytest.mark.slow  # a daemon
def test_a_daemon_whose_kernel_folder_every_user_may_write_says_why_and_serves_the_plan(tmp_path, tokenizer_file,
                                                                                      monkeypatch):
    """The daemon's kernel folder is world-writable: it loads nothing from it (the load a long run starts after its
    first call fails at once), STATS `fast_path.kernel` says failed and why, and the stream is the plan's, made on
    `Plan.step`."""
    import time

    shared = tmp_path / "shared-jit"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(shared))
    corpus = build_corpus(tmp_path, "sltok", tokenizer_file, docs=600, lanes=4, global_batch=8, micro_batch=4,
                          seq_len=64, max_steps=1 << 30)  # (a long run: the load starts after the first call)
    steps = 60
    with Daemon(corpus, cache=corpus / "cache") as d:
        c = d.client()
        batches = []
        for mb in c:
            batches.append({k: v.copy() if hasattr(v, "copy") and k != "samples" else v for k, v in mb.items()})
            if mb["step"] == steps - 1 and mb["micro"] == c.info["micro_per_step"] - 1:
                break
        deadline = time.monotonic() + 30
        while (kernel := c.stats()["fast_path"]["kernel"])["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        fast = c.stats()["fast_path"]
        c.close()
    assert kernel["state"] == "failed" and "writable by every user" in kernel["cause"], kernel
    assert str(shared) in kernel["cause"] and fast["kernel_loaded"] == 0, fast
    assert list(shared.iterdir()) == []
    got = stream_digests(batches, 2)
    ref = reference(corpus, steps, 1)
    assert sorted(got) == list(range(steps)) and all(digest == ref[(s, 0)][0] for s, digest in got.items())


def test_a_damaged_module_leaves_numbas_load_with_one_line(aot_kernel, tmp_path, monkeypatch, caplog):
    """The loader meets the damaged module: one warning line naming it, then the kernels through numba (this
    folder holds the session's warm numba cache: no compile child), and the kernel is active."""
    copy_numba_cache(tmp_path / "jit")
    so, _ = _copy_module(tmp_path / "jit")
    so.write_bytes(so.read_bytes()[:-100])
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "jit"))
    loader = jitload.KernelLoader("auto", tmp_path / "jit")
    with caplog.at_level(logging.INFO, logger="sluice.loaderd"):
        loader.start("test")
        assert loader.wait(120)
    assert loader.state == "active" and loader.how == "numba", (loader.state, loader.cause)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "do not match the digest" in warned[0] and so.name in warned[0], warned


def test_a_failed_build_is_not_tried_again(jit_kernel, tmp_path, monkeypatch):
    """A ``.failed`` file for this key (a machine without a C compiler): no compile child is started for the
    module, and the kernels load through numba."""
    _, _, failed = jitaot.paths(tmp_path / "jit")
    failed.parent.mkdir(parents=True)
    failed.write_text("CompilerError: no C compiler\n")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "jit"))
    loader = jitload.KernelLoader("auto", tmp_path / "jit")
    assert not loader.ready() and jitaot.state(tmp_path / "jit") == "failed"
    loader.start("test")
    assert loader.wait(120)
    # (numba's cache folder is this process's, set at its import: warm, so no child either way)
    assert loader.state == "active" and loader.how == "numba" and loader._child is None, (loader.state, loader.cause)


def test_the_walks_status_codes_are_the_kernels(jit_kernel):
    """`jit.WALK_*` (read without numba) are `jitdraws.WALK_*` (the kernel module imports nothing of sluice)."""
    from sluice.loaderd.logical import jitdraws

    assert (jit.WALK_DONE, jit.WALK_ASIDE, jit.WALK_NEED, jit.WALK_FULL) == (
        jitdraws.WALK_DONE, jitdraws.WALK_ASIDE, jitdraws.WALK_NEED, jitdraws.WALK_FULL)


def test_a_killed_builds_leftovers_are_swept(tmp_path):
    """A build killed midway leaves its ``.build-*`` folder; the next build (under the folder's lock) removes
    every such folder and nothing else."""
    for name in (".build-abc", ".build-def"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "half.o").write_bytes(b"x" * 100)
    (tmp_path / "sluice_kernels_x.json").write_text("{}")
    assert jitaot.sweep(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["sluice_kernels_x.json"]


@pytest.mark.slow
def test_without_a_c_compiler_the_kernels_load_through_numba_and_the_failure_is_said_once(jit_kernel, tmp_path):
    """`CC=/bin/false`: a machine without a working C compiler. The first load's child warms numba's cache (the
    session's numba files, copied without the warm marker: the child loads them and writes the marker), its
    module build fails (a ``.failed`` file with the cause), and the kernels load through numba, with one warning
    line naming the cause and the file to remove; the next load starts no child and says so at info level."""
    copy_numba_cache(tmp_path / "jit", marker=False)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "jit"), "CC": "/bin/false"}
    argv = [sys.executable, "-m", "sluice.loaderd.physical.jitload"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr[-2000:]
    failed = list((tmp_path / "jit").glob("sluice_kernels_*.failed"))
    assert len(failed) == 1 and "compiler" in failed[0].read_text()
    warned = [ln for ln in first.stderr.splitlines() if "not compiled ahead of time" in ln]
    assert len(warned) == 1 and "compiler" in warned[0] and failed[0].name in warned[0], first.stderr[-2000:]
    assert "(numba; started by" in first.stderr
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0 and "(numba; started by" in second.stderr, second.stderr[-2000:]
    assert "was not compiled ahead of time here" in second.stderr
    assert not list((tmp_path / "jit").glob("*.so"))


_COUNTED_BUILD = """
import sys
from sluice.loaderd.physical import jitaot, jitload

real = jitaot.build


def build(where):  # the real build, said on stdout (which of the two children built)
    print("built", flush=True)
    real(where)


jitaot.build = build
jitload.build_in_child(sys.argv[1])
"""


@pytest.mark.slow  # one cold compile (numba's cache, then the module): ~20 s of CPU
def test_compile_children_started_together_build_the_module_once(jit_kernel, tmp_path):
    """Two daemons started together on a node whose cache folder has no module each start a compile child: the
    folder's lock lets one build while the other waits, then finds the module made and builds nothing; one module
    and its JSON are left, no build folder. (numba's own cache there is the session's, copied: a cold folder's
    compile is test_attack_kernel_queue.py's two daemons loading one.)"""
    where = copy_numba_cache(tmp_path / "jit", marker=False)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(where)}
    children = [subprocess.Popen([sys.executable, "-c", _COUNTED_BUILD, str(where)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [c.communicate(timeout=jitload.WARM_TIMEOUT_S) for c in children]
    assert [c.returncode for c in children] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.count("built") for out, _ in outs) == [0, 1], outs
    if jitaot.state(where) == "failed":  # (built once, and it failed: a machine without a C compiler)
        pytest.skip(f"the module could not be built here: {jitaot.paths(where)[2].read_text().strip()}")
    assert sorted(p.suffix for p in where.glob(jitaot.PREFIX + "*") if p.suffix in (".so", ".json")) == \
        [".json", ".so"]
    assert not list(where.glob(".build-*"))
    assert jitaot.state(where) == "built"


_PARENT = """
import sys
from sluice.loaderd.physical import jitload

jitload._warm_in_child(sys.argv[1], on_start=lambda proc: print(proc.pid, flush=True))
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its new parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # numba imported by a child that then compiles for a few seconds
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_compile_child_ends_soon_after_its_daemon_is_killed(tmp_path):
    """A daemon killed with -9 runs no cleanup: its compile child, compiling a cold cache for up to minutes, sees
    its parent gone and ends itself within a second or so, instead of compiling on for a daemon that is gone
    (without its watchdog the child finished its compile and left numba's cache marker and the module)."""
    import signal
    import time

    (tmp_path / "jit").mkdir()  # (as the loader makes it before it starts the child)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "jit")}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "jit")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # (the child imports numba and starts compiling)
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the compile child outlived its killed parent by 20 s"
        # ended by its watchdog, not by finishing its work: neither numba's cache marker nor the module was made
        assert not list((tmp_path / "jit").glob("warm-*")) and jitaot.state(tmp_path / "jit") == "absent"
    finally:
        parent.kill()
        parent.wait()
