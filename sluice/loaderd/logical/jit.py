"""The fused path's compiled kernel (numba, the optional ``jit`` extra): loading it off the start path.

`fused.fused_steps(..., kernel=...)` hands sections 2-4 of a call to a
loaded `Kernel` (`jitkernels`); it gives the same bytes and states as the
numpy path, which stays the fallback: numba not installed, the kernel not
loaded yet, a token dtype it was not compiled for.

Loading costs 0.5-1 s of CPU (import numba, then compile, or load the
compiled code from numba's on-disk cache), so a daemon never waits for it:
`KernelLoader.start()` (called by the producer after its first step) loads
in a background thread, and the producer picks the kernel up at its next
call. The switch mid-stream is safe only because both paths give identical
bytes (tests/test_logical_jit.py). The cache lives where the loader is told
(the daemon: ``<node cache>/jit``, shared by the node's daemons and dropped
with the cache); numba takes its cache directory from its config at the
kernels' import, so the first loader of a process decides it. After the
warm-up compiles the token dtypes below, compiling is switched off: an
unexpected argument type raises TypeError in the dispatcher instead of
compiling on the producer's path, and that call takes the numpy path.

A failure to import or compile is logged once, one line naming the cause,
and the daemon stays on the numpy path.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("sluice.loaderd")

MODES = ("auto", "off")
# A producer starts loading after this many steps: never on the start path (first batch, restore), never in
# a short run that would not win back the load's CPU (0.25 s of the daemon's GIL with a warm cache; a cold
# compile runs in a child). At 64 the load fell inside bench/peers' 150-micro-batch window: delivered 25%
# lower there, restore on the running daemon 0.011 against 0.006 s (measured).
START_AFTER_STEPS = 256
WARM_TIMEOUT_S = 300  # the child compiling a cold cache (3-6 s on an idle core)
# token dtypes compiled at load (the shard formats' dtypes); others take the numpy path
DTYPES = (np.uint16, np.uint32, np.int32, np.int64)


class Kernel:
    """The three compiled kernels of `jitkernels`, warmed; `sections` is what `fused._compute` calls."""

    def __init__(self, mod: Any) -> None:
        self._plan, self._gather, self._finish = mod.plan_call, mod.gather, mod.finish
        self._status = (mod.OK, mod.ASIDE, mod.SHORT)
        self.calls = 0  # calls computed by the kernel
        self.declined = 0  # calls it handed back to the numpy path (an argument type not compiled)

    def sections(self, plan: Any, state: Any, docs: Any, lanes: list[int], lstates: list[Any], s: int, n: int,
                 res: list[Any], counts: list[int], capped: list[bool], all_idx: np.ndarray, objs: np.ndarray,
                 recs: np.ndarray, tstart: np.ndarray, ntok: np.ndarray, mapped: dict[int, Any],
                 uniq: list[int]) -> Any:
        """`fused._compute` from its located candidates on: a `FusedSteps`, None (the per-lane path),
        `fused._SHORT`, or NotImplemented where the kernel does not cover the call (the numpy path runs)."""
        from sluice.loaderd.logical import fused

        toks = [mapped[o][1] for o in uniq]
        if any(t.dtype.type not in DTYPES or t.ndim != 1 for t in toks):
            return NotImplemented
        k, L = plan.spec.per_lane, plan.manifest.packing.seq_len
        T = k * L
        P = len(lanes)
        framing = plan.framing
        lead, trail = int(framing.bos is not None), int(framing.eos is not None)
        bos = 0 if framing.bos is None else framing.bos
        eos = 0 if framing.eos is None else framing.eos
        if not (-(1 << 31) <= bos < 1 << 31 and -(1 << 31) <= eos < 1 << 31):
            return NotImplemented
        has = np.zeros(P, dtype=np.bool_)
        roff = np.zeros(P, dtype=np.int64)
        rend = np.zeros(P, dtype=np.int64)
        for i, r in enumerate(res):
            if r is not None:
                has[i], roff[i], rend[i] = True, r[2], r[3]
        block = np.empty((n, 3, P * k, L), dtype=np.int32)
        flat = block.reshape(-1)
        try:
            (status, short, lanestep, copies, marks, keys, owners, glob, own_loc, entries,
             nexts) = self._plan(P, n, T, L, lead, trail, bool(framing.masks_eos_target), bos, eos,
                                 np.asarray(counts, dtype=np.int64), has, roff, rend, _i64(tstart), _i64(ntok),
                                 _i64(objs), _i64(all_idx), flat)
            ok, aside, _ = self._status
            if status == aside:
                return None
            if status != ok:
                return None if any(c for c, sh in zip(capped, short.tolist()) if sh) else fused._SHORT
            NT, PT3 = n * T, 3 * P * T
            for o, t in zip(uniq, toks):
                self._gather(t, o, copies, flat, nexts, T, NT, PT3)
            self._finish(flat, nexts, marks, P, n, T)
        except TypeError:  # an argument type not compiled at load (compiling is off): the numpy path
            self.declined += 1
            return NotImplemented
        self.calls += 1
        nd, ntk, nls, strad, r_off, fend_q, cur_idx, _ = lanestep.tolist()
        per_step, per_obj = fused._states(lanes, lstates, s, n, k, res, nd, ntk, nls, strad, r_off, fend_q, cur_idx)
        last = range(n - 1, P * n, n)
        drawn = sum(nd[t] for t in last)
        return fused._result(plan, state, docs, s, lanes, n, k, L, block, keys, owners.tolist(), own_loc.tolist(),
                             objs, recs, entries.shape[1], per_step, per_obj, entries[0].tolist(), entries[1].tolist(), glob.tolist(),
                             drawn + int(has.sum()), drawn, sum(ntk[t] for t in last))


def load(cache_dir: str | Path | None) -> Kernel:
    """Import numba, compile (or load from numba's cache in `cache_dir`) the kernels for every token dtype of
    `DTYPES`, then switch compiling off. Raises ImportError (numba missing) or numba's own errors."""
    _cache_dir(cache_dir)
    from sluice.loaderd.logical import jitkernels as mod

    _warm(mod)
    for f in (mod.plan_call, mod.gather, mod.finish):
        f.disable_compile()
    return Kernel(mod)


def _warm(mod: Any) -> None:
    """One tiny call of each kernel per signature the producer passes (the token arrays of every dtype, writable
    and read-only: shards are read-only memory maps)."""
    block = np.zeros(3 * 4, dtype=np.int32)
    z = np.zeros(1, dtype=np.int64)
    got = mod.plan_call(1, 1, 4, 4, 0, 1, False, 0, 0, z + 1, np.zeros(1, np.bool_), z, z, z, z + 3, z, z, block)
    copies, marks, nexts = got[3], got[4], got[10]
    for dt in DTYPES:
        t = np.arange(8, dtype=dt)
        for arr in (t, _readonly(t)):
            mod.gather(arr, 0, copies, block, nexts, 4, 4, 12)
    mod.finish(block, nexts, marks, 1, 1, 4)


def _cache_dir(cache_dir: str | Path | None) -> str | None:
    """Import numba and give it `cache_dir` for its on-disk cache unless it has one (NUMBA_CACHE_DIR, or an
    earlier load in this process: the kernels' module takes it at its import); the directory in use."""
    import numba

    if cache_dir is not None and not numba.config.CACHE_DIR:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        numba.config.CACHE_DIR = str(cache_dir)
    return numba.config.CACHE_DIR or None


def _marker_name() -> str:
    """The file that says numba's cache holds this kernel source's code for this Python and numba (a cache
    made by another source, Python or numba is compiled again, in the child). Call after numba's import."""
    import numba

    src = Path(__file__).with_name("jitkernels.py").read_bytes() + sys.version.encode() + numba.__version__.encode()
    return f"warm-{hashlib.blake2b(src, digest_size=8).hexdigest()}"


def _warm_in_child(cache_dir: str | Path) -> None:
    """`load(cache_dir)` in a child process (it compiles into numba's on-disk cache); raises RuntimeError
    naming its last error line where it fails or outlives `WARM_TIMEOUT_S`."""
    code = "import sys; from sluice.loaderd.logical.jit import load; load(sys.argv[1])"
    try:
        got = subprocess.run([sys.executable, "-c", code, str(cache_dir)], capture_output=True, text=True,
                             timeout=WARM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"compiling in a child took over {WARM_TIMEOUT_S} s") from None
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or [f"exit {got.returncode}"])[-1]
        raise RuntimeError(f"compiling in a child failed: {last[:300]}")


def _i64(a: np.ndarray) -> np.ndarray:
    """`a` as the one array type the kernels are compiled for: writable, C-contiguous int64 (a copy only
    where it is not: the memoized lane orders are read-only)."""
    f = a.flags
    return a if a.dtype == np.int64 and f.writeable and f.c_contiguous else np.array(a, dtype=np.int64)


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class KernelLoader:
    """Loads the kernel once, in a background thread, when `start()` is first called; `kernel` is None until
    then (and for good where `mode` is "off" or loading failed). `state`: "off", "idle", "loading", "active"
    or "failed"; `cause` says why it failed. `metrics.jit_active` (if given) is set to 1 once active."""

    def __init__(self, mode: str = "auto", cache_dir: str | Path | None = None, metrics: Any = None) -> None:
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

    def start(self) -> None:
        """Start loading (once; later calls do nothing). Never raises, never waits."""
        with self._lock:
            if self.state != "idle":
                return
            self.state = "loading"
            self._thread = threading.Thread(target=self._load, name="sluice-jit-load", daemon=True)
            self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a started load to end; True when it ended (tests, benches)."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self.state not in ("idle", "loading")

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            where = _cache_dir(self.cache_dir)  # imports numba: without it, the one line says so at once
            marker = None if where is None else Path(where) / _marker_name()
            if marker is not None and not marker.exists():
                # A cold cache: compile in a short-lived child (3-6 s of Python in numba's compiler, which
                # in this thread would hold the GIL the IO loop serves with), then load from the cache here.
                _warm_in_child(where)
                marker.touch()
            kernel = load(self.cache_dir)
        except Exception as exc:  # noqa: BLE001 - any import or compile failure: stay on the numpy path
            self.cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
            self.state = "failed"
            log.warning("fused kernel not loaded, staying on the numpy path (%s)", self.cause)
            return
        self.load_s = time.monotonic() - t0
        self.kernel = kernel
        self.state = "active"
        if self._metrics is not None and hasattr(self._metrics, "jit_active"):
            self._metrics.jit_active.set(1)
        log.info("fused kernel active after %.2f s", self.load_s)
