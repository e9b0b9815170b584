"""transformers.Trainer on sluice: kill -9 after a checkpoint, resume_from_checkpoint, bit for bit.

Real processes: examples/hf_trainer.py (a 1-layer GPT-2 from a config, an
embedded loaderd) trains STEPS optimizer steps uninterrupted; the same run is
started again, killed with SIGKILL (trainer and its daemon: the process group)
after the checkpoint of global step EVERY, and started once more, which
resumes from that checkpoint. Every micro-batch the resumed run trains equals
the uninterrupted run's, and so do the final parameters, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three trainer processes (transformers' import alone takes seconds)

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'sluice[hf]')")
torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")

from loaderd_support import build_corpus  # noqa: E402

STEPS = 8
EVERY = 4
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
TIMEOUT = 150.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    # seq_len 64, 4 lanes, global batch 8 in micro-batches of 2: 4 micro-batches per optimizer step
    return build_corpus(tmp_path_factory.mktemp("integ-hf"), "jsonl.zst", tokenizer_file, docs=160)


def start(corpus: Path, out: Path) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"trainer-{time.time_ns()}.log", "wb")
    return subprocess.Popen(
        [sys.executable, str(TRAIN), "--manifest", str(corpus / "manifest.json"), "--runspec", str(corpus / "run.toml"),
         "--cache", str(corpus / "cache"), "--out", str(out), "--steps", str(STEPS), "--every", str(EVERY)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its own group: kill -9 takes the daemon too


def finish(proc: subprocess.Popen[bytes], out: Path) -> None:
    try:
        rc = proc.wait(TIMEOUT)
    finally:
        kill_group(proc)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("trainer-*.log")))
    assert rc == 0, f"trainer exited {rc}:\n{logs}"


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def lines(path: Path, skip: int = 0) -> list[dict]:
    out = []
    for line in path.read_bytes()[skip:].decode().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # cut short by kill -9
            pass
    return out


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hf-reference")
    finish(start(corpus, run), run)
    return run


def test_uninterrupted_run_checkpoints_the_data_state(reference):
    batches = lines(reference / "batches.jsonl")
    assert [(b["step"], b["micro"]) for b in batches] == [(s, m) for s in range(STEPS) for m in range(4)]
    for g in (EVERY, STEPS):
        folder = reference / "ckpt" / f"checkpoint-{g}"
        state = json.loads((folder / "sluice_data.json").read_text())
        assert state["kind"] == "sluice.data-state" and state["step"] == g - 1
        assert (folder / "trainer_state.json").is_file()


def test_kill9_after_a_checkpoint_resumes_bit_for_bit(corpus, reference, tmp_path):
    run = tmp_path / "run"
    proc = start(corpus, run)
    deadline = time.monotonic() + TIMEOUT
    done = run / "ckpt" / f"checkpoint-{EVERY}" / "trainer_state.json"
    try:
        while not (done.is_file() and any(b["step"] > EVERY for b in lines(run / "batches.jsonl"))
                   if (run / "batches.jsonl").is_file() else False):
            assert proc.poll() is None, "the trainer ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint of step EVERY in time"
            time.sleep(0.05)
    finally:
        kill_group(proc)  # kill -9 of the trainer and its embedded daemon
    crashed = lines(run / "batches.jsonl")
    skip = (run / "batches.jsonl").stat().st_size

    finish(start(corpus, run), run)

    ref = {(b["step"], b["micro"]): b["rows"] for b in lines(reference / "batches.jsonl")}
    resumed = lines(run / "batches.jsonl", skip)
    events = lines(run / "events.jsonl")
    restores = [e for e in events if e["event"] == "restore"]
    assert restores[-1]["global_step"] >= EVERY and restores[-1]["from"].endswith(f"checkpoint-{restores[-1]['global_step']}")
    first = restores[-1]["global_step"]  # Trainer global step g resumes at sluice step g
    assert [(b["step"], b["micro"]) for b in resumed] == [(s, m) for s in range(first, STEPS) for m in range(4)]
    assert all(b["rows"] == ref[(b["step"], b["micro"])] for b in resumed), "a resumed batch differs"
    assert all(b["rows"] == ref[(b["step"], b["micro"])] for b in crashed), "a batch before the crash differs"
    a = torch.load(reference / "params.pt", weights_only=True)
    b = torch.load(run / "params.pt", weights_only=True)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"
