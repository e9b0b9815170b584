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
    procs = list(pool._processes.values())
    t0 = time.monotonic()
    stop_pool(pool)
    assert time.monotonic() - t0 < 10, "stop_pool waited for the running task"
    assert procs and not any(p.is_alive() for p in procs), "a worker outlived stop_pool"
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
