"""Attacks on the demand path's spill file (sluice/loaderd/physical/demand.py).

Parked token arrays past `SIDE_BYTES` go to an unlinked spill file in the
node cache's tmp/; past its bounds, or when the disk refuses, they are
dropped and the fill tokenizes them again (the documented fallback). These
tests fill the disk under the spill for real and hold the contract: a
document read back from the spill is exactly the array parked, or it is not
held at all (None: tokenized again). Never a short or foreign array, never
a traceback, never a hang.

* A file-size limit (RLIMIT_FSIZE, in a child process) makes the kernel
  write part of a spilled array and then refuse: `os.pwrite` returns a short
  count without raising. Before the fix the record was noted as spilled and
  read back short (a wrong document in the token object, silently).
* A real full disk (a small tmpfs, filled; root only) refuses the spill:
  every document is either read back whole or not held.
* An unwritable spill folder (removed) drops to the fallback.
* The document and byte bounds hold: past them, dropped, never spilled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from sluice.loaderd.physical import demand as demand_mod
from sluice.loaderd.physical.demand import SIDE_BYTES, Demand
from support import mount_tmpfs

DOC = 1 << 20  # tokens per parked document (4 MiB)


def _park_all(d: Demand, n: int) -> dict[int, np.ndarray]:
    made = {r: np.full(DOC, r + 1, dtype=np.uint32) + np.arange(DOC, dtype=np.uint32) for r in range(n)}
    for r, a in made.items():
        d.park([r], [a], 0)
    return made


def _check_held_or_absent(d: Demand, made: dict[int, np.ndarray]) -> tuple[int, int]:
    held = absent = 0
    for r, want in made.items():
        got = d.get(r)
        if got is None:
            absent += 1
            continue
        assert got.dtype == np.uint32 and np.array_equal(got, want), f"record {r}: read back another array"
        held += 1
    for r, want in made.items():  # the fill's read (forgets a spilled record once read back)
        got = d.reuse(r)
        assert got is None or np.array_equal(got, want), f"record {r}: the fill read back another array"
    return held, absent


_CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_attack_demand_spill import _park_all, _check_held_or_absent
    from sluice.loaderd.physical.demand import Demand
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: a short write, then EFBIG
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    d = Demand((0, 0), spill_dir=sys.argv[1])
    made = _park_all(d, 8)
    print(json.dumps({"spilled": len(d.spilled), "held_absent": _check_held_or_absent(d, made)}))
    d.release()
""")


def test_a_short_write_to_the_spill_is_never_read_back_as_a_document(tmp_path):
    limit = (4 * DOC + 4) + 2 * DOC  # the first spilled array fits, the second only half
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), os.path.dirname(__file__), str(limit)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["spilled"] == 1, out  # the half-written one is not noted as spilled
    held, absent = out["held_absent"]
    assert held == 8 - absent and absent >= 1, out  # the rest: parked in memory, or dropped
    assert list(tmp_path.iterdir()) == []  # the spill is unlinked


def test_a_full_disk_under_the_spill_falls_back_without_a_wrong_document(tmp_path):
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "10m"):  # the first 4 MiB array fits, the second half does
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    try:
        d = Demand((0, 0), spill_dir=str(disk))
        made = _park_all(d, 8)
        assert 1 <= len(d.spilled) <= 2
        held, absent = _check_held_or_absent(d, made)
        assert held + absent == 8 and absent >= 1
        d.release()
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_spill_folder_that_is_gone_drops_to_the_fallback(tmp_path):
    d = Demand((0, 0), spill_dir=str(tmp_path / "gone"))
    made = _park_all(d, 6)
    assert not d.spilled and d.side_bytes <= SIDE_BYTES + 4 * DOC
    held, absent = _check_held_or_absent(d, made)
    assert (held, absent) == (len(d.side), 6 - len(d.side)) and absent >= 1
    d.release()


def test_the_spill_bounds_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(demand_mod, "SPILL_DOCS", 2)
    d = Demand((0, 0), spill_dir=str(tmp_path))
    made = _park_all(d, 9)
    assert len(d.spilled) == 2 and d.spill_at == 2 * (4 * DOC + 4)
    held, absent = _check_held_or_absent(d, made)
    assert held == len(d.side) + 2 and held + absent == 9
    d.release()
    monkeypatch.setattr(demand_mod, "SPILL_DOCS", 1 << 17)
    monkeypatch.setattr(demand_mod, "SPILL_BYTES", 4 * DOC + 4)
    d = Demand((0, 0), spill_dir=str(tmp_path))
    made = _park_all(d, 9)
    assert len(d.spilled) == 1 and d.spill_at == 4 * DOC + 4
    assert sum(_check_held_or_absent(d, made)) == 9
    d.release()
