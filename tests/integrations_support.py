"""Helpers for the framework crash/resume tests (tests/test_integrations_{hf,lightning,fsdp,ddp}.py).

Both run an example script (a tiny GPT-2, an embedded loaderd) as a process
group of its own, kill it with SIGKILL once a condition holds, restart it and
compare what it trained (batches.jsonl: step, micro, row digests) and its
final parameters (params.pt) with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

STEPS = 32  # long after the kill point (EVERY): a tiny model trains a step in milliseconds, and a
# kill that lands after the last step would leave nothing to resume
EVERY = 4
MICROS = 4  # build_corpus's run spec: global batch 8 in micro-batches of 2
RANKS = 2  # the two-rank tests (Lightning ddp, HF SluiceTrainer)
RANK_MICROS = MICROS // RANKS  # each replica trains its share of the global batch
TIMEOUT = 150.0
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def start(script: str, corpus: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start examples/SCRIPT for STEPS steps, checkpointing every EVERY (and `extra` arguments), in a process
    group of its own."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"trainer-{time.time_ns()}.log", "wb")
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), "--manifest", str(corpus / "manifest.json"),
         "--runspec", str(corpus / "run.toml"), "--cache", str(corpus / "cache"), "--out", str(out),
         "--steps", str(STEPS), "--every", str(EVERY), *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its own group: kill -9 takes the daemon too


# Appended to a rank's code: once it has run to its end (its output flushed), the process leaves without the
# interpreter's teardown. torch's gloo ranks aborted there now and then after destroy_process_group
# ("terminate called without an active exception", SIGABRT; faulthandler showed no Python frame on any thread:
# a C++ thread still joinable as its owner is destroyed at finalization), 1 run in 4-15 here. A rank that
# raises never reaches it and exits non-zero as before.
RANK_EPILOGUE = "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"


def run_rank_scripts(code: str, world: int, tmp: Path, *argv: str, timeout: float = 120.0) -> None:
    """Run `python -c CODE RANK WORLD file://TMP/rdzv-WORLD *ARGV` as `world` ranks; assert each exits 0.

    A rank still running after `timeout` (or after another's failure) is killed.
    """
    init = f"file://{tmp}/rdzv-{world}-{time.time_ns()}"
    # -X faulthandler: a rank that aborts (SIGABRT from C++) prints where each of its Python threads was
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code + RANK_EPILOGUE, str(r), str(world),
                               init, *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def finish(proc: subprocess.Popen[bytes], out: Path) -> None:
    """Wait for a run to end (asserting exit 0, with its log); its group is killed in any case."""
    try:
        rc = proc.wait(TIMEOUT)
    finally:
        kill_group(proc)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("trainer-*.log")))
    assert rc == 0, f"trainer exited {rc}:\n{logs}"


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
    """SIGKILL the run's process group as soon as `ready()` holds (bounded wait)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while not ready():
            assert proc.poll() is None, "the trainer ended before it could be killed"
            assert time.monotonic() < deadline, "the kill condition did not hold in time"
            time.sleep(0.05)
    finally:
        kill_group(proc)


def lines(path: Path, skip: int = 0) -> list[dict]:
    """JSON lines of `path` from byte `skip` on (a line cut short by kill -9 is passed over)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_bytes()[skip:].decode().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def trained_past(run: Path, step: int) -> bool:
    return any(b["step"] > step for b in lines(run / "batches.jsonl"))


def assert_resumed_exactly(reference: Path, run: Path, crashed: list[dict], skip: int, first: int) -> None:
    """The restarted run (batches.jsonl from byte `skip`) trained steps first..STEPS-1, every micro-batch
    equal to the reference's, the crashed run's batches too, and ended with bitwise equal parameters."""
    ref = {(b["step"], b["micro"]): b["rows"] for b in lines(reference / "batches.jsonl")}
    resumed = lines(run / "batches.jsonl", skip)
    assert [(b["step"], b["micro"]) for b in resumed] == [(s, m) for s in range(first, STEPS) for m in range(MICROS)]
    assert all(b["rows"] == ref[(b["step"], b["micro"])] for b in resumed), "a resumed batch differs"
    assert all(b["rows"] == ref[(b["step"], b["micro"])] for b in crashed), "a batch before the crash differs"
    a = torch.load(reference / "params.pt", weights_only=True)
    b = torch.load(run / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"


def rank_batches(run: Path, rank: int, skip: int = 0) -> list[tuple[int, int, tuple[str, ...]]]:
    """(step, micro, row digests) of what rank `rank` trained (batches-r<rank>.jsonl from byte `skip`)."""
    return [(b["step"], b["micro"], tuple(b["rows"])) for b in lines(run / f"batches-r{rank}.jsonl", skip)]


def assert_ranks_split_the_global_batch(reference: Path, reference_ddp: Path) -> None:
    """Each of RANKS ranks trained its replica's RANK_MICROS micro-batches per step, and per step their rows
    (replica 0's, then replica 1's) are the one-process run's global batch."""
    one = {(b["step"], b["micro"]): b["rows"] for b in lines(reference / "batches.jsonl")}
    per_rank = [rank_batches(reference_ddp, r) for r in range(RANKS)]
    for trained in per_rank:
        assert [(s, m) for s, m, _ in trained] == [(s, m) for s in range(STEPS) for m in range(RANK_MICROS)]
    for s in range(STEPS):
        two = [row for r in range(RANKS) for st, _, rows in per_rank[r] if st == s for row in rows]
        assert two == [row for m in range(MICROS) for row in one[(s, m)]], f"step {s}: another global batch"


def assert_ranks_resumed_exactly(reference_ddp: Path, run: Path, skips: list[int], first: int) -> None:
    """Every rank of the restarted run (batches-r<rank>.jsonl from byte skips[rank]) trained steps
    first..STEPS-1 with the uninterrupted run's micro-batches, and rank 0 ended with its parameters, bitwise."""
    for r in range(RANKS):
        ref = {(s, m): rows for s, m, rows in rank_batches(reference_ddp, r)}
        resumed = rank_batches(run, r, skips[r])
        assert [(s, m) for s, m, _ in resumed] == [(s, m) for s in range(first, STEPS) for m in range(RANK_MICROS)]
        assert all(rows == ref[(s, m)] for s, m, rows in resumed), f"rank {r}: a resumed micro-batch differs"
    a = torch.load(reference_ddp / "params.pt", weights_only=True)
    b = torch.load(run / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == [], "parameters differ from the uninterrupted run"
