"""sluice.procpool: the command-line tools' process pools leave Ctrl-C to the command.

A terminal's Ctrl-C reaches every process of its group; the pools' fork server
and workers must not answer it (tracebacks of their own, a worker dying half
started), and the command must stop them at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sluice.procpool import ctrl_c_deferred


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test (a pytest-xdist worker ignores SIGINT)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_in_the_block_is_raised_after_it_the_block_completes(python_sigint):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a Python-level handler runs here, and must not raise
            done.append("block")
    assert done == ["block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_ctrl_c_no_exception_and_the_handler_is_restored(python_sigint):
    with ctrl_c_deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_POOL_SCRIPT = """
import signal, sys, time
from concurrent.futures import ProcessPoolExecutor
from sluice.procpool import pool_context, stop_pool

def blocked():
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())

if __name__ == "__main__":
    ctx = pool_context()
    assert not blocked(), "the caller's own mask is left as it was"
    pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
    assert pool.submit(blocked).result(timeout=60), "a worker answers Ctrl-C"
    tasks = [pool.submit(time.sleep, 60) for _ in range(4)]  # one running, the rest queued
    procs, manager = list(pool._processes.values()), pool._executor_manager_thread
    t0 = time.monotonic()
    stop_pool(pool)
    assert time.monotonic() - t0 < 10, "stop_pool waited for the running task"
    assert procs and not any(p.is_alive() for p in procs), "a worker outlived stop_pool"
    # its wake-up pipe is closed: the interpreter's exit hook may not race that close (EBADF at exit)
    assert not manager.is_alive(), "the pool's manager thread outlived stop_pool"
    assert not any(t.done() and not t.cancelled() and t.exception() is None for t in tasks), "a task ran on"
    print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="forkserver and pthread_sigmask: Linux")
def test_pool_workers_ignore_ctrl_c_and_stop_pool_ends_them_at_once(tmp_path):
    # In a fresh process: the fork server is one per process, and a test worker may run one already.
    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="forkserver and pthread_sigmask: Linux")
@pytest.mark.parametrize("flags", [("--demand-workers", "2"), ("--worker-kind", "process", "--demand-workers", "2")],
                         ids=["demand-pool", "fill-and-demand-pools"])
def test_ctrl_c_in_a_terminal_drains_the_daemon_without_tracebacks_from_its_pools(tmp_path, tokenizer_file, flags):
    """A terminal's Ctrl-C reaches the daemon and its pools' processes: the daemon drains and exits 0;
    the workers (SIGINT blocked from their fork server on) print nothing. Before: each idle demand
    worker printed a KeyboardInterrupt traceback (`--demand-workers auto` starts them from 8 CPUs)."""
    from loaderd_support import BOOT, build_corpus
    from support import foreground_sigint

    corpus = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file)
    endpoint_file = tmp_path / "endpoint"
    proc = subprocess.Popen([sys.executable, "-c", BOOT, str(corpus / "manifest.json"), str(corpus / "run.toml"),
                             "--cache", str(tmp_path / "cache"), "--endpoint-file", str(endpoint_file),
                             "--log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=foreground_sigint)
    try:
        deadline = time.monotonic() + 60
        while not endpoint_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        time.sleep(1.5)  # the pools have started (demand workers start with the daemon)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
