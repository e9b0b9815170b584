"""The fused path's compiled kernel (numba, the optional ``jit`` extra): the call into it.

`fused.fused_steps(..., kernel=...)` hands sections 2-4 of a call to a
loaded `Kernel`, which runs the compiled code of `jitkernels`; it gives the
same bytes and states as the numpy path, which stays the fallback: numba not
installed, the kernel not loaded yet, a token dtype it was not compiled for
(tests/test_logical_jit.py). Loading it (numba's import, its compile or its
on-disk cache, a background thread) is the physical plane's business:
`sluice/loaderd/physical/jitload.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sluice.errors import InternalError

# token dtypes compiled at load (the shard formats' dtypes); others take the numpy path
DTYPES = (np.uint16, np.uint32, np.int32, np.int64)
OFFSET_DTYPES = (np.uint64, np.int64)  # offsets tables compiled at load (token shards: uint64)


class Kernel:
    """The three compiled kernels of `jitkernels`, warmed; `sections` is what `fused._compute` calls."""

    def __init__(self, mod: Any) -> None:
        self._plan, self._gather, self._finish, self._locate = mod.plan_call, mod.gather, mod.finish, mod.locate
        self._status = (mod.OK, mod.ASIDE, mod.SHORT)
        # `fusedmix`'s draws of one lane (mixtures, piece draws): called with `walk.status`, not through `sections`
        self.walk = _Walk(mod)
        self._assemble = mod.assemble
        self.calls = 0  # calls computed by the kernel
        self.declined = 0  # calls it handed back to the numpy path (an argument type not compiled)

    def locate(self, mapped: dict[int, Any], uniq: list[int], objs: np.ndarray,
               recs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None | Any:
        """`fused._compute`'s (token starts, token counts) of the located candidates (object `objs[c]`, record
        `recs[c]`, both int64) from the `mapped` shards' offsets; None where a record lies past its shard's end
        (`fused.PAST_END`);
        NotImplemented where an offsets table is of a type not compiled (the numpy path runs)."""
        objs, recs = _i64(objs), _i64(recs)
        tstart = np.empty(len(objs), dtype=np.int64)
        ntok = np.empty(len(objs), dtype=np.int64)
        locate = self._locate
        try:
            for o in uniq:
                if not locate(mapped[o][0], o, objs, recs, tstart, ntok):
                    return None
        except TypeError:  # an offsets type not compiled at load (compiling is off)
            self.declined += 1
            return NotImplemented
        return tstart, ntok

    def sections(self, plan: Any, state: Any, docs: Any, lanes: list[int], lstates: list[Any], s: int, n: int,
                 res: list[Any], counts: list[int], capped: list[bool], wraps: list[int | None],
                 all_idx: np.ndarray, objs: np.ndarray, recs: np.ndarray, tstart: np.ndarray, ntok: np.ndarray,
                 mapped: dict[int, Any], uniq: list[int]) -> Any:
        """`fused._compute` from its located candidates on: a `FusedSteps` (`compiled` set), the reason the
        per-lane path takes the call (`fused.REASONS`), `fused.NOT_COVERED`, or NotImplemented where the kernel
        does not cover the call (the numpy path runs)."""
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
            if status == aside:  # (the kernel's two checks, in its order: an empty document, then a residual)
                return fused.EMPTY_DOC if not lead and not trail and not ntok[:sum(counts)].all() \
                    else fused.RESIDUAL
            if status != ok:
                return fused.SHARE_END if any(c for c, sh in zip(capped, short.tolist()) if sh) else fused.NOT_COVERED
            NT, PT3 = n * T, 3 * P * T
            for o, t in zip(uniq, toks):
                self._gather(t, o, copies, flat, nexts, T, NT, PT3)
            self._finish(flat, nexts, marks, P, n, T)
        except TypeError:  # an argument type not compiled at load (compiling is off): the numpy path
            self.declined += 1
            return NotImplemented
        self.calls += 1
        nd, ntk, nls, strad, r_off, fend_q, cur_idx, _ = lanestep.tolist()
        per_obj = fused.lane_states(lanes, lstates, s, n, k, res, nd, ntk, nls, strad, r_off, fend_q, cur_idx, wraps)
        last = range(n - 1, P * n, n)
        drawn = sum(nd[t] for t in last)
        got = fused.step_result(plan, state, docs, s, lanes, n, k, L, block, keys, owners.tolist(), own_loc.tolist(),
                                objs, recs, entries.shape[1], per_obj, entries[0], entries[1], glob,
                                drawn + int(has.sum()), drawn, sum(ntk[t] for t in last))
        got.compiled = True
        return got


    def assemble(self, framing: Any, n: int, k: int, L: int, pieces: np.ndarray, counts: np.ndarray,
                 totals: np.ndarray, okeys: np.ndarray, toks: list[np.ndarray]) -> Any:
        """`fusedmix._assemble` of walked pieces (`walk`'s arrays; `okeys` each piece's index in `toks`, the
        token arrays): (block, keys, owners, lane-major positions, entry starts, entry offsets), or
        NotImplemented where a token dtype or frame id was not compiled (the numpy assembly runs)."""
        if any(t.dtype.type not in DTYPES or t.ndim != 1 for t in toks):
            return NotImplemented
        lead, trail = int(framing.bos is not None), int(framing.eos is not None)
        bos = 0 if framing.bos is None else framing.bos
        eos = 0 if framing.eos is None else framing.eos
        if not (-(1 << 31) <= bos < 1 << 31 and -(1 << 31) <= eos < 1 << 31):
            return NotImplemented
        P = len(counts)
        T = k * L
        block = np.empty((n, 3, P * k, L), dtype=np.int32)
        flat = block.reshape(-1)
        try:
            ok, copies, marks, cuts, keys, owners, glob, starts, offs, nexts = self._assemble(
                P, n, T, L, lead, trail, bool(framing.masks_eos_target), bos, eos, pieces, counts, totals, okeys,
                flat)
            if not ok:
                raise InternalError("fused kernel: the walked pieces do not tile the lanes' streams of the call")
            NT, PT3 = n * T, 3 * P * T
            for o, t in enumerate(toks):
                self._gather(t, o, copies, flat, nexts, T, NT, PT3)
            self._finish(flat, nexts, marks, P, n, T)
        except TypeError:  # an argument type not compiled at load (compiling is off): the numpy assembly
            self.declined += 1
            return NotImplemented
        flat[cuts] = nexts[P:]  # (after `finish`, which writes the label plane from the tokens)
        return block, keys, owners, glob, starts, offs


class _Walk:
    """`jitkernels.walk`, called as the function itself; `status` its (done, aside, need, full) codes. An argument
    type not compiled (compiling is off) raises TypeError there, which `fusedmix` never passes: every argument
    is an int64 array or scalar it makes itself."""

    def __init__(self, mod: Any) -> None:
        self._fn = mod.walk
        self.status = (mod.WALK_DONE, mod.WALK_ASIDE, mod.WALK_NEED, mod.WALK_FULL)
        self.calls = 0

    def __call__(self, *args: Any) -> tuple[int, int]:
        self.calls += 1
        return self._fn(*args)


def _i64(a: np.ndarray) -> np.ndarray:
    """`a` as the one array type the kernels are compiled for: writable, C-contiguous int64 (a copy only
    where it is not: the memoized lane orders are read-only)."""
    f = a.flags
    return a if a.dtype == np.int64 and f.writeable and f.c_contiguous else np.array(a, dtype=np.int64)
