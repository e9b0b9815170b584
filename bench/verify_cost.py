"""Benchmark: what verifying served bytes costs the producer (issue 27, "Verified on every read").

In one process, over a prepared bench/peers corpus (``make bench-peers`` builds
``bench/peers/work/full``): the pre-tokenized variant (``derived/manifest.json``
with ``cache-pretok``) and, where its tokens were cached, the raw one with
``cache-tok``. For each, a replica's `StepMaker` makes `--steps` steps with
`produce_run` (the thread producer's call, `STEPS_AT_ONCE` steps a call), the
CPU time of this thread measured:

* ``checked``: as the daemon runs it, every call's reads checked
  (`DocSource.check_reads`: one fstat per object read);
* ``unchecked``: the same with the check replaced by "nothing changed" (what
  sluice did before the check existed);

interleaved in `--rounds` rounds, medians. Also: the first map's verification
(every chunk hashed once per process), MB/s.

``--refilled``: the rate from a cache that was damaged and re-filled against an
intact one (issue 27's done-when). A copy of the cache has one byte flipped in
the middle of every object file; a replica makes steps from it until every
damaged object it needs was found, quarantined and filled again, then both
caches' `checked` runs are interleaved the same way (``refilled_ratio``:
intact CPU per step over refilled CPU per step; 1.0 = the same rate).

Prints a table, one JSON line, and writes bench/out/verify_cost.json.

Run: ``.venv/bin/python bench/verify_cost.py [--steps 4000] [--rounds 5] [--refilled]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
_WORK = _REPO / "bench" / "peers" / "work" / "full"


def _variants() -> list[tuple[str, Path, Path]]:
    out = [("pretok", _WORK / "derived" / "manifest.json", _WORK / "cache-pretok")]
    if (_WORK / "cache-tok").is_dir():
        out.append(("tokcache", _WORK / "manifest.json", _WORK / "cache-tok"))
    return out


def _run(maker, docs, plan, steps: int, checked: bool) -> float:
    """CPU seconds of this thread for `steps` steps from the start."""
    from sluice.loaderd.physical.producer import STEPS_AT_ONCE

    if not checked:
        docs.check_reads = lambda: True  # (the instance attribute shadows the method)
    try:
        state = plan.initial_state()
        t = time.thread_time()
        done = 0
        while done < steps:
            entries, state = maker.produce_run(state, STEPS_AT_ONCE)
            done += len(entries)
        return time.thread_time() - t
    finally:
        docs.__dict__.pop("check_reads", None)


def _flip_every_object(cache_dir: Path) -> int:
    """Flip one byte in the middle of every published object file of a cache, in place; how many."""
    n = 0
    for path in sorted((cache_dir / "objects").glob("*/*")):
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x5A]))
        n += 1
    return n


class _Replica:
    """One replica's StepMaker over an opened data path, its first steps made (objects mapped, verified)."""

    def __init__(self, manifest_path: Path, cache_dir: Path, jit: str, warm_steps: int) -> None:
        from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
        from sluice.loaderd.physical.producer import StepMaker
        from sluice.manifest.model import load_manifest
        from sluice.runspec import load_runspec

        spec = load_runspec(_WORK / "run.toml")
        config = DataPathConfig(cache_dir=str(cache_dir), cache_budget=1 << 36, verify_on_read=False,
                                collect=False, jit=jit, window_steps=0)
        self._data = open_data_path(load_manifest(manifest_path), spec, config)
        data = self._data.__enter__()
        self.plan, self.docs = data.plan(), data.docs
        self.maker = StepMaker(self.plan, self.docs, replica=0, replicas=1)
        t = time.perf_counter()
        _run(self.maker, self.docs, self.plan, warm_steps, True)  # maps (and verifies) what they need
        self.docs.wait_filled(600)
        self.first_s = time.perf_counter() - t
        self.kernel = False
        if jit == "auto" and self.docs.jit is not None:
            self.docs.jit.start()
            self.kernel = self.docs.jit.wait(300) and self.docs.jit.kernel is not None
            self.maker.jit = self.docs.jit

    def mapped_bytes(self) -> int:
        return sum(e.pin.size for _, e in self.docs.mapped_entries() if e.pin is not None)

    def run(self, steps: int, checked: bool = True) -> float:
        return _run(self.maker, self.docs, self.plan, steps, checked)

    def close(self) -> None:
        self._data.__exit__(None, None, None)


def measure(name: str, manifest_path: Path, cache_dir: Path, steps: int, rounds: int, jit: str) -> dict:
    rep = _Replica(manifest_path, cache_dir, jit, 8)
    try:
        got: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for r in range(rounds):
            for kind in (("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")):
                got[kind].append(rep.run(steps, kind == "checked"))
        mapped = rep.mapped_bytes()
    finally:
        rep.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"variant": name, "kernel": rep.kernel, "steps": steps, "rounds": rounds, "mapped_mb": mapped / 1e6,
            "first_steps_s": rep.first_s, "checked_us_per_step": med["checked"] / steps * 1e6,
            "unchecked_us_per_step": med["unchecked"] / steps * 1e6,
            "ratio": med["unchecked"] / med["checked"], "raw": got}


def measure_refilled(name: str, manifest_path: Path, cache_dir: Path, steps: int, rounds: int, jit: str) -> dict:
    """The checked rate from a damaged-then-refilled copy of the cache against the intact cache."""
    with tempfile.TemporaryDirectory(prefix="verify-cost-") as tmp:
        copy = Path(tmp) / "cache"
        shutil.copytree(cache_dir, copy, symlinks=True)
        flipped = _flip_every_object(copy)
        intact = _Replica(manifest_path, cache_dir, jit, 8)
        try:
            # (every step of the timed runs reads the same objects: the first run over them finds and re-fills
            # every damaged one it needs; the refills are done before the timed rounds start)
            damaged = _Replica(manifest_path, copy, jit, steps)
            try:
                refilled = damaged.docs.served.damaged_objects
                got: dict[str, list[float]] = {"intact": [], "refilled": []}
                for r in range(rounds):
                    order = (("intact", intact), ("refilled", damaged))
                    for kind, rep in (order if r % 2 == 0 else order[::-1]):
                        got[kind].append(rep.run(steps))
                refilled = damaged.docs.served.damaged_objects
            finally:
                damaged.close()
        finally:
            intact.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"variant": name, "flipped_files": flipped, "damaged_found": refilled, "steps": steps,
            "rounds": rounds, "intact_us_per_step": med["intact"] / steps * 1e6,
            "refilled_us_per_step": med["refilled"] / steps * 1e6,
            "refilled_ratio": med["intact"] / med["refilled"], "raw": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4000, help="steps per timed run (default 4000)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--jit", choices=["auto", "off"], default="auto",
                    help="auto: wait for the compiled kernel (numba) first, as a long run has it; off: numpy only")
    ap.add_argument("--refilled", action="store_true",
                    help="also: the rate from a damaged-then-refilled copy of each cache against the intact one")
    args = ap.parse_args(argv)
    if not (_WORK / "derived" / "manifest.json").is_file():
        print(f"bench/verify_cost.py: no prepared corpus under {_WORK}; run `make bench-peers` first",
              file=sys.stderr)
        return 2
    rows = [measure(n, m, c, args.steps, args.rounds, args.jit) for n, m, c in _variants()]
    print(f"{'variant':10} {'kernel':>6} {'mapped MB':>9} {'checked us/step':>16} {'unchecked us/step':>18} "
          f"{'rate ratio':>10}")
    for r in rows:
        print(f"{r['variant']:10} {str(r['kernel']):>6} {r['mapped_mb']:9.1f} {r['checked_us_per_step']:16.1f} "
              f"{r['unchecked_us_per_step']:18.1f} {r['ratio']:10.3f}")
    if args.refilled:
        refills = [measure_refilled(n, m, c, args.steps, args.rounds, args.jit) for n, m, c in _variants()]
        print(f"\n{'variant':10} {'flipped':>7} {'found':>5} {'intact us/step':>14} {'refilled us/step':>16} "
              f"{'rate ratio':>10}")
        for r in refills:
            print(f"{r['variant']:10} {r['flipped_files']:7d} {r['damaged_found']:5d} "
                  f"{r['intact_us_per_step']:14.1f} {r['refilled_us_per_step']:16.1f} {r['refilled_ratio']:10.3f}")
        rows += refills
    out = _REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k != "raw"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
