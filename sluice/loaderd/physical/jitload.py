"""Loading the fused path's compiled kernel (`logical/jit.py`) off the start path.

Two ways, the same kernel source: the module compiled ahead of time
(`jitaot`: imported in ~2 ms, no numba; `KernelLoader.ready` says it is
built, and `jitstart.StartRule` then starts the load after every run's first
call), else numba's dispatchers (0.5-1 s of CPU: import numba, then compile,
or load the compiled code from numba's on-disk cache; started when the run
spec says the run is long, the producer waits for its consumer, or
`START_AFTER_STEPS` steps are made; `--jit numba` takes only this way). Either
way a daemon never waits for it: `KernelLoader.start()` loads in a background
thread, and the producer picks the kernel up at its next call. The switch
mid-stream is safe only because both paths give identical bytes
(tests/test_logical_jit.py). The cache lives where the loader is told (the
daemon: `machine_cache_dir`, the user's cache folder, so a fresh node cache
does not compile again); numba takes its cache directory from its config at
the kernels' import, so the first loader of a process decides it. A cold
cache is compiled in a short-lived child process (`build_in_child`: numba's
cache, then the module), so numba's compiler never holds the daemon's GIL.
After the warm-up compiles the token dtypes of `jit.DTYPES`, compiling is
switched off: an unexpected argument type raises TypeError in the
dispatcher (in the module's `jitaot.Checked` wrappers likewise) instead of
compiling on the producer's path, and that call is `Plan.step`'s.

A failure to import or compile is logged once, one line naming the cause,
and the daemon stays on `Plan.step`. So is a cache folder every user may
write, or another user's (`jitaot.unsafe`: the module is native code and
numba's cache indexes are pickles): nothing in it is loaded, nothing is
compiled into it.

Why one module of 500 lines: the loader (`KernelLoader`) and every way it
loads (numba's dispatchers, the module compiled ahead of time, the compile
child, `uncompiled` for the tests) share one cache folder's rules (where, who
may write it, its warm marker and lock); apart, each would need them passed
in. The compile child (`_warm_in_child`, `warm_machine_cache`) is the seam to
split along when it grows.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sluice import affinity
from sluice.loaderd.logical import order
from sluice.loaderd.physical import jitaot
from sluice.loaderd.physical.giveway import Paced
from sluice.loaderd.logical.jit import DTYPES, Kernel, packer_keys, state_parts
from sluice.waits import joined

log = logging.getLogger("sluice.loaderd")

MODES = ("auto", "numba", "off")  # numba: never the ahead-of-time module (`jitaot`)
# How long a producer's call waits for a load of the module compiled ahead of time already in flight
# (`KernelLoader.arriving`): the load takes ~4 ms of wall time, ~8 on a busy machine
AHEAD_WAIT_S = 0.05
WARM_TIMEOUT_S = 300  # the child compiling a cold cache (3-6 s on an idle core; 16 s with the module ahead of time)
# What a loaded kernel adds to the process's resident memory, at most: numba, llvmlite's LLVM (mostly mapped
# library pages) and the loaded code. Measured 159-161 MiB resident, 50 MiB of it anonymous (numba 0.68.1,
# x86-64): `import numba` alone ~116 (96 of it llvmlite's library pages, shared between processes), the first
# compiled call ~15 (LLVM's start), each kernel 1-3. A fixed cost once per process that loads it (the daemon),
# declared beside the data path's bounds (docs/loaderd.md) and held by tests/test_loaderd_jit.py.
KERNEL_RSS_BYTES = 192 << 20
# The kernels' source files (numba's cache keys each function on its own file; the warm marker on all of them)
KERNEL_SOURCES = tuple(Path(__file__).resolve().parent.parent / "logical" / f"{name}.py"
                       for name in ("jitdraws", "jitrows"))


def load(cache_dir: str | Path | None) -> Kernel:
    """Import numba, compile (or load from numba's cache in `cache_dir`) the kernels for every token dtype of
    `DTYPES`, then switch compiling off. Raises ImportError (numba missing) or numba's own errors."""
    _cache_dir(cache_dir)
    from sluice.loaderd.logical import jitdraws, jitrows

    _warm(jitdraws, jitrows)
    for f in (jitrows.gather, jitrows.finish, jitdraws.feistel_many, jitdraws.walk, jitrows.assemble,
              jitrows.state_texts, jitdraws.walk_bins, jitrows.assemble_bins, jitrows.finish_bins,
              jitrows.bins_texts, jitdraws.walk_seqs, jitrows.seqs_texts):
        f.disable_compile()
    order.use_compiled(jitdraws.feistel_many)  # the orders' chunks of lane positions (the same values)
    return Kernel(Paced(jitdraws), Paced(jitrows))  # (the producer yields its CPU before each call: giveway.py)


def _warm(draws: Any, rows: Any) -> None:
    """One tiny call of each kernel per signature the producer passes (the token arrays of every dtype, writable
    and read-only: shards are read-only memory maps)."""
    block = np.zeros(3 * 4, dtype=np.int32)
    z = np.zeros(1, dtype=np.int64)
    draws.feistel_many(z, np.ones(2, dtype=np.uint64), np.uint64(1), np.uint64(1), np.uint64(2), z.copy())
    i1 = np.ones((1, 1), dtype=np.int64)  # `fusedmix._compiled_walks`' signature: one lane, one 3-token document
    z2 = np.zeros((1, 1), dtype=np.int64)
    draws.walk(1, 4, 0, 1, False, 0, np.zeros(1, dtype=np.uint64), 4, np.ones(1, dtype=np.int64), i1,
               np.zeros(1, dtype=np.int64), np.asarray([[[0, 0, 1, 0, 0, 0, 0, 0]]]), np.zeros((1, 5), dtype=np.int64),
               np.full((1, 1), -1), z2.copy(), i1.copy(), z2.copy(), np.asarray([[[[0, 0, 0, 0, 3]]]]),
               np.zeros((1, 1, 7), dtype=np.int64), np.zeros((1, 4, 10), dtype=np.int64),
               np.zeros((1, 1, 1, 8), dtype=np.int64), np.zeros((1, 1, 7), dtype=np.int64))
    pieces = np.asarray([[[0, 0, 0, 0, 0, 0, 3, 0, 4, 4]]], dtype=np.int64)  # its one piece, then the assembly
    got = rows.assemble(1, 1, 4, 4, 0, 1, False, 0, 0, pieces, np.ones(1, dtype=np.int64), np.full(1, 4), block, 1)
    copies, marks, nexts = got[1], got[2], got[9]
    for dt in DTYPES:
        t = np.arange(8, dtype=dt)
        for arr in (t, _readonly(t)):
            rows.gather(arr, 0, copies, block, nexts, 4, 4, 12)
    rows.finish(block, nexts, marks, 1, 1, 4)
    # best-fit (`fusedbins`): one lane, one 3-token document that fills its 4-token row, then its assembly
    i2 = np.zeros((1, 1, 2), dtype=np.int64)  # (one packer: its window of 2 bins)
    pieces = np.zeros((1, 4, 10), dtype=np.int64)
    pbin, fifo, rowbin = np.zeros((1, 4), dtype=np.int64), np.zeros((1, 1, 4), dtype=np.int64), z2.copy()
    bsnap, bopens = np.zeros((1, 1, 1, 3), dtype=np.int64), np.zeros((1, 1, 1, 2), dtype=np.int64)
    draws.walk_bins(1, 1, 4, 2, False, 0, 1, False, 0, np.zeros(1, dtype=np.uint64), 4, np.ones(1, dtype=np.int64),
                    i1.copy(), np.zeros(1, dtype=np.int64), np.asarray([[[0, 0, 1, 0, 0, 0, 0, 0]]]),
                    np.zeros((1, 6), dtype=np.int64), np.full((1, 1), -1), z2.copy(), i1.copy(), z2.copy(),
                    np.asarray([[[[0, 0, 0, 0, 3]]]]),
                    np.zeros((1, 1, 7), dtype=np.int64), pieces, pbin, i2.copy(), i2.copy(), fifo,
                    np.zeros((1, 1, 3), dtype=np.int64), rowbin, np.zeros((1, 11), dtype=np.int64),
                    np.zeros((1, 1, 1, 8), dtype=np.int64), np.zeros((1, 1, 2), dtype=np.int64), bsnap, bopens)
    got = rows.assemble_bins(1, 1, 1, 4, 0, 1, False, 0, 0, 0, pieces, np.ones(1, dtype=np.int64), pbin, rowbin,
                             block, 1)
    rows.finish_bins(block, got[2], got[3], 4, 4, 12)
    order, keys, key_offs, text, text_offs, _, _ = state_parts("d", "r", [0], "bins")
    rows.bins_texts(np.zeros((1, 1, 1, 8), dtype=np.int64), np.zeros((1, 1, 2), dtype=np.int64),
                    np.zeros(1, dtype=np.int64), 1, 1, order, keys, key_offs, text, text_offs,
                    *packer_keys(["*"], b'"ended":'), z2.copy(), pieces, pbin, np.ones(1, dtype=np.int64), fifo,
                    bsnap, bopens, np.empty(4096, dtype=np.uint8))
    # one packer per source (`fusedseqs`): the same lane and document, its row, the state's JSON
    rsnaps = np.zeros((1, 1, 1, 11), dtype=np.int64)
    draws.walk_seqs(1, 1, 4, 0, 1, False, 0, np.zeros(1, dtype=np.uint64), 6, np.ones(1, dtype=np.int64), i1.copy(),
                    np.zeros(1, dtype=np.int64), np.asarray([[[0, 0, 1, 0, 0, 0, 0, 0]]]),
                    np.zeros((1, 8), dtype=np.int64), np.full((1, 1), -1), z2.copy(), i1.copy(), z2.copy(),
                    np.asarray([[[[0, 0, 0, 0, 3]]]]), np.zeros((1, 1, 7), dtype=np.int64),
                    np.zeros((1, 1, 11), dtype=np.int64), pieces, pbin, np.zeros((1, 1, 1, 8), dtype=np.int64),
                    np.zeros((1, 1, 1), dtype=np.int64), rsnaps)
    order, keys, key_offs, text, text_offs, _, _ = state_parts("d", "r", [0], "seqs")
    rows.seqs_texts(np.zeros((1, 1, 1, 8), dtype=np.int64), np.zeros((1, 1, 1), dtype=np.int64), rsnaps,
                    np.zeros(1, dtype=np.int64), 1, 1, order, keys, key_offs, text, text_offs, *packer_keys(["0"], b'"cur":'),
                    np.empty(4096, dtype=np.uint8))
    # a state's JSON (`fusedmix`'s arguments: `state_parts`' read-only byte arrays, int64 cursors and counters)
    order, keys, key_offs, text, text_offs, _, _ = state_parts("d", "r", [0])
    rows.state_texts(np.zeros((1, 1, 1, 8), dtype=np.int64), np.zeros((1, 1, 7), dtype=np.int64),
                     np.zeros(1, dtype=np.int64), 1, 1, order, keys, key_offs, text, text_offs,
                     np.empty(4096, dtype=np.uint8))


def load_ahead(where: str | Path) -> Kernel:
    """The ahead-of-time module of `where` (`jitaot.load`, no numba), its exports called once each as `load`
    warms the jit's (a module that does not run fails here, not on the producer's path)."""
    draws, rows = jitaot.load(where)
    _warm(draws, rows)
    order.use_compiled(draws.feistel_many)
    return Kernel(Paced(draws), Paced(rows))


def uncompiled() -> Kernel:
    """The kernels' source run as plain Python (`jitdraws` and `jitrows` executed afresh with numba's
    ``DISABLE_JIT`` on, so their decorators hand back the functions themselves): the same code as the compiled
    kernel, hundreds of times slower, for the fast tier's tests (no compile) and for reading it in a debugger.
    Needs numba importable (the modules import it); never a daemon's path (`Plan.step` is faster)."""
    import numba

    here = Path(__file__).resolve().parent.parent / "logical"
    saved = numba.config.DISABLE_JIT
    numba.config.DISABLE_JIT = True
    try:
        mods = []
        for name in ("jitdraws", "jitrows"):
            spec = importlib.util.spec_from_file_location(f"sluice_uncompiled_{name}", here / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
            mods.append(mod)
    finally:
        numba.config.DISABLE_JIT = saved
    kernel = Kernel(*(_Quiet(mod) for mod in mods))
    kernel.modules = dict(zip(("jitdraws", "jitrows"), mods))  # (their functions may be patched: a test's mutant)
    return kernel


class _Quiet:
    """An uncompiled kernel module's functions, called with numpy's integer overflow warnings off (the kernels'
    uint64 mixing wraps modulo 2**64 by design, as compiled); `module` is the module itself."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.module, name)

        def quiet(*args: Any) -> Any:
            with np.errstate(over="ignore"):
                return fn(*args)

        return quiet


def _load_frozen(load_fn: Callable[[], Kernel]) -> Kernel:
    """`load_fn()` (`load` or `load_ahead`), with the cyclic garbage collector off meanwhile, then every object
    alive frozen (`gc.freeze`).

    Why: a collection holds the GIL for its whole walk, so it stops the IO thread too (gcpause.py). numba's load
    adds about 84,000 objects (numba's modules, typing registries, the kernels), alive for the process's life,
    to a heap the daemon froze at its start: a full collection then took 22-30 ms instead of under 0.1, and
    collections during the load walked the growing heap. Objects freed by their reference counts are freed as
    ever; only cyclic garbage alive at the freeze is never collected (the load's own, once)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return load_fn()
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def machine_cache_dir(fallback: Path) -> Path:
    """Where numba's compiled code for this user lives: ``$XDG_CACHE_HOME/sluice/jit`` (``~/.cache``), shared by
    every daemon, node cache and run of this user on the machine, so the kernel compiles once per machine,
    Python and numba (not once per node cache: a bench's or a test's fresh cache would pay the 3-6 s compile
    each time); `fallback` (under the node cache) where that folder cannot be made or written."""
    import os

    if os.environ.get("NUMBA_CACHE_DIR"):  # the operator's (or the tests') choice wins, and nothing is made
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    where = Path(base) / "sluice" / "jit"
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)  # (private: `jitaot.unsafe`)
        if os.access(where, os.W_OK | os.X_OK):
            return where
    except OSError:
        pass
    return fallback


def _cache_dir(cache_dir: str | Path | None) -> str | None:
    """Import numba and give it `cache_dir` for its on-disk cache unless it has one (NUMBA_CACHE_DIR, or an
    earlier load in this process: the kernels' module takes it at its import); the directory in use, made (0700)
    where it is missing."""
    import numba

    if cache_dir is not None and not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = str(cache_dir)
    where = numba.config.CACHE_DIR or None
    if where is not None:  # (NUMBA_CACHE_DIR may name a folder not made yet: the compile child locks a file in it)
        Path(where).mkdir(mode=0o700, parents=True, exist_ok=True)
    return where


def _marker_name(sources: tuple[Path, ...] = KERNEL_SOURCES) -> str:
    """The file that says numba's cache holds the code of the kernels' `sources` for this Python and numba (a
    cache made by other sources, Python or numba is compiled again, in the child). Call after numba's import.

    Keyed by what numba's own cache index keys on, each source file's path, modification time and size, as well
    as its content: a second install of the same source (another virtualenv, a `git archive` tree, a
    reinstall that touched the file) has a cold numba cache, and with a marker keyed by content alone the
    daemon's loading thread compiled it in process, holding the IO loop's GIL for seconds (measured: 3x less
    throughput for the 4,000 micro-batches after the load).
    """
    import numba

    parts = [sys.version.encode(), numba.__version__.encode()]
    for source in sources:
        st = source.stat()
        parts += [source.read_bytes(), str(source).encode(), str(st.st_mtime_ns).encode(), str(st.st_size).encode()]
    key = b"\0".join(parts)
    return f"warm-{hashlib.blake2b(key, digest_size=8).hexdigest()}"


# The compile child ends itself once its parent is gone (a daemon killed with -9 runs no
# `KernelLoader.close`): a watchdog thread compares its parent pid with the one it was given (given, not read at
# start: the parent may already be gone then). numba's compiler is Python, so the thread gets the GIL within
# the interpreter's switch interval.
_CHILD_CODE = (
    "import os, sys, threading, time\n"
    "def _watch(parent=int(sys.argv[2])):\n"
    "    while os.getppid() == parent:\n"
    "        time.sleep(0.2)\n"
    "    os._exit(1)\n"
    "threading.Thread(target=_watch, daemon=True).start()\n"
    "from sluice.loaderd.physical.jitload import build_in_child\n"
    "build_in_child(sys.argv[1], sys.argv[3] == 'ahead')\n"
)


def build_in_child(where: str, ahead: bool = True) -> None:
    """The compile child's work: the kernels through numba into its cache in `where` (raises where that fails),
    its warm marker, then (`ahead`) the ahead-of-time module (`jitaot.build`); a failure of the latter is one line on
    stderr and its ``.failed`` file, and the daemon loads through numba. One child a folder at a time (a lock
    file beside the module): daemons started together compile once, the others then find it made."""
    import fcntl

    with open(Path(where) / (jitaot.PREFIX + "build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (bounded: the parent kills a child past WARM_TIMEOUT_S)
        load(where)
        Path(_cache_dir(where) or where, _marker_name()).touch()
        if not ahead or jitaot.state(where) != "absent":
            return
        jitaot.sweep(where)
        try:
            jitaot.build(where)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: numba's in-process load remains
            print(f"ahead-of-time module not built: {type(exc).__name__}: {exc}", file=sys.stderr)


def _warm_in_child(cache_dir: str | Path, on_start: Any = None, ahead: bool = True) -> None:
    """`build_in_child(cache_dir, ahead)` in a child process (numba's on-disk cache; with `ahead` the module
    compiled ahead of time); raises RuntimeError naming its last error line where it fails or outlives
    `WARM_TIMEOUT_S`. `on_start(proc)`, where given, learns the child's Popen (`KernelLoader.close` kills it)."""
    with affinity.widened():  # (a thread started by a producer has its one CPU until the upkeep spreads it)
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(cache_dir), str(os.getpid()),
                                 "ahead" if ahead else "numba"],
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    if on_start is not None:
        on_start(proc)
    try:
        _, err = proc.communicate(timeout=WARM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"compiling in a child took over {WARM_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        last = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise RuntimeError(f"compiling in a child failed: {last[:300]}")


def warm_machine_cache(timeout: float = WARM_TIMEOUT_S) -> int:
    """Load the kernel as a daemon would (`KernelLoader` into `machine_cache_dir`: a cold cache compiles in a
    child) and wait for it: a bench's source tree has its numba cache warm before it is measured (a daemon
    that stops before the child's compile ends kills it, so short jobs from a fresh tree never warm it).
    Returns 0 when the kernel loaded, else 1 (the cause logged)."""
    loader = KernelLoader("auto", functools.partial(machine_cache_dir, Path(tempfile.gettempdir()) / "sluice-jit"))
    loader.start()
    loader.wait(timeout)
    return 0 if loader.state == "active" else 1


def _failure(where: str) -> str:
    """The cause a failed build of the module wrote (`jitaot.build`), one line."""
    try:
        return jitaot.paths(where)[2].read_text(errors="replace").strip().splitlines()[0][:300]
    except (OSError, IndexError):
        return "cause not recorded"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # (ValueError: blocked in sys.modules, as a test does)
        return False


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class KernelLoader:
    """Loads the kernel once, in a background thread, when `start()` is first called; `kernel` is None until
    then (and for good where `mode` is "off" or loading failed). `state`: "off", "idle", "loading", "active"
    or "failed"; `cause` says why it failed. `metrics.jit_loaded` (if given) is set to 1 once active,
    `metrics.jit_ahead` to 1 where that is the module compiled ahead of time (`how`). `cache_dir` may be a
    callable, called in the loading thread (`machine_cache_dir` makes a folder)."""

    def __init__(self, mode: str = "auto", cache_dir: str | Path | Callable[[], Path] | None = None,
                 metrics: Any = None) -> None:
        if mode not in MODES:
            raise ValueError(f"jit mode {mode!r} is not one of {MODES}")
        self.mode = mode
        self.cache_dir = cache_dir
        self.kernel: Kernel | None = None
        self.state = "off" if mode == "off" else "idle"
        self.cause: str | None = None
        self.load_s: float | None = None
        self._metrics = metrics
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen | None = None  # a cold cache's compile child, while it runs
        self._closed = False
        self.numba_cache: str | None = None  # the folder numba's cache is in, once numba is imported
        self.started_by = ""  # why the load started (`start`'s `why`)
        self.how = ""  # "ahead-of-time" (jitaot's module) or "numba" (the jit's dispatchers), once active
        self._ready: bool | None = None  # (`ready`)
        self._publish()

    def _publish(self) -> None:
        """The state (and a failure's cause) into `metrics.jit_status`, STATS' `fast_path.kernel`."""
        if self._metrics is not None and hasattr(self._metrics, "jit_status"):
            self._metrics.jit_status = {"state": self.state, "cause": self.cause}

    def start(self, why: str = "") -> None:
        """Start loading (once; later calls do nothing); `why` (`StartRule.due`'s reason) is logged with the load's
        outcome. Never raises, never waits."""
        with self._lock:
            if self.state != "idle" or self._closed:
                return
            self.state = "loading"
            self.started_by = why
            self._publish()
            self._thread = threading.Thread(target=self._load, name="loaderd-jit-load", daemon=True)
            self._thread.start()

    def arriving(self, timeout: float = AHEAD_WAIT_S) -> Kernel | None:
        """The kernel, waiting up to `timeout` seconds for it where the load in flight is the module compiled ahead
        of time (`ready`: about 4 ms); where it is numba's (0.35 s) or none runs, no wait. The producer's call
        waits for it rather than make its step with `Plan.step` (one step a call, ~8x the kernel's CPU)."""
        if self.kernel is None and self.state == "loading" and self._ready:
            self.wait(timeout)
        return self.kernel

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a started load to end; True when it ended (tests, benches)."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self.state not in ("idle", "loading")

    def close(self) -> None:
        """Kill a compile child still running (the daemon is stopping: a child must not outlive it by the
        minutes a compile may take); a load in progress then fails with one log line. Never raises."""
        with self._lock:
            self._closed = True
            child = self._child
        if child is not None and child.poll() is None:
            child.kill()

    def ended(self, timeout_s: float | None) -> bool:
        """After `close`: wait up to `timeout_s` (None: as long as it takes) for a load in progress to end; True
        when none runs. The daemon's exit must not run while one does: the interpreter's exit handlers walk
        registries that numba's import changes (a traceback on stderr, seen as "dictionary changed size")."""
        return joined(self._thread, timeout_s)

    def _ahead(self) -> Kernel | None:
        """The ahead-of-time module (`jitaot`), built first in the compile child where this key has none and no
        build failed; None where there is none (numba's in-process load follows: no compiler here, or numba
        missing) or it does not load (said in one line)."""
        where = self._aot_dir()
        self.numba_cache = where
        built = jitaot.state(where)
        if built == "absent":
            if not _importable("numba"):
                return None  # (numba's load then says so, in one line)
            try:
                Path(where).mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError:
                return None
            _warm_in_child(where, self._adopt)  # (numba's cache too; raises where numba cannot compile at all)
            built = jitaot.state(where)
            if built == "failed":
                log.warning("fused kernel's module not compiled ahead of time (%s); loading through numba, 0.35 s "
                            "of the GIL (remove %s to try again)", _failure(where), jitaot.paths(where)[2])
        elif built == "failed":
            log.info("fused kernel's module was not compiled ahead of time here (%s); loading through numba",
                     _failure(where))
        if built != "built":
            return None
        try:
            kernel = _load_frozen(functools.partial(load_ahead, where))
        except Exception as exc:  # noqa: BLE001 - damaged, or not this machine's: numba's load instead
            log.warning("fused kernel's compiled module not loaded (%s: %s); loading through numba",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        self.how = "ahead-of-time"
        return kernel

    def _adopt(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._child = proc
            closed = self._closed
        if closed:  # closed while the child was starting
            proc.kill()

    def ready(self) -> bool:
        """True when this machine's cache holds the ahead-of-time module for these kernels (`jitaot`): loading is
        then a millisecond, worth it in any run (`jitstart.StartRule`). Asked once; later calls repeat the
        answer. Resolves a callable `cache_dir` (call it off the start path)."""
        if self._ready is None:
            self._ready = self.mode == "auto" and jitaot.state(self._aot_dir()) == "built"
        return self._ready

    def _aot_dir(self) -> str:
        """Where the ahead-of-time module lives: numba's cache folder (NUMBA_CACHE_DIR, else `cache_dir`)."""
        if callable(self.cache_dir):
            self.cache_dir = self.cache_dir()
        return os.environ.get("NUMBA_CACHE_DIR") or str(self.cache_dir or Path(tempfile.gettempdir()) / "sluice-jit")

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            why = jitaot.unsafe(self._aot_dir())  # (numba's cache there too: its indexes are pickles)
            if why is not None:
                self.numba_cache = None  # (the hint below would say to remove a folder that is not ours)
                raise PermissionError(why)
            kernel = self._ahead() if self.mode == "auto" else None
            if kernel is None:
                where = self.numba_cache = _cache_dir(self.cache_dir)  # imports numba: without it, one line says so
                marker = None if where is None else Path(where) / _marker_name()
                if marker is not None and not marker.exists():
                    # A cold cache: compile in a short-lived child (3-6 s of Python in numba's compiler, which
                    # in this thread would hold the GIL the IO loop serves with), then load from the cache here.
                    _warm_in_child(where, self._adopt, ahead=self.mode == "auto")
                    marker.touch()
                kernel = _load_frozen(functools.partial(load, self.cache_dir))
                self.how = "numba"
        except Exception as exc:  # noqa: BLE001 - any import or compile failure: stay on Plan.step
            self.cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
            self.state = "failed"
            self._publish()
            if self._closed:  # (`close` killed the compile child: the process stops, nothing failed)
                log.info("fused kernel's load stopped with the process (%s)", self.cause)
                return
            # numba's cache is the user's, not the node cache's: a damaged one stays until it is removed, so say where
            where = self.numba_cache
            hint = f"; numba's cache: {where} (remove it to compile again)" if where else ""
            log.warning("fused kernel not loaded, staying on Plan.step (%s%s)", self.cause, hint)
            return
        self.load_s = time.monotonic() - t0
        self.kernel = kernel
        self.state = "active"
        self._publish()
        if self._metrics is not None and hasattr(self._metrics, "jit_loaded"):
            self._metrics.jit_loaded.set(1)
            self._metrics.jit_ahead.set(int(self.how == "ahead-of-time"))
        if self._metrics is not None and hasattr(self._metrics, "gc_frozen"):
            self._metrics.gc_frozen.set(gc.get_freeze_count())
        log.info("fused kernel active after %.2f s (%s; started by %s)", self.load_s, self.how,
                 self.started_by or "a call")


if __name__ == "__main__":  # `python -m sluice.loaderd.physical.jitload`: build the kernel (node images, benches)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(warm_machine_cache())
