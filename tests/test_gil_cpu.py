"""The threads that share the GIL (the IO loop, the producers) on one CPU: `--gil-cpu` (sluice/loaderd/gilcpu.py).

Real daemons serving real clients; what is pinned is read from the kernel
(/proc/PID/task/TID/status), never from the daemon's own account alone:

* auto (the default): the main thread and the producer are on the one CPU STATS names;
  every other thread, the tokenizer's and workers' included, and every
  worker process (`--worker-kind process`, made by the fork server) has the
  process's CPUs;
* other work that keeps that CPU busy (a process pinned to it) moves them to
  the other CPU within a few checks, counted in STATS;
* off: nothing pinned; a CPU number: there; a bad value: exit 2 naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loaderd_support import Daemon, build_corpus

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="needs per-thread affinity (Linux) and at least 2 CPUs"),
]

ALL = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def cpus_of(pid: int, tid: int | None = None) -> set[int]:
    """The CPUs the kernel lets task `tid` of process `pid` run on (the process's main thread: `tid` None)."""
    path = f"/proc/{pid}/task/{tid}/status" if tid is not None else f"/proc/{pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                out: set[int] = set()
                for part in line.split(":", 1)[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    out.update(range(int(lo), int(hi or lo) + 1))
                return out
    raise AssertionError(f"no Cpus_allowed_list in {path}")


def tasks(pid: int) -> dict[int, set[int]]:
    """Every thread of `pid`: its CPUs."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(name)] = cpus_of(pid, int(name))
        except (OSError, AssertionError):  # (ended meanwhile)
            continue
    return out


def stats(d: Daemon) -> dict:
    c = d.client(0, 1)
    try:
        return c.stats()
    finally:
        c.close()


def wait_until(what: str, check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file) -> Path:
    return build_corpus(tmp_path_factory.mktemp("gil") / "c", "jsonl", tokenizer_file, docs=600, objects=4)


def test_auto_the_default_pins_the_io_loop_and_the_producer_and_nothing_else(corpus, tmp_path):
    import psutil

    with Daemon(corpus, cache=tmp_path / "cache", extra=("--worker-kind", "process")) as d:  # auto: the default
        c = d.client(0, 1)
        for _ in range(20):  # (a cold cache: the worker processes tokenize, the producer waits for them)
            next(c)
        got = c.stats()["gil_cpu"]
        c.close()
        assert got["mode"] == "auto" and got["cpu"] in ALL, got
        cpu = got["cpu"]
        workers = psutil.Process(d.pid).children(recursive=True)
        assert workers, "no worker process: the test reads nothing"

        def settled():  # (a thread started by a pinned one is spread at the next upkeep, every 0.5 s)
            now = tasks(d.pid)
            return now if sum(1 for s in now.values() if s == {cpu}) == 2 else None

        threads = wait_until("only the IO loop and the producer on the GIL's CPU", settled)
        assert threads[d.pid] == {cpu}  # the main thread: the IO loop
        others = {tid: s for tid, s in threads.items() if s != {cpu}}
        assert len(threads) > 4 and all(s == ALL for s in others.values()), threads
        for w in workers:
            assert set(w.cpu_affinity()) == ALL, (w, w.cpu_affinity())


def test_busy_cpu_moves_the_threads(corpus, tmp_path):
    from loaderd_support import scrape

    with Daemon(corpus, cache=tmp_path / "cache", extra=("--log-level", "info", "--metrics-port", "0",
                                                              "--gil-cpu", "auto")) as d:
        cpu = stats(d)["gil_cpu"]["cpu"]
        assert scrape(d.info["metrics_port"])["sluice_gil_cpu"][()] == cpu
        # Other work on that CPU: a busy process pinned to it, until the daemon's threads leave it
        hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
                                                      "while True: pass"])
        try:
            got = wait_until("the GIL's threads moved off the busy CPU",
                             lambda: (s := stats(d)["gil_cpu"])["moves"] >= 1 and s, timeout_s=20)
        finally:
            hog.kill()
            hog.wait()
        assert got["cpu"] != cpu and got["cpu"] in ALL, got
        assert cpus_of(d.pid) == {got["cpu"]}
        assert "the GIL's threads move" in d.log.read_text()
        seen = wait_until("the move in the metrics", lambda: (m := scrape(d.info["metrics_port"]))[
            "sluice_gil_cpu_moves_total"][()] >= 1 and m)
        assert seen["sluice_gil_cpu"][()] == got["cpu"]


def test_off_pins_nothing_and_a_number_pins_there(corpus, tmp_path):
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--gil-cpu", "off")) as d:
        c = d.client(0, 1)
        next(c)
        assert c.stats()["gil_cpu"] == {"mode": "off", "cpu": None, "moves": 0, "spread_threads": 0}
        c.close()
        assert all(s == ALL for s in tasks(d.pid).values())
    last = max(ALL)
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--gil-cpu", str(last))) as d:
        c = d.client(0, 1)
        next(c)
        assert c.stats()["gil_cpu"]["cpu"] == last
        c.close()
        assert cpus_of(d.pid) == {last}


@pytest.mark.parametrize("value", ["4096", "x", "-1", "1.5"])
def test_a_bad_gil_cpu_is_refused_by_name(corpus, tmp_path, value):
    from loaderd_support import BOOT

    proc = subprocess.run([sys.executable, "-c", BOOT, str(corpus / "manifest.json"), str(corpus / "run.toml"),
                           "--cache", str(tmp_path / "cache"), "--gil-cpu", value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert "--gil-cpu" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_pinned_thread_starts_the_fork_server_on_every_cpu():
    """The fork server forks every worker process: started by a thread on one CPU (a producer's first fill), it
    would put every worker there. `pool_context` starts it with the process's CPUs, and the thread keeps its
    one CPU after."""
    code = ("import os\n"
            "from sluice import affinity\n"  # (the process's CPUs, read before the pin below, as in the daemon)
            "os.sched_setaffinity(0, {min(affinity.CPUS)})\n"
            "from concurrent.futures import ProcessPoolExecutor\n"
            "from sluice.procpool import pool_context\n"
            "from multiprocessing import resource_tracker\n"
            "with ProcessPoolExecutor(1, mp_context=pool_context()) as ex:\n"
            "    tracker = sorted(os.sched_getaffinity(resource_tracker._resource_tracker._pid))\n"
            "    print(sorted(ex.submit(os.sched_getaffinity, 0).result()), sorted(os.sched_getaffinity(0)), tracker)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("] [") == [str(sorted(ALL))[:-1], f"{min(ALL)}", str(sorted(ALL))[1:] + "\n"], \
        got.stdout  # (the worker, this thread, the resource tracker)


def test_a_pinned_thread_starts_the_kernels_compile_child_on_every_cpu(tmp_path):
    """A cold numba cache is compiled in a child process, started by the producer's thread (pinned under
    --gil-cpu): the child gets the process's CPUs (`affinity.widened`), the thread keeps its one CPU."""
    code = ("import os, sys\n"
            "from sluice import affinity\n"
            "os.sched_setaffinity(0, {min(affinity.CPUS)})\n"
            "from sluice.loaderd.physical import jitload\n"
            "seen = []\n"
            "def started(proc):\n"
            "    seen.append(sorted(os.sched_getaffinity(proc.pid)))\n"
            "    proc.kill()  # (its CPUs are all this test reads: no compile)\n"
            "try:\n"
            "    jitload._warm_in_child(sys.argv[1], on_start=started)\n"
            "except RuntimeError:\n"
            "    pass\n"
            "print(seen, sorted(os.sched_getaffinity(0)))\n")
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "numba")], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"{[sorted(ALL)]} {[min(ALL)]}", got.stdout


def test_a_cpu_the_process_may_not_use_turns_pinning_off_with_a_warning(caplog):
    """An embedded `ServerConfig(gil_cpu=N)` is not checked against the process's CPUs as the command line's
    is: the pin fails, is said once, and leaves the thread as it was."""
    from sluice.loaderd.gilcpu import GilCpu

    before = os.sched_getaffinity(0)
    gil = GilCpu(4095)
    with caplog.at_level("WARNING", logger="sluice.loaderd"):
        gil.start([])
        gil.tick(time.monotonic())
    assert os.sched_getaffinity(0) == before
    assert gil.stats() == {"mode": 4095, "cpu": None, "moves": 0, "spread_threads": 0}
    assert [r.getMessage() for r in caplog.records if "--gil-cpu 4095" in r.getMessage()], caplog.records
