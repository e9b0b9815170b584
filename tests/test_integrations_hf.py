"""transformers.Trainer on sluice: kill -9 after a checkpoint, resume_from_checkpoint, bit for bit.

Real processes: examples/hf_trainer.py (a 1-layer GPT-2 from a config, an
embedded loaderd) trains STEPS optimizer steps uninterrupted; the same run is
started again, killed with SIGKILL (trainer and its daemon: the process group)
after the checkpoint of global step EVERY, and started once more, which
resumes from that checkpoint. Every micro-batch the resumed run trains equals
the uninterrupted run's, and so do the final parameters, bit for bit.

Two ranks (``--nproc 2``: `SluiceTrainer`, DDP over gloo): per step the
ranks' rows are the one-process run's global batch, and the same kill -9 of
the whole job (both ranks and the daemon) and restart resume both ranks'
micro-batches and the final parameters bit for bit against the
uninterrupted two-rank run.
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
    EVERY, MICROS, RANKS, STEPS, assert_ranks_resumed_exactly, assert_ranks_split_the_global_batch,
    assert_resumed_exactly, finish, kill_when, lines, rank_batches, start, trained_past,
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



def test_with_several_ranks_the_dataloader_is_the_ranks_own_or_refused(tmp_path):
    from types import SimpleNamespace

    from accelerate.data_loader import DataLoaderDispatcher
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerControl, TrainerState, TrainingArguments

    from sluice.errors import StateError
    from sluice.integrations.hf import SluiceCallback, SluiceTrainer, collate
    from sluice.integrations.torch_data import SluiceIterable

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=1,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", ignore_data_skip=True,
                             per_device_train_batch_size=3, remove_unused_columns=False, max_steps=1)
    data = SluiceIterable(client=None, rows=True)
    loader = SluiceTrainer(model=model, args=args, train_dataset=data, data_collator=collate).get_train_dataloader()
    # a plain DataLoader, not accelerate's: nothing dispatches or re-shards the rank's rows
    assert type(loader) is DataLoader and loader.dataset is data and loader.batch_size == 3
    with pytest.raises(StateError, match="train_dataset is a list, not a SluiceIterable"):
        SluiceTrainer(model=model, args=args, train_dataset=[{}], data_collator=collate).get_train_dataloader()
    two_ranks = SimpleNamespace(ignore_data_skip=True, dataloader_num_workers=0, world_size=2)  # as torchrun's
    with pytest.raises(StateError, match=r"2 ranks, and the train dataloader is accelerate.data_loader.DataLoaderDispatcher: .*"
                                         r"use sluice.integrations.hf.SluiceTrainer"):
        SluiceCallback(client=None).on_train_begin(two_ranks, TrainerState(), TrainerControl(),
                                                   train_dataloader=DataLoaderDispatcher(data))

def test_a_batch_split_off_the_run_spec_fails_at_train_begin_naming_both_sides(corpus, tmp_path):
    """gradient_accumulation_steps left at 1 (the run spec: global batch 8 in micro-batches of 2) fails before the
    first step, naming every factor; before, it trained 4 steps and failed at the first save ("step 3 is not
    among the last 1024 steps it completed")."""
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerControl, TrainerState, TrainingArguments

    from sluice.client import embedded_client
    from sluice.errors import StateError
    from sluice.integrations.hf import SluiceCallback, trainer_kwargs

    with embedded_client(corpus / "manifest.json", corpus / "run.toml", cache_dir=tmp_path / "cache",
                         end_step=STEPS) as client:
        args = TrainingArguments(str(tmp_path / "out"), max_steps=STEPS, save_steps=EVERY, ignore_data_skip=True,
                                 dataloader_num_workers=0, remove_unused_columns=False, use_cpu=True,
                                 report_to="none", per_device_train_batch_size=2, gradient_accumulation_steps=1)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=8, n_layer=1, n_head=1))
        trainer = Trainer(model=model, args=args, callbacks=[SluiceCallback(client)], **trainer_kwargs(client))
        with pytest.raises(StateError, match=r"^transformers.Trainer: per_device_train_batch_size 2 x "
                           r"gradient_accumulation_steps 1 x world size 1 = 2 sequences per optimizer step, but the "
                           r"run spec's global_batch is 8 \(micro_batch 2 x 4 micro-batches per step x 1 replica\); "
                           r".*set gradient_accumulation_steps = 4"):
            trainer.train()
        assert trainer.state.global_step == 0 and not list((tmp_path / "out").glob("checkpoint-*"))
        # the right split over two ranks whose clients are replica 0 of 1: each rank would train the whole step
        two_ranks = SimpleNamespace(ignore_data_skip=True, dataloader_num_workers=0, world_size=2,
                                    per_device_train_batch_size=2, gradient_accumulation_steps=2)
        with pytest.raises(StateError, match=r"x world size 2 = 8 sequences .* global_batch is 8 \(micro_batch 2 x 4 "
                           r"micro-batches per step x 1 replica\); .*run 1 rank, each with its own replica"):
            SluiceCallback(client).on_train_begin(two_ranks, TrainerState(), TrainerControl())
        # one process over two GPUs (torch DataParallel): the Trainer draws per_device rows for each
        data_parallel = SimpleNamespace(ignore_data_skip=True, dataloader_num_workers=0, world_size=1, n_gpu=2,
                                        per_device_train_batch_size=2, gradient_accumulation_steps=4)
        with pytest.raises(StateError, match=r"per_device_train_batch_size 2 x n_gpu \(DataParallel\) 2 x "
                           r"gradient_accumulation_steps 4 x world size 1 = 16 sequences .* set "
                           r"gradient_accumulation_steps = 2 \(.* in batches of 4\)"):
            SluiceCallback(client).on_train_begin(data_parallel, TrainerState(), TrainerControl())


# ----------------------------------------------------------------------------- two ranks (SluiceTrainer, gloo)
@pytest.fixture(scope="module")
def reference_ddp(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hf-ddp-reference")
    finish(start(SCRIPT, corpus, run, "--nproc", str(RANKS)), run)
    return run


def test_two_ranks_each_train_their_replicas_micro_batches(reference, reference_ddp):
    assert_ranks_split_the_global_batch(reference, reference_ddp)
    state = json.loads((reference_ddp / "ckpt" / f"checkpoint-{EVERY}" / "sluice_data.json").read_text())
    assert state["step"] == EVERY - 1 and sorted(state["lanes"], key=int) == ["0", "1", "2", "3"]  # both replicas'


def test_two_ranks_kill9_after_a_checkpoint_resume_bit_for_bit(corpus, reference_ddp, tmp_path):
    run = tmp_path / "run"
    done = run / "ckpt" / f"checkpoint-{EVERY}" / "trainer_state.json"

    def past() -> bool:
        return done.is_file() and all(any(s > EVERY for s, _, _ in rank_batches(run, r)) for r in range(RANKS))

    kill_when(start(SCRIPT, corpus, run, "--nproc", str(RANKS)), past)  # launcher, both ranks, daemon: one group
    skips = [(run / f"batches-r{r}.jsonl").stat().st_size for r in range(RANKS)]

    finish(start(SCRIPT, corpus, run, "--nproc", str(RANKS)), run)

    restores = [e for e in lines(run / "events.jsonl") if e["event"] == "restore"][-RANKS:]
    assert sorted(e["rank"] for e in restores) == list(range(RANKS))
    first = restores[0]["global_step"]
    assert EVERY <= first < STEPS and all(e["global_step"] == first for e in restores)
    assert all(e["from"].endswith(f"checkpoint-{first}") for e in restores)
    assert_ranks_resumed_exactly(reference_ddp, run, skips, first)
