"""Worker processes that tokenize the records a step needs out of order, off the daemon's GIL.

The demand task (demand.py, docsource.py) reads chosen records of an object
and encodes them. In a thread of the daemon, the record parsing (JSON) holds
the GIL next to the producer and the IO thread, and its `encode_batch` shares
the process's one `tokenizers` thread pool with the in-order fill. A
`DemandPool` runs that work in `workers` processes instead::

    demand thread  --(object, raw path, records as int64 bytes, out path)-->  worker k (the object's home)
                   <--("ok", pid, documents, tokens)----------------------    RecordLocator.texts -> encode_batch
    np.fromfile(out path): <u8 lengths, then <u4 tokens  -> one array per record; the file is unlinked

Tokens cross as a file in the cache's temporary folder (in the page cache;
read once and unlinked at once), never as pickled lists; only a few numbers
come back through the executor. An object always goes to the same worker
(its home: the one with the fewest objects when first seen), which keeps the
object's `RecordLocator` (its line marks, taken from the raw fill's
`LineIndex` sent with the first batch when there is one; a compressed
object's decoded spool) between batches; a worker keeps at most `_LOCATORS` of them (least
recently used closed first) and closes one when `forget` says its fill ended.

Bounded queue, declared policy: each object in progress has at most one
batch in flight (its `Demand.busy` flag), so a worker's queue holds at most
one batch per object homed there (objects in progress are bounded by the
DocSource's `max_inflight`); the demand thread that sent a batch waits for it
(blocking is the policy at the bound, as everywhere in the daemon).

A worker that dies (kill -9, a crash) breaks only its own executor: the
batch is sent again to a fresh worker up to `retries` times (the records are
read again from the raw object: same ids), then `TokenizerWorkerError` names
the worker, the object and the records; a worker that does not answer within
`timeout_s` is killed and counted the same way. Never a silent wait.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from sluice import affinity
from sluice.errors import DISK_REFUSALS, CacheWriteError, SluiceError, TokenizerWorkerError

if TYPE_CHECKING:  # imported where used: `default_workers` runs at every daemon start, before anything else
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

log = logging.getLogger("sluice.loaderd")

_LOCATORS = 8  # open RecordLocators per worker (each: a file, marks, maybe a decoded spool on disk)
TIMEOUT_S = 300.0  # the longest one batch may take in a worker before it is killed and retried


class DemandPool:
    """`workers` tokenizer processes for out-of-order records (see the module docstring). Thread-safe."""

    def __init__(self, manifest: Any, workers: int, spool_dir: str, *, threads: int = 1, retries: int = 1,
                 timeout_s: float = TIMEOUT_S) -> None:
        """`threads`: `tokenizers`/tiktoken threads per worker; `retries`: sends of a batch after its
        worker died; `spool_dir`: where token files (and compressed objects' decoded spools) go."""
        if workers < 1 or threads < 1 or retries < 0 or timeout_s <= 0:
            raise SluiceError(f"demand pool: workers={workers}, threads={threads}, retries={retries}, "
                              f"timeout_s={timeout_s}: need workers, threads >= 1, retries >= 0, timeout > 0")
        self._manifest = manifest
        self._spool = spool_dir
        self._threads = threads
        self.retries = retries
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._execs: list[ProcessPoolExecutor | None] = [None] * workers
        self._pids: list[int | None] = [None] * workers
        self._homes: dict[tuple[int, int], int] = {}
        self._opened: set[tuple[int, tuple[int, int]]] = set()  # (worker, object) sent its line index
        self._names = itertools.count()
        self._closed = False
        self.restarts = 0  # workers replaced after they died or hung
        self.documents = 0  # documents tokenized by the workers
        self.indexed = 0  # objects a worker located with their raw fill's line index (no line counted)
        for k in range(workers):  # start them now: the first batch does not wait for a tokenizer to load
            self._executor(k)

    @property
    def workers(self) -> int:
        return len(self._execs)

    def _executor(self, k: int) -> ProcessPoolExecutor:
        """Under no lock: worker k's executor, started if absent (its pid is learnt from its first answer)."""
        from concurrent.futures import ProcessPoolExecutor

        with self._lock:
            if self._closed:
                raise SluiceError("demand pool: closed")
            ex = self._execs[k]
            if ex is None:
                from sluice.procpool import pool_context

                ctx = pool_context()  # workers leave a terminal's Ctrl-C to the daemon, which drains and closes them
                ex = self._execs[k] = ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_init,
                                                          initargs=(self._manifest, self._threads, self._spool))
                self._pids[k] = None
                fut = ex.submit(os.getpid)
                fut.add_done_callback(lambda f, k=k, ex=ex: self._learn_pid(k, ex, f))
            return ex

    def _learn_pid(self, k: int, ex: ProcessPoolExecutor, fut: Any) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            if self._execs[k] is ex:
                self._pids[k] = fut.result()

    def ready(self) -> bool:
        """Whether every worker has started (its tokenizer loaded); until then the caller may tokenize
        in its own thread rather than wait for a process to start."""
        with self._lock:
            return all(p is not None for p in self._pids)

    def pids(self, timeout: float = 30.0) -> list[int]:
        """The workers' process ids (waiting for the ones still starting, at most `timeout` s)."""
        out = []
        for k in range(self.workers):
            ex = self._executor(k)
            out.append(int(ex.submit(os.getpid).result(timeout)))
        return out

    def _home(self, key: tuple[int, int]) -> int:
        with self._lock:
            k = self._homes.get(key)
            if k is None:
                load = [0] * self.workers
                for v in self._homes.values():
                    load[v] += 1
                k = self._homes[key] = load.index(min(load))
            return k

    def tokens(self, key: tuple[int, int], raw_path: str, records: list[int], *, index: Any = None,
               digest: str | None = None) -> list[np.ndarray]:
        """The uint32 token arrays of `records` of object `key` (whose raw bytes are at `raw_path`).

        `index`/`digest`: the object's `LineIndex` from its raw fill (records.py), sent with the
        first batch of the object to a worker, which then counts no line (a worker that closed
        the object's locator, or a fresh one after a death, counts them).

        Raises SourceReadError (from the worker's locator, naming the object
        and line) for a bad record, TokenizerWorkerError when its worker died
        or hung on every try.
        """
        from concurrent.futures import TimeoutError as FutureTimeout
        from concurrent.futures.process import BrokenProcessPool

        import numpy as np

        from sluice.errors import SourceReadError

        k = self._home(key)
        out = os.path.join(self._spool, f"demand-{os.getpid()}-{next(self._names)}.tok")
        wanted = np.asarray(records, dtype="<i8").tobytes()
        tries = 0
        try:
            while True:
                ex = self._executor(k)
                with self._lock:
                    first = (k, key) not in self._opened
                    self._opened.add((k, key))
                try:
                    fut = ex.submit(_tokens, key, raw_path, wanted, out, *((index, digest) if first else ()))
                    got = fut.result(self.timeout_s)
                except (BrokenProcessPool, FutureTimeout) as exc:
                    pid = self._replace(k, ex, hung=isinstance(exc, FutureTimeout))
                    tries += 1
                    if tries > self.retries:
                        what = "did not answer within %.0f s" % self.timeout_s if isinstance(exc, FutureTimeout) \
                            else "died (killed or crashed)"
                        raise TokenizerWorkerError(
                            f"tokenizer worker process {pid if pid is not None else '(starting)'} {what} while "
                            f"tokenizing {len(records)} records (first {records[0]}) of source "
                            f"{self._manifest.sources[key[0]].name!r} object "
                            f"{self._manifest.sources[key[0]].objects[key[1]].location}; "
                            f"sent {tries} time(s)", worker=pid) from exc
                    continue
                if got[0] == "error":
                    raise SourceReadError(got[1])
                if got[0] == "refused":  # the disk under the spool folder refused a write (full, quota, I/O)
                    raise CacheWriteError(got[1], got[2])
                with self._lock:
                    self.documents += len(records)
                    self.indexed += bool(got[4])
                return _read_tokens(out, len(records), got[3])
        finally:
            try:
                os.unlink(out)
            except FileNotFoundError:
                pass

    def _replace(self, k: int, ex: ProcessPoolExecutor, *, hung: bool) -> int | None:
        """Drop worker k's broken (or hung: killed) executor; the next send starts a fresh one."""
        with self._lock:
            pid = self._pids[k]
            if self._execs[k] is not ex:  # another thread replaced it already
                return pid
            self._execs[k] = None
            self._opened = {(w, o) for w, o in self._opened if w != k}
            self.restarts += 1
            # Its objects' locators died with it: the fresh worker opens them again.
        log.warning("tokenizer worker process replaced", extra={"worker_pid": pid, "hung": hung})
        if hung and pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ex.shutdown(wait=False, cancel_futures=True)
        return pid

    def forget(self, key: tuple[int, int]) -> None:
        """The object's fill ended: its worker closes its locator (best effort; never waits)."""
        with self._lock:
            k = self._homes.pop(key, None)
            if k is not None:
                self._opened.discard((k, key))
            ex = None if k is None or self._closed else self._execs[k]
        if ex is not None:
            from concurrent.futures.process import BrokenProcessPool

            try:
                ex.submit(_forget, key)
            except (BrokenProcessPool, RuntimeError):
                pass  # a dead or closing worker has nothing open

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the workers: wait for their batches (`timeout_s` None), or terminate them and wait at most
        `timeout_s` seconds in all (the daemon stops: a batch cut short leaves a spool file the cache's
        debris collection removes)."""
        import time

        from sluice.procpool import stop_pool

        with self._lock:
            self._closed = True
            execs, self._execs = self._execs, [None] * len(self._execs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for ex in execs:
            if ex is None:
                continue
            if deadline is None:
                ex.shutdown(wait=True, cancel_futures=True)
            else:
                stop_pool(ex, max(0.0, deadline - time.monotonic()))


def _read_tokens(path: str, n: int, total: int) -> list[np.ndarray]:
    """The arrays a worker wrote at `path`: n <u8 lengths, then `total` <u4 tokens (one copy per record,
    so each parked array owns exactly its bytes)."""
    import numpy as np

    with open(path, "rb") as f:
        lengths = np.fromfile(f, dtype="<u8", count=n)
        flat = np.fromfile(f, dtype="<u4", count=total)
    if len(lengths) != n or len(flat) != total or int(lengths.sum()) != total:
        raise TokenizerWorkerError(f"demand pool: token file {path} holds {len(lengths)} lengths and {len(flat)} "
                                   f"tokens, expected {n} and {total}: bug in sluice")
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return [flat[a:b].astype(np.uint32, copy=True) for a, b in zip(starts.tolist(), ends.tolist())]


# -- worker-process side ---------------------------------------------------------
_W: dict[str, Any] = {}


def _init(manifest: Any, threads: int, spool: str) -> None:
    from sluice.tokenize import encoder_for_manifest

    _W.update(manifest=manifest, encoder=encoder_for_manifest(manifest, threads=threads), spool=spool,
              locators=OrderedDict())


def _locator(key: tuple[int, int], raw_path: str, index: Any = None, digest: str | None = None) -> Any:
    from sluice.tokenize.records import RecordLocator

    locators: OrderedDict[tuple[int, int], Any] = _W["locators"]
    loc = locators.get(key)
    if loc is not None:
        locators.move_to_end(key)
        return loc
    while len(locators) >= _LOCATORS:
        locators.popitem(last=False)[1].close()
    src = _W["manifest"].sources[key[0]]
    obj = src.objects[key[1]]
    where = f"source {src.name!r} object {obj.location} ({obj.digest})"
    loc = locators[key] = RecordLocator(raw_path, src.format, obj.compression, src.text_field, where,
                                        spool_dir=_W["spool"], index=index, digest=digest)
    return loc


def _tokens(key: tuple[int, int], raw_path: str, wanted: bytes, out: str, index: Any = None,
            digest: str | None = None) -> tuple[Any, ...]:
    """Worker: tokenize the records in `wanted` (<i8) of object `key` into the file `out`.

    Returns ("ok", pid, documents, tokens, located with `index` now), ("error", message) or
    ("refused", message, errno) when the spool folder's disk refused a write: plain values only.
    """
    import numpy as np

    records = np.frombuffer(wanted, dtype="<i8").tolist()
    try:
        fresh = key not in _W["locators"]
        loc = _locator(key, raw_path, index, digest)
        arrays = _W["encoder"].encode_batch(loc.texts(records))
    except CacheWriteError as exc:
        _forget(key)
        return ("refused", str(exc), exc.errno)
    except SluiceError as exc:
        _forget(key)
        return ("error", str(exc))
    lengths = np.fromiter((len(a) for a in arrays), dtype="<u8", count=len(arrays))
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            lengths.tofile(f)
            if arrays:
                np.concatenate(arrays).astype("<u4", copy=False).tofile(f)
    except OSError as exc:
        if exc.errno not in DISK_REFUSALS:
            raise
        return ("refused", f"demand pool: writing the token file {out} failed ({exc.strerror})", exc.errno)
    return ("ok", os.getpid(), len(arrays), int(lengths.sum()), fresh and loc.used_index)


def _forget(key: tuple[int, int]) -> None:
    loc = _W.get("locators", {}).pop(key, None)
    if loc is not None:
        loc.close()


def default_workers() -> int:
    """`--demand-workers auto`: worker processes for this node (0: the demand path stays in threads).

    Measured on 2 cores (docs/tokenize.md, "Out of order", run 11): the pool
    was slower on every figure (steady `hf` 0.58 against 0.89 M tokens/s,
    tiktoken 1.87 against 2.05; first batch 1.7 s against 0.9 s; 2x worse
    under contention): two more processes to start and only one tokenizer
    thread each. So below 8 usable CPUs the demand path stays in threads;
    from 8, one worker per 4 CPUs (4 tokenizer threads each), which takes
    the demand's JSON parsing off the daemon's GIL. The rule above 2 cores
    is not measured yet: `--demand-workers N` overrides it.
    """
    cpus = affinity.count()  # the process's CPUs (a thread's own may be one: --gil-cpu)
    return cpus // 4 if cpus >= 8 else 0
