"""The fast path's kernels compiled ahead of time: one extension module in the machine's cache, loaded without numba.

Loading the kernels through numba costs a daemon ~0.35 s of GIL time (numba's
import and registries, jitstart.py), which only runs of ~2,000 steps or more
pay back, so shorter runs stayed off the kernel for their whole length.
The same kernel source (`jitdraws`, `jitrows`) compiled by numba's ahead-of-time
compiler (`numba.pycc`, with the GIL released in each call as the jit's
``nogil``) is a plain extension module: importing it takes under a
millisecond and needs no numba, so a daemon loads it at its first call.

* `build(where)`, in the compile child (jitload.py): the kernels warmed
  through numba (their signatures, and numba's own cache for the fallback),
  then compiled into ``sluice_kernels_<key>`` + the interpreter's extension
  suffix, with a JSON file beside it: the module's BLAKE3 digest and every
  export's argument types. Both are written under temporary names and moved
  into place, the JSON last (a build killed midway leaves a ``.build-*``
  folder, which the next build removes: `sweep`). Where it fails (no C
  compiler, no Python headers) a ``.failed`` file keeps its cause, so no
  later daemon tries again for this key; numba's in-process load stays the
  way (remove the file to try again).
* `load(where)`: the module, its digest checked before its import, each export
  behind a check of every argument (`Checked`). pycc's wrappers do not check
  array types: an array of another dtype or rank crashes the process. Here a
  wrong argument raises TypeError, as numba's dispatcher with compiling off
  does, and the call is `Plan.step`'s.
* `unsafe(where)`: the folder (and the module's files) must be this user's
  (or root's) and not writable by every user, else nothing in it is loaded
  or compiled into it: whoever may write it would run code in the daemon.

pycc compiles for the architecture's generic CPU (no host-only
instructions), so one module serves every machine of the architecture that
shares the cache folder (a home directory on a shared file system). The key
digests this file and the kernels' sources, Python, numba's version file,
numpy's version and the machine, so any change builds a new module (the old
one is left in the cache folder).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from importlib import machinery
from pathlib import Path
from typing import Any

import blake3
import numpy as np

PREFIX = "sluice_kernels_"
# every kernel the producer calls (module, function); each signature compiled by the warm-up is one export
EXPORTS = (("jitdraws", "feistel_many"), ("jitdraws", "walk"), ("jitdraws", "walk_bins"), ("jitdraws", "walk_seqs"),
           ("jitrows", "gather"), ("jitrows", "finish"), ("jitrows", "assemble"), ("jitrows", "state_texts"),
           ("jitrows", "assemble_bins"), ("jitrows", "finish_bins"), ("jitrows", "bins_texts"),
           ("jitrows", "seqs_texts"))
_SOURCES = tuple(Path(__file__).resolve().parent.parent / "logical" / f"{m}.py" for m in ("jitdraws", "jitrows"))
_KEY: list[str] = []  # (computed once a process)


def key() -> str:
    """What the module is built from; raises ModuleNotFoundError where numba is not installed. numba's version
    is read from its own files, not through `importlib.metadata` (whose first scan of the installed packages
    took 40 ms of the producer's GIL, in a run's first steps)."""
    if not _KEY:
        try:
            spec = importlib.util.find_spec("numba")
        except ValueError:  # (blocked in sys.modules)
            spec = None
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError("numba is not installed")
        package = Path(spec.origin).parent
        numba_version = package / "_version.py"
        parts = [sys.version, np.__version__, platform.machine(), sys.platform]
        h = blake3.blake3("\0".join(parts).encode())
        for source in (numba_version if numba_version.exists() else package / "__init__.py", *_SOURCES,
                       Path(__file__).resolve()):
            h.update(source.read_bytes())
        _KEY.append(h.hexdigest()[:16])
    return _KEY[0]


def paths(where: str | Path) -> tuple[Path, Path, Path]:
    """(the module, its JSON, the failure note) for this key in the folder `where`."""
    name = PREFIX + key()
    base = Path(where)
    return base / (name + machinery.EXTENSION_SUFFIXES[0]), base / (name + ".json"), base / (name + ".failed")


def state(where: str | Path) -> str:
    """"built" (the module and its JSON are there), "failed" (a build failed: its ``.failed`` file), "absent",
    or "unavailable" (numba is not installed, or the folder cannot be read: nothing to build or load)."""
    try:
        so, meta, failed = paths(where)
        if meta.exists() and so.exists():
            return "built"
        return "failed" if failed.exists() else "absent"
    except (OSError, ImportError):
        return "unavailable"


def unsafe(where: str | Path, files: tuple[Path, ...] = ()) -> str | None:
    """Why code in the folder `where` (and `files` in it) must not be run by this process, or None.

    The module is native code, and numba's cache beside it holds pickled indexes: whoever can write them runs
    code in the daemon. So the folder and the files must belong to this process's user (or root) and must not be
    writable by every user (a group-writable folder is the group's, trusted as the folder's owner chose: with a
    umask of 002 every folder is). The loader makes a missing folder itself, 0700. Platforms without POSIX owners
    are not checked."""
    if not hasattr(os, "getuid"):
        return None
    me = os.getuid()
    for path in (Path(where), *files):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{path}: cannot be read ({exc.strerror})"
        if st.st_uid not in (me, 0):
            return (f"{path} belongs to user {st.st_uid}, not to this process's user {me}: its code is not run "
                    "(set NUMBA_CACHE_DIR to a folder of your own)")
        if st.st_mode & 0o002:
            return (f"{path} is writable by every user (mode {st.st_mode & 0o777:o}): its code is not run "
                    f"(chmod o-w {path}, or set NUMBA_CACHE_DIR to a folder of your own)")
    return None


def _arg_spec(t: Any) -> list[Any]:
    """One numba argument type as the JSON `Checked` reads."""
    from numba.core import types

    if isinstance(t, types.Array) and t.layout in ("C", "A"):
        return ["array", str(t.dtype), t.ndim, t.layout == "C", not t.mutable]
    if isinstance(t, types.Boolean):
        return ["bool"]
    if isinstance(t, types.Integer):
        return ["int", t.bitwidth, t.signed]
    raise TypeError(f"no ahead-of-time export for an argument of type {t}")


def build(where: str | Path) -> None:
    """Compile the module for this key into `where`, after `jitload.load` (numba imported, the kernels warmed:
    each signature it compiled is one export). On failure the ``.failed`` file says why and the error is
    raised."""
    import warnings

    from sluice.loaderd.logical import jitdraws, jitrows

    so, meta, failed = paths(where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (pycc is marked pending deprecation: docs/dependencies.md)
            from numba.core.compiler import Flags
            from numba.pycc import CC, compiler

            class _GilReleased(Flags):  # (pycc has no option for it; its wrappers read this flag)
                def __init__(self, *args: Any, **kw: Any) -> None:
                    super().__init__(*args, **kw)
                    self.release_gil = True

            compiler.Flags = _GilReleased
            mods = {"jitdraws": jitdraws, "jitrows": jitrows}
            cc = CC(so.name.split(".")[0])
            exports: dict[str, list[Any]] = {}
            for mod, fn in EXPORTS:
                f = getattr(mods[mod], fn)
                for i, sig in enumerate(f.nopython_signatures):
                    exports.setdefault(fn, []).append([f"{fn}_{i}", [_arg_spec(a) for a in sig.args]])
                    cc.export(f"{fn}_{i}", sig)(f.py_func)
            with tempfile.TemporaryDirectory(dir=where, prefix=".build-") as tmp:
                cc.output_dir, cc.output_file = tmp, so.name
                cc.compile()
                built = Path(tmp) / so.name
                text = json.dumps({"module": so.name, "blake3": blake3.blake3(built.read_bytes()).hexdigest(),
                                   "exports": exports, "exports_blake3": _exports_digest(exports)})
                (Path(tmp) / meta.name).write_text(text)
                os.replace(built, so)
                os.replace(Path(tmp) / meta.name, meta)  # (last: `state` says built once both are there)
    except Exception as exc:
        try:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            failed.write_text(f"{type(exc).__name__}: {lines[0] if lines else ''}\n")
        except OSError:
            pass
        raise


def _exports_digest(exports: Any) -> str:
    """The exports' argument types as written (canonical JSON), digested: a damaged JSON file could otherwise
    let `Checked` pass an array of another dtype than the one compiled (wrong tokens, or a crash)."""
    return blake3.blake3(json.dumps(exports, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sweep(where: str | Path) -> int:
    """Remove the build folders a killed build left in `where` (``.build-*``; call while holding the folder's
    build lock, so no build is using one). Returns how many went."""
    gone = 0
    for left in Path(where).glob(".build-*"):
        shutil.rmtree(left, ignore_errors=True)
        gone += 1
    return gone


_DTYPES = frozenset(f"{k}{b}" for k in ("int", "uint") for b in (8, 16, 32, 64))  # (what the kernels take)
_C_ORDER, _WRITEABLE = 0x0001, 0x0400  # numpy's NPY_ARRAY_C_CONTIGUOUS and NPY_ARRAY_WRITEABLE (`ndarray.flags.num`)


class Checked:
    """One export, every argument checked before the call: arrays by exact type, dtype, rank, C order and
    writability as compiled, integers by type and range, booleans by type. TypeError otherwise."""

    def __init__(self, fn: Callable[..., Any], spec: list[list[Any]], name: str) -> None:
        self._fn, self.name = fn, name
        self._n = len(spec)
        # by kind, with their positions: an array's C order and writability as one test of its flag bits
        self._arrays: list[tuple[int, np.dtype, int, int, int]] = []
        self._ints: list[tuple[int, int, int]] = []
        self._bools: list[int] = []
        for i, a in enumerate(spec):
            if a[0] == "array":
                if a[1] not in _DTYPES:
                    raise ValueError(f"{name}: array dtype {a[1]!r}")
                order = _C_ORDER if a[3] else 0
                self._arrays.append((i, np.dtype(a[1]), int(a[2]), _WRITEABLE | order,
                                     order | (0 if a[4] else _WRITEABLE)))
            elif a[0] == "int":
                bits, signed = int(a[1]), bool(a[2])
                lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
                self._ints.append((i, lo, hi))
            elif a[0] == "bool":
                self._bools.append(i)
            else:
                raise ValueError(f"{name}: argument kind {a[0]!r}")

    def accepts(self, args: tuple[Any, ...]) -> bool:
        if len(args) != self._n:
            return False
        for i, dtype, ndim, mask, want in self._arrays:
            a = args[i]
            if type(a) is not np.ndarray or a.ndim != ndim or a.flags.num & mask != want:
                return False
            d = a.dtype
            if d is not dtype and d != dtype:  # (numpy's built-in dtypes are one object each: mostly the first test)
                return False
        for i, lo, hi in self._ints:
            a = args[i]
            if type(a) is not int and (isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer))):
                return False
            if not lo <= a <= hi:
                return False
        for i in self._bools:
            if not isinstance(args[i], (bool, np.bool_)):
                return False
        return True

    def __call__(self, *args: Any) -> Any:
        if not self.accepts(args):
            raise TypeError(f"{self.name}: arguments of types it was not compiled for")
        return self._fn(*args)


class Overloads:
    """Every export of one kernel (its source compiled for other argument types): one whose types accept the
    arguments is called; TypeError if none.

    The export that took the last call is tried first: a run's shards share one token dtype, and `gather` is
    called once an object touched (five sources: ~10 a call; sixteen: ~32), so trying the exports in their
    order checked the arguments against every dtype before the one in use (`bench/fused_mix.py`). The order
    changes no result: `gather`'s eight exports accept disjoint types (dtype and writability, tested exactly
    by `Checked`), and any export of a kernel computes what its source does."""

    def __init__(self, checked: list[Checked]) -> None:
        self._all = checked
        self._last = checked[0]  # (one attribute, replaced whole: producers of several replicas share it)

    def __call__(self, *args: Any) -> Any:
        last = self._last
        if last.accepts(args):
            return last._fn(*args)
        for c in self._all:
            if c is not last and c.accepts(args):
                self._last = c
                return c._fn(*args)
        raise TypeError(f"{self._all[0].name}: arguments of types it was not compiled for")


class _Face:
    """A `jitdraws` / `jitrows` module's face for `jit.Kernel`: its kernels by name."""

    def __init__(self, kernels: dict[str, Any]) -> None:
        self.__dict__.update(kernels)


def load(where: str | Path) -> tuple[Any, Any]:
    """The built module of this key in `where` as (draws, rows) faces for `jit.Kernel`. Raises OSError where it
    is not there, ValueError where its JSON is not what `build` writes or its bytes do not match their digest,
    ImportError where it does not import, PermissionError where the folder or the files may be written by
    another user (`unsafe`)."""
    so, meta, _ = paths(where)
    why = unsafe(where, (so, meta))
    if why is not None:
        raise PermissionError(why)
    try:
        doc = json.loads(meta.read_text())
        digest, exports = doc["blake3"], doc["exports"]
        if not isinstance(digest, str) or not isinstance(exports, dict):
            raise TypeError("fields")
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{meta}: not a kernel module's description ({exc})") from None
    if doc.get("exports_blake3") != _exports_digest(exports):
        raise ValueError(f"{meta}: its exports do not match their digest (remove it and the module to build again)")
    if blake3.blake3(so.read_bytes()).hexdigest() != digest:
        raise ValueError(f"{so}: its bytes do not match the digest in {meta.name} (remove both to build again)")
    name = so.name.split(".")[0]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, so)
        if spec is None or spec.loader is None:
            raise ImportError(f"{so}: not an extension module")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    kernels: dict[str, Any] = {}
    try:
        for _, fn in EXPORTS:
            checked = [Checked(getattr(mod, export), spec, export) for export, spec in exports[fn]]
            kernels[fn] = checked[0] if len(checked) == 1 else Overloads(checked)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(f"{meta}: its exports do not match the module ({exc})") from None
    draws = _Face({k: kernels[k] for m, k in EXPORTS if m == "jitdraws"})
    rows = _Face({k: kernels[k] for m, k in EXPORTS if m == "jitrows"})
    return draws, rows
