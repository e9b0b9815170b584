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
from support import skip_unless_installed

pytestmark = pytest.mark.slow  # three trainer processes (transformers' import alone takes seconds)

skip_unless_installed("transformers", "transformers is not installed (pip install 'sluice[hf]')")
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


def test_settings_that_would_skip_or_split_data_are_refused_by_name(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from sluice.errors import StateError
    from sluice.integrations.hf import SluiceCallback

    cb = SluiceCallback(client=None)  # refused before the client is touched
    for setting, message in (({"ignore_data_skip": False}, "ignore_data_skip is False; sluice needs True"),
                             ({"ignore_data_skip": True, "dataloader_num_workers": 2},
                              "dataloader_num_workers is 2; sluice needs 0")):
        args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", **setting)
        with pytest.raises(StateError, match=message):
            cb.on_train_begin(args, TrainerState(), TrainerControl())


def test_a_checkpoint_without_data_state_is_passed_over_or_refused(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from sluice.errors import StateError
    from sluice.integrations.hf import SluiceCallback, last_checkpoint, write_state

    assert last_checkpoint(tmp_path / "none") is None
    for g, files in ((4, ("trainer_state.json", "sluice_data.json")), (8, ("sluice_data.json",)),
                     (6, ("trainer_state.json",))):  # 8: cut short by a crash; 6: not saved with SluiceCallback
        folder = tmp_path / f"checkpoint-{g}"
        folder.mkdir()
        for name in files:
            (write_state(folder, {"step": g - 1}) if name == "sluice_data.json" else (folder / name).write_text("{}"))
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", ignore_data_skip=True)
    with pytest.raises(StateError, match=r"checkpoint-6/sluice_data.json: no sluice data state"):
        SluiceCallback(client=None).on_train_begin(args, TrainerState(global_step=6), TrainerControl())
    with pytest.raises(StateError, match=r"data state after step 3, but the Trainer resumes after global step 5"):
        (tmp_path / "checkpoint-5").mkdir()
        write_state(tmp_path / "checkpoint-5", {"step": 3})
        SluiceCallback(client=None).on_train_begin(args, TrainerState(global_step=5), TrainerControl())
