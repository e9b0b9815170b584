"""The Ray engine: freeze and pretokenize with one Ray task per object.

    freeze_ray("dataset.toml", "manifest.json")                 # a local Ray, num_cpus=2, for the call
    freeze_ray("dataset.toml", "manifest.json", address="auto")  # the running cluster
    pretokenize_ray(load_manifest("manifest.json"), "tok/", address="ray://head:10001")

The driver plans exactly as the local engine does (`freeze` / `pretokenize`
with an `engine=` callable), submits `scan_job` / `tokenize_object` as tasks,
keeps at most `2 x cluster CPUs` of them in flight (so the driver's memory does
not grow with the object count), collects the results in list order, and writes
the manifest once, last. Outputs are byte-identical to the local engine.

Objects are read where they are: every worker must see the same paths as the
driver (a shared filesystem) or reach the same s3:// store. A pretokenize
worker writes its shard straight into the output folder (temp file + rename).

Failures: a worker that dies (killed, OOM, node lost) is a system failure and
Ray retries its task (`MAX_RETRIES`); the per-object functions are pure, so a
retry writes the same bytes. A bad object raises its SluiceError (naming the
object) in the task; that is not retried, the remaining tasks are cancelled
and the driver re-raises it, so no manifest is written.

Ray ships task arguments and results between its processes with its own
serialization (pickle): that is the cluster's internal transport among
machines the user trusts, and only plain dataclasses of paths, digests and
counts cross it. Nothing read from a manifest, shard or tokenizer is
unpickled by sluice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from sluice.engines.ray_connect import connect, loopback_only
from sluice.errors import EngineError, SluiceError
from sluice.manifest.freeze import Progress, ScanJob, freeze, scan_job
from sluice.manifest.model import Manifest
from sluice.manifest.storage import S3Options
from sluice.tokenize.pretokenize import PretokenizeResult, ShardDone, ShardTask, pretokenize, tokenize_object

LOCAL_CPUS = 2  # a local Ray started for one call
MAX_RETRIES = 3  # per task, on worker death only (never on a bad object)
LOCAL_OBJECT_STORE = 128 << 20  # results are small; keep a local Ray's shared memory small too
# Tests only (never set in a real run): the first task to create this file
# kills its own worker with SIGKILL, so Ray must retry it.
FAULT_ENV = "SLUICE_FAULT_KILL_RAY_WORKER"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineError("--engine ray needs Ray: pip install 'sluice[ray]'") from exc
    return ray


@contextlib.contextmanager
def ray_session(address: str | None = None, *, num_cpus: int = LOCAL_CPUS) -> Iterator[Any]:
    """The `ray` module, connected: the caller's Ray if already initialized, else `address`, else a local Ray.

    A Ray started here listens on 127.0.0.1 only (`ray_connect.loopback_only`) and is
    shut down on exit. Raises EngineError naming the address and the cause when it cannot be
    reached (`ray_connect.check_cluster`: within CONNECT_TIMEOUT_S).
    """
    ray = _import_ray()
    if ray.is_initialized():
        yield ray  # the caller's session (a notebook, a Ray job's driver, a test fixture)
        return
    if address:
        connect(ray, address)  # EngineError naming the address and the cause, within CONNECT_TIMEOUT_S
    else:
        try:
            with loopback_only():  # reachable from this machine only
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
                         object_store_memory=LOCAL_OBJECT_STORE)
        except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError...
            raise EngineError(f"ray engine: cannot start a local Ray (num_cpus={num_cpus}) "
                              f"({type(exc).__name__}: {exc})") from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def _fault_once(marker: str | None) -> None:
    if not marker:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _scan_task(job: ScanJob, s3: S3Options | None, fault: str | None) -> Any:
    _fault_once(fault)
    return scan_job(job, s3=s3)


_ENCODERS: dict[tuple[str, str], Any] = {}  # per worker process: (digest, backend) -> Encoder, loaded once


def _tokenize_task(task: ShardTask, tok_path: str, tok_digest: str, backend: str, s3: S3Options,
                   fault: str | None) -> ShardDone:
    from sluice.tokenize.encoder import load_tokenizer
    from sluice.tokenize.threads import configure_threads

    _fault_once(fault)
    encoder = _ENCODERS.get((tok_digest, backend))
    if encoder is None:
        configure_threads(1)  # Ray's CPUs are the parallelism: one Rust thread per task
        encoder = _ENCODERS[(tok_digest, backend)] = load_tokenizer(tok_path, tok_digest, backend=backend)
    return tokenize_object(encoder, task, s3)


def _run(ray: Any, fn: Callable[..., Any], items: list[Any], args: tuple[Any, ...], sizes: list[int],
         names: list[str], bar: Progress) -> list[Any]:
    """fn(item, *args) as one Ray task per item; results in item order; the first failure is re-raised."""
    remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(fn)
    limit = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    results: list[Any] = [None] * len(items)
    pending: dict[Any, int] = {}
    queue = iter(range(len(items)))
    try:
        for k in queue:
            pending[remote.remote(items[k], *args)] = k
            if len(pending) >= limit:
                break
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(ready[0])
            results[k] = _get(ray, ready[0], names[k])
            bar.bytes(sizes[k])
            bar.object_done()
            nxt = next(queue, None)
            if nxt is not None:
                pending[remote.remote(items[nxt], *args)] = nxt
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    return results


def _get(ray: Any, ref: Any, name: str) -> Any:
    from ray import exceptions as rex

    try:
        return ray.get(ref)
    except rex.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SluiceError):
            raise cause from None  # the object's own error, as the local engine raises it
        raise EngineError(f"ray engine: the task for {name} failed ({cause or exc})") from exc
    except rex.RayError as exc:  # worker died more than MAX_RETRIES times, node lost, ...
        raise EngineError(f"ray engine: the task for {name} was lost after {MAX_RETRIES} retries ({exc})") from exc


def freeze_ray(spec_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
               address: str | None = None, progress: bool = True, check: str = "full",
               s3: S3Options | None = None, num_cpus: int = LOCAL_CPUS, notes: list[str] | None = None) -> Manifest:
    """`freeze` with one Ray task per object; the same manifest bytes as the local engine.

    `address`: a Ray cluster (`auto`, `ray://head:10001`); None starts a local
    Ray with `num_cpus` CPUs for the call (or uses one already initialized).
    Raises what `freeze` raises, and EngineError when Ray is missing or lost a task.
    """
    fault = os.environ.get(FAULT_ENV) or None
    # The driver's S3 settings travel with the tasks: a worker's own environment may have none.
    s3 = s3 if s3 is not None else S3Options.from_env()
    with ray_session(address, num_cpus=num_cpus) as ray:
        def engine(jobs: list[ScanJob], s3_opts: S3Options | None, bar: Progress) -> list[Any]:
            sizes = [_size(job.path) for job in jobs]
            return _run(ray, _scan_task, jobs, (s3_opts, fault), sizes, [job.where for job in jobs], bar)

        return freeze(spec_path, out_path, progress=progress, check=check, s3=s3, engine=engine, notes=notes)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # a URL or gone: the task itself reports a missing object
        return 0


def pretokenize_ray(manifest: Manifest, out_dir: str | os.PathLike[str], *, address: str | None = None,
                    progress: bool | None = None, num_cpus: int = LOCAL_CPUS) -> PretokenizeResult:
    """`pretokenize` with one Ray task per raw object; the same shards and manifest bytes as the local engine.

    `address` as in `freeze_ray`. The tokenizer and the raw objects must be
    readable at the same paths on every worker. Raises what `pretokenize`
    raises, and EngineError when Ray is missing or lost a task.
    """
    fault = os.environ.get(FAULT_ENV) or None
    s3 = S3Options.from_env()
    with ray_session(address, num_cpus=num_cpus) as ray:
        def engine(tasks: list[ShardTask], tok_path: str, tok_digest: str, show: bool | None,
                   backend: str) -> dict[str, ShardDone]:
            enabled = sys.stderr.isatty() if show is None else show
            bar = Progress(enabled, sum(t.size for t in tasks), len(tasks), desc="pretokenize")
            try:
                names = [f"object {t.location} of source {t.source!r}" for t in tasks]
                done = _run(ray, _tokenize_task, tasks, (tok_path, tok_digest, backend, s3, fault),
                            [t.size for t in tasks], names, bar)
            finally:
                bar.close()
            return {d.key: d for d in done}

        return pretokenize(manifest, out_dir, progress=progress, engine=engine)
