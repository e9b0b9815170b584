"""Where a daemon's time goes: every thread's stack sampled, and each thread's CPU, in the daemon itself.

Not imported by sluice. Put this folder first on PYTHONPATH and name an output
prefix (both absolute: bench/peers runs its jobs in scratch folders); every
process started as ``python -c ...`` (the embedded daemon of
`sluice.client.embedded_client`, so the daemons of bench/peers' sluice jobs)
then runs a sampler thread::

    PYTHONPATH=$PWD/bench/sample_daemon SLUICE_PROF_OUT=/tmp/prof \\
        .venv/bin/python bench/peers/run.py --peers "sluice tiktoken" --rounds 1 --sweep "" --batches corpus

Every 10 ms it records each thread's innermost 6 frames (wall-clock samples:
a thread waiting on a lock is sampled too, as waiting) and reads each
thread's CPU seconds from /proc/self/task/<tid>/stat; every 100 samples it
rewrites ``<prefix>.<pid>`` (JSON: ``cpu`` by thread name, ``stacks``: the
400 most frequent "thread | frame < caller < ..." with their counts). The
sampler itself takes the GIL 100 times a second: it slows the daemon a little
(compare rates without it).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

_PREFIX = os.environ.get("SLUICE_PROF_OUT")


def _cpu_of(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def _sample(out: str) -> None:
    counts: collections.Counter[str] = collections.Counter()
    last: dict[int, tuple[str, float]] = {}  # native id -> (name, CPU seconds at its last sample)
    n = 0
    me = threading.get_ident()
    while True:
        time.sleep(0.01)
        threads = {t.ident: t for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            thread = threads.get(ident)
            if thread is None or ident == me:
                continue
            stack = []
            f = frame
            while f is not None and len(stack) < 6:
                stack.append(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}:{f.f_lineno}")
                f = f.f_back
            kind = thread.name.split("_")[0].rstrip("0123456789-")  # pool threads by their prefix
            counts[f"{kind} | {' < '.join(stack)}"] += 1
            if thread.native_id:
                cpu = _cpu_of(thread.native_id)
                if cpu is not None:
                    last[thread.native_id] = (thread.name, cpu)
        n += 1
        if n % 100 == 0:
            cpu_by_name: dict[str, float] = {}
            for name, cpu in last.values():
                cpu_by_name[name] = cpu_by_name.get(name, 0.0) + cpu
            with open(out + ".tmp", "w") as f:
                json.dump({"cpu": cpu_by_name, "stacks": counts.most_common(400)}, f)
            os.replace(out + ".tmp", out)


if _PREFIX and sys.argv and sys.argv[0] == "-c":
    threading.Thread(target=_sample, args=(f"{_PREFIX}.{os.getpid()}",), daemon=True, name="sampler").start()
