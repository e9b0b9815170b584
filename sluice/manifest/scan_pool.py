"""Freeze's local engines: objects scanned in a pool of processes or of threads.

Checking jsonl lines and reading tar members run Python (they hold the GIL),
so a thread pool gives them one core; hashing alone (BLAKE3 releases the
GIL) scales on threads. `choose_processes` picks a process pool sized to the
node when the work is GIL-bound and big enough to pay for starting it (about
half a second), threads otherwise. Either way each object is one task and the
results come back in job order, so the manifest bytes do not depend on the
pool, its size or which task finished first.

Processes start with `forkserver` (fork from a clean server, not from this
process and its threads) where the platform has it, `spawn` elsewhere. They
and their fork server ignore SIGINT (sluice.procpool): on an error the parent
sets a shared stop event and every scan stops at its next chunk; on Ctrl-C it
terminates them (a scan writes nothing). Progress crosses as a shared byte counter polled by the parent.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from sluice.errors import ManifestError
from sluice.manifest import formats

if TYPE_CHECKING:
    from sluice.manifest.freeze import Progress, ScanJob
    from sluice.manifest.storage import S3Options

PROCESS_MIN_BYTES = 1 << 30  # below this a process pool costs more to start than it saves
_POLL_S = 0.2  # progress refresh while waiting for results

_stop: Any = None  # in a worker: the parent's stop event
_counter: Any = None  # in a worker: the shared byte counter


def node_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def gil_bound_job(job: ScanJob) -> bool:
    """Whether scanning `job` runs mostly in Python: checking jsonl lines, decoding, reading tar members
    (hashing alone and numpy's newline count release the GIL)."""
    if job.fmt == "webdataset":
        return True
    return job.fmt == "jsonl" and (job.check == "full" or job.compression != "none")


def choose_processes(jobs: list[ScanJob], sizes: list[int], processes: int | None) -> int:
    """Workers of a process pool for these jobs; 0 means scan them on threads.

    `processes`: None = automatic (one per CPU, at most one per job, when a
    job is GIL-bound (`gil_bound_job`) and the jobs hold at least
    PROCESS_MIN_BYTES), 0 =
    threads only, N = N processes (at most one per job).
    """
    if processes is not None:
        return max(0, min(processes, len(jobs))) if processes > 1 else 0
    gil_bound = any(gil_bound_job(j) for j in jobs)
    workers = min(node_cpus(), len(jobs))
    return workers if gil_bound and workers > 1 and sum(sizes) >= PROCESS_MIN_BYTES else 0


def scan_one(job: ScanJob, s3: S3Options | None = None, stop: Any = None,
             on_bytes: Callable[[int], None] | None = None) -> formats.ScanResult:
    """The per-object work of freeze, whatever the engine: BLAKE3 + record count + validation in one pass."""
    return formats.scan_object(job.path, job.fmt, job.compression, job.text_field, where=job.where,
                               check=job.check, stop=stop, on_bytes=on_bytes, s3=s3)


def _init_worker(stop: Any, counter: Any) -> None:
    global _stop, _counter
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it sets `stop`
    _stop, _counter = stop, counter


def _add(n: int) -> None:
    with _counter.get_lock():
        _counter.value += n


def _scan_in_worker(job: ScanJob, s3: S3Options | None) -> formats.ScanResult:
    return scan_one(job, s3, _stop, _add)


def _context() -> Any:
    from sluice.procpool import pool_context  # the server, still importing, must not answer Ctrl-C

    return pool_context(["sluice.manifest.scan_pool"])  # the server imports once; workers fork ready


def scan_processes(jobs: list[ScanJob], *, workers: int, s3: S3Options | None,
                   progress: Progress) -> list[formats.ScanResult]:
    """Scan `jobs` in `workers` processes; results in job order; on any failure the running scans stop."""
    ctx = _context()
    stop, counter = ctx.Event(), ctx.Value("q", 0)
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                  initargs=(stop, counter))
    return _gather(pool, stop, jobs, lambda job: pool.submit(_scan_in_worker, job, s3), progress, counter)


def scan_threads(jobs: list[ScanJob], *, threads: int | None, s3: S3Options | None,
                 progress: Progress) -> list[formats.ScanResult]:
    """Scan `jobs` on a thread pool (default min(8, max(2, cores))); on any failure the running scans stop."""
    workers = max(1, threads if threads is not None else min(8, max(2, os.cpu_count() or 1)))
    stop = threading.Event()
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sluice-freeze")
    return _gather(pool, stop, jobs, lambda job: pool.submit(scan_one, job, s3, stop, progress.bytes), progress)


def _gather(pool: cf.Executor, stop: Any, jobs: list[ScanJob], submit: Callable[[ScanJob], cf.Future[Any]],
            progress: Progress, counter: Any = None) -> list[formats.ScanResult]:
    """Submit every job, collect the results in job order, re-raise the first failure after setting
    `stop` (running scans stop at their next chunk) and shutting the pool down."""
    results: list[formats.ScanResult | None] = [None] * len(jobs)
    seen = 0
    try:
        from sluice.procpool import ctrl_c_deferred

        with ctrl_c_deferred():  # a submission may start a worker process: never leave one half-started
            futures = {submit(job): k for k, job in enumerate(jobs)}
        waiting = set(futures)
        while waiting:
            done, waiting = cf.wait(waiting, timeout=_POLL_S, return_when=cf.FIRST_COMPLETED)
            if counter is not None:  # bytes scanned in the worker processes
                now = counter.value
                progress.bytes(now - seen)
                seen = now
            for fut in done:
                try:
                    results[futures[fut]] = fut.result()  # re-raises the scan's error
                except BrokenProcessPool as exc:  # imported: cf.process exists only once a process pool was made
                    raise ManifestError(
                        f"{jobs[futures[fut]].where}: a freeze worker process died ({exc}; killed, out of "
                        "memory, or a script calling freeze() without an `if __name__ == \"__main__\":` guard?); "
                        "nothing was written. Rerun, or with --processes 0 (processes=0) to scan on threads"
                    ) from exc
                progress.object_done()
    except BaseException as exc:
        stop.set()
        if isinstance(exc, KeyboardInterrupt) and isinstance(pool, cf.ProcessPoolExecutor):
            from sluice.procpool import stop_pool

            stop_pool(pool)  # Ctrl-C: exit now; a worker still starting would fail loudly without its parent
        else:
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [r for r in results if r is not None]
