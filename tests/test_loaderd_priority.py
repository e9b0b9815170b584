"""Priority is the operator's choice: `loaderd --nice N` renices the whole daemon, nothing else does.

Measured (issue 9): per-thread renicing (+5 producer, +10 workers) cost 85% of
throughput when the trainer's own threads competed for the cores. The daemon
must run at the priority it was started with, plus exactly `--nice`, in every
thread it creates.
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
def test_every_daemon_thread_runs_at_the_start_priority_plus_nice(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (0, 3):
        with Daemon(root, cache=tmp_path / f"cache-{nice}", extra=("--nice", str(nice), "--workers", "2")) as d:
            c = d.client(0, 1)
            for i, _ in enumerate(c):  # the producer and the decode workers have run
                if i == 8:
                    break
            seen = thread_niceness(d.pid)
            c.close()
        assert len(seen) > 3, "expected IO, producer and worker threads"
        want = min(19, base + nice)
        assert set(seen.values()) == {want}, f"--nice {nice}: thread niceness {seen}, expected all {want}"


def test_apply_nice_refuses_out_of_range_and_raising_without_privilege():
    from sluice.errors import SpecError
    from sluice.loaderd.cli import apply_nice

    with pytest.raises(SpecError, match="outside"):
        apply_nice(99)
    if os.geteuid() != 0 and os.getpriority(os.PRIO_PROCESS, 0) == 0:
        with pytest.raises(SpecError, match="--nice -1: cannot change the priority"):
            apply_nice(-1)
    apply_nice(0)  # no-op
