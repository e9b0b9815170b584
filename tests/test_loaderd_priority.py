"""Priority is the operator's choice (`nice -n N loaderd`, systemd `Nice=`); the daemon never changes it.

Measured (issue 9): per-thread renicing (+5 producer, +10 workers) cost 85% of
throughput when the trainer's own threads competed for the cores. The daemon
must run every thread it creates at the priority it was started with.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaderd_support import Daemon, build_corpus


def thread_niceness(pid: int) -> dict[int, int]:
    """tid -> niceness of every thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_every_daemon_thread_runs_at_the_priority_it_was_started_with(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (0, 3):  # started normally, and started by an operator under `nice -n 3`
        d = Daemon(root, cache=tmp_path / f"cache-{nice}", extra=("--workers", "2"))
        if nice:
            d.args = ["nice", "-n", str(nice), *d.args]
        d.start()
        try:
            c = d.client(0, 1)
            for i, _ in enumerate(c):  # the producer and the decode workers have run
                if i == 8:
                    break
            seen = thread_niceness(d.pid)
            c.close()
        finally:
            d.stop()
        assert len(seen) > 3, "expected IO, producer and worker threads"
        want = min(19, base + nice)
        assert set(seen.values()) == {want}, f"started at niceness {want}: thread niceness {seen}"


def test_the_package_has_no_priority_code():
    """No module may renice anything: priority is set from outside, before the daemon starts."""
    import sluice

    pkg = Path(sluice.__file__).parent
    calls = ("os.nice(", "setpriority(", "sched_setscheduler(")
    hits = [f"{f.relative_to(pkg)}: {c}" for f in pkg.rglob("*.py") for c in calls if c in f.read_text()]
    assert not hits, hits
