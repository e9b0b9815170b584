"""A kernel load the process itself stopped (`KernelLoader.close` killed its compile child: the daemon or a CLI
stops) is said at info, not as the warning a failed load is: a daemon stopped during a cold compile logged
"fused kernel not loaded" though nothing had failed."""

from __future__ import annotations

import logging

import pytest

from sluice.loaderd.physical import jitload
from sluice.loaderd.physical.jitload import KernelLoader


@pytest.mark.parametrize("closed", [True, False])
def test_a_load_stopped_by_close_is_info_and_a_failed_one_a_warning(monkeypatch, caplog, tmp_path, closed):
    numba = pytest.importorskip("numba")
    # A cold cache whatever this process's numba cache holds (the marker of a compile never made), and numba's
    # cache folder as it was after the test (the load names one where none is set yet).
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    monkeypatch.setattr(jitload, "_marker_name", lambda *a: f"never-compiled-{tmp_path.name}")
    loader = KernelLoader("numba", cache_dir=tmp_path)

    def child(*args, **kwargs):  # (the compile child's end: killed by `close`, or failed on its own)
        if closed:
            loader.close()
        raise RuntimeError("fused kernel compile child: exit -9")

    monkeypatch.setattr(jitload, "_warm_in_child", child)
    with caplog.at_level(logging.INFO, logger="sluice.loaderd"):
        loader.start("test")
        assert loader.wait(60)
    assert loader.state == "failed" and loader.kernel is None and "exit -9" in loader.cause
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "stopped with" in r.getMessage()]
    assert (warned, bool(said)) == (([], True) if closed else (warned, False))
    if not closed:
        assert any("staying on Plan.step" in m for m in warned)
