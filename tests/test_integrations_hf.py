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
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three trainer processes (transformers' import alone takes seconds)

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'sluice[hf]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")

from integrations_support import (  # noqa: E402
    EVERY, MICROS, STEPS, assert_resumed_exactly, finish, kill_when, lines, start, trained_past,
)
from loaderd_support import build_corpus  # noqa: E402

SCRIPT = "hf_trainer.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    # seq_len 64, 4 lanes, global batch 8 in micro-batches of 2: 4 micro-batches per optimizer step
    return build_corpus(tmp_path_factory.mktemp("integ-hf"), "jsonl.zst", tokenizer_file, docs=160)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hf-reference")
    finish(start(SCRIPT, corpus, run), run)
    return run


def test_uninterrupted_run_checkpoints_the_data_state(reference):
    batches = lines(reference / "batches.jsonl")
    assert [(b["step"], b["micro"]) for b in batches] == [(s, m) for s in range(STEPS) for m in range(MICROS)]
    for g in (EVERY, STEPS):
        folder = reference / "ckpt" / f"checkpoint-{g}"
        state = json.loads((folder / "sluice_data.json").read_text())
        assert state["kind"] == "sluice.data-state" and state["step"] == g - 1
        assert (folder / "trainer_state.json").is_file()


def test_kill9_after_a_checkpoint_resumes_bit_for_bit(corpus, reference, tmp_path):
    run = tmp_path / "run"
    done = run / "ckpt" / f"checkpoint-{EVERY}" / "trainer_state.json"
    kill_when(start(SCRIPT, corpus, run), lambda: done.is_file() and trained_past(run, EVERY))
    crashed = lines(run / "batches.jsonl")
    skip = (run / "batches.jsonl").stat().st_size

    finish(start(SCRIPT, corpus, run), run)

    restores = [e for e in lines(run / "events.jsonl") if e["event"] == "restore"]
    first = restores[-1]["global_step"]  # Trainer global step g resumes at sluice step g
    assert EVERY <= first < STEPS and restores[-1]["from"].endswith(f"checkpoint-{first}")
    assert_resumed_exactly(reference, run, crashed, skip, first)
