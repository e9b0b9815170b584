"""`jitaot.Checked` and `jitaot.unsafe`: what guards the calls into the module compiled ahead of time, and its load.

pycc's wrappers do not check their arguments (a wrong dtype or rank crashes the process), so `Checked.accepts`
is the only guard. Specification: it accepts exactly what this plain model accepts, for every kind of argument
the exports declare (arrays by exact type, dtype, rank, C order and writability; integers by type and range;
booleans by type). No numba needed: the checks are plain Python over the JSON's argument types.
A cache folder (or module file) another user may write is never loaded from or compiled into.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import examples

from sluice.loaderd.physical.jitaot import Checked, Overloads

DTYPES = ("int8", "uint16", "int32", "uint32", "int64", "uint64")


def model(spec: list[list], args: tuple) -> bool:
    """What an argument list must be for an export declared by `spec` (jitaot's JSON form), written plainly."""
    if len(args) != len(spec):
        return False
    for a, s in zip(args, spec):
        if s[0] == "array":
            if type(a) is not np.ndarray or a.dtype != np.dtype(s[1]) or a.ndim != s[2]:
                return False
            if s[3] and not a.flags.c_contiguous:
                return False
            if a.flags.writeable == s[4]:  # (s[4]: compiled for a read-only array)
                return False
        elif s[0] == "int":
            if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
                return False
            lo, hi = (-(1 << (s[1] - 1)), (1 << (s[1] - 1)) - 1) if s[2] else (0, (1 << s[1]) - 1)
            if not lo <= a <= hi:
                return False
        elif not isinstance(a, (bool, np.bool_)):
            return False
    return True


array_specs = st.tuples(st.just("array"), st.sampled_from(DTYPES), st.integers(1, 2), st.booleans(), st.booleans())
int_specs = st.tuples(st.just("int"), st.sampled_from([8, 32, 64]), st.booleans())
specs = st.lists(st.one_of(array_specs.map(list), int_specs.map(list), st.just(["bool"])), min_size=1, max_size=4)


@st.composite
def values(draw) -> object:
    kind = draw(st.sampled_from(["array", "int", "bool", "other"]))
    if kind == "array":
        dtype = draw(st.sampled_from(DTYPES + (">i4", "float64")))
        a = np.zeros((4, 6) if draw(st.integers(1, 2)) == 2 else 12, dtype=dtype)
        if draw(st.booleans()):
            a = a[..., ::2]  # not C order
        if draw(st.booleans()):
            a = a.view()
            a.flags.writeable = False
        return a
    if kind == "int":
        v = draw(st.one_of(st.integers(-(1 << 70), 1 << 70), st.integers(-300, 300)))
        return draw(st.sampled_from([v, np.int64(max(min(v, 2**63 - 1), -(2**63)))]))
    if kind == "bool":
        return draw(st.sampled_from([True, False, np.bool_(True)]))
    return draw(st.sampled_from([1.5, [1, 2], None, "3"]))


def fitting(s: list) -> st.SearchStrategy:
    """A value the spec entry `s` declares (an array of its dtype, rank, order and writability; an integer in
    its range; a boolean)."""
    if s[0] == "array":
        def make(_: object) -> np.ndarray:
            a = np.zeros((4, 6) if s[2] == 2 else 12, dtype=s[1])
            if s[4]:
                a.flags.writeable = False
            return a
        return st.just(None).map(make)
    if s[0] == "int":
        lo, hi = (-(1 << (s[1] - 1)), (1 << (s[1] - 1)) - 1) if s[2] else (0, (1 << s[1]) - 1)
        return st.integers(lo, hi)
    return st.booleans()


def near(s: list) -> st.SearchStrategy:
    """A value one step from what `s` declares: an array with one of dtype (same kind, another size, or
    big-endian), rank, order or writability changed; an integer at or just past an end of its range; 0 or 1 for
    a boolean."""
    if s[0] == "array":
        def make(change: str) -> np.ndarray:
            dtype = {"int8": "int16", "uint16": "uint32", "int32": ">i4", "uint32": "int32", "int64": "uint64",
                     "uint64": "int64"}[s[1]] if change == "dtype" else s[1]
            ndim = 3 - s[2] if change == "ndim" else s[2]
            a = np.zeros((4, 12) if ndim == 2 else 24, dtype=dtype)
            if change == "order":
                a = a[..., ::2]
            if s[4] != (change == "writable"):
                a.flags.writeable = False
            return a
        return st.sampled_from(["dtype", "ndim", "order", "writable"]).map(make)
    if s[0] == "int":
        lo, hi = (-(1 << (s[1] - 1)), (1 << (s[1] - 1)) - 1) if s[2] else (0, (1 << s[1]) - 1)
        return st.sampled_from([lo, hi, lo - 1, hi + 1, np.int64(max(lo, -(2**63)))])
    return st.sampled_from([0, 1])


COUNTS = {"accepted": 0, "refused": 0}


@settings(max_examples=examples(400), deadline=None)
@given(spec=specs, data=st.data())
def test_checked_accepts_exactly_what_the_model_accepts(spec, data):
    # each argument fits its entry most of the time, else is one step from it or any value; now and then one
    # argument too few or too many
    args = [data.draw(st.one_of(fitting(s), fitting(s), near(s), near(s), values())) for s in spec]
    extra = data.draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
    args = args[:extra] if extra < 0 else args + [1] * extra
    checked = Checked(lambda *a: "called", spec, "export")
    got = checked.accepts(tuple(args))
    assert got == model(spec, tuple(args))
    COUNTS["accepted" if got else "refused"] += 1


def test_the_property_sees_both_answers():
    """Run after the property (file order): it met accepted and refused argument lists alike."""
    assert COUNTS["accepted"] >= 5 and COUNTS["refused"] >= 5, COUNTS


def test_fitting_arguments_are_accepted_and_called():
    """The checks are not vacuous: arguments that fit every declared kind pass and reach the function."""
    spec = [["array", "int64", 2, True, False], ["array", "uint16", 1, True, True], ["int", 64, True], ["bool"]]
    ro = np.zeros(5, dtype=np.uint16)
    ro.flags.writeable = False
    checked = Checked(lambda *a: "called", spec, "export")
    assert checked(np.zeros((2, 3), dtype=np.int64), ro, -5, True) == "called"
    assert not checked.accepts((np.zeros((2, 3), dtype=np.int64), ro.copy(), -5, True))  # writeable for read-only


def test_overloads_call_the_export_of_the_arguments_types_whichever_took_the_last_call():
    """A kernel with one export a token dtype and writability (`gather`'s eight): each call reaches the export
    its arguments fit, whatever the calls before it (the last one taken is tried first); a call no export
    fits is refused after any of them."""
    exports = []
    for dtype in ("uint16", "uint32"):
        for readonly in (False, True):
            exports.append(Checked(lambda *a, tag=(dtype, readonly): tag,
                                   [["array", dtype, 1, True, readonly], ["int", 64, True]], "gather"))
    kernel = Overloads(exports)

    def arg(dtype: str, readonly: bool) -> np.ndarray:
        a = np.zeros(3, dtype=dtype)
        a.flags.writeable = not readonly
        return a

    for dtype, readonly in [("uint32", True), ("uint32", True), ("uint16", False), ("uint32", True),
                            ("uint16", True), ("uint16", True), ("uint32", False)]:
        assert kernel(arg(dtype, readonly), 7) == (dtype, readonly)
    for bad in [(arg("int64", True), 7), (arg("uint32", True), 1 << 70), (arg("uint32", True),)]:
        with pytest.raises(TypeError, match="gather: arguments of types it was not compiled for"):
            kernel(*bad)
    assert kernel(arg("uint32", True), 7) == ("uint32", True)


def test_a_folder_or_file_others_may_write_is_unsafe(tmp_path):
    """The module is native code and numba's cache indexes are pickles: a folder (or module file) writable by
    every user, or owned by another user, is refused, naming the path and the way out."""
    from sluice.loaderd.physical.jitaot import unsafe

    where = tmp_path / "jit"
    assert unsafe(where) is None  # (not made yet: the loader makes it, with the umask)
    where.mkdir(mode=0o755)
    where.chmod(0o755)
    module = where / "m.so"
    module.write_bytes(b"x")
    module.chmod(0o644)
    assert unsafe(where, (module,)) is None
    for mode in (0o777, 0o1777):  # (sticky or not: another user may plant files under the module's name)
        where.chmod(mode)
        why = unsafe(where, (module,))
        assert why is not None and str(where) in why and "writable by every user" in why and "chmod o-w" in why
    where.chmod(0o775)  # the group's (a umask of 002 makes every folder so): trusted as its owner chose
    assert unsafe(where, (module,)) is None
    where.chmod(0o755)
    module.chmod(0o646)
    assert "writable by every user" in unsafe(where, (module,)) and str(module) in unsafe(where, (module,))
    module.chmod(0o644)
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root (chown)")
    os.chown(where, 65534, 65534)
    why = unsafe(where, (module,))
    assert why is not None and "belongs to user 65534" in why and "NUMBA_CACHE_DIR" in why


def test_the_loader_runs_nothing_from_a_folder_others_may_write(tmp_path, caplog, monkeypatch):
    """A daemon whose kernel cache folder is world-writable loads no kernel from it and compiles nothing into it:
    one warning line says why, the state is failed, and the daemon stays on `Plan.step`."""
    from sluice.loaderd.physical.jitload import KernelLoader

    where = tmp_path / "jit"
    where.mkdir()
    where.chmod(0o777)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(where))  # (numba's folder is the environment's first)
    loader = KernelLoader("auto", where)
    with caplog.at_level(logging.INFO, logger="sluice.loaderd"):
        loader.start("test")
        assert loader.wait(60)
    assert loader.state == "failed" and loader.kernel is None and loader._child is None
    assert "writable by every user" in (loader.cause or "")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(where) in warned[0] and "remove it" not in warned[0], warned
    assert list(where.iterdir()) == []  # nothing compiled into it
