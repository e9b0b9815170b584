"""Lightning on sluice: kill -9 after a checkpoint, fit(ckpt_path=last.ckpt), bit for bit.

Real processes: examples/lightning_train.py (a 1-layer GPT-2 from a config,
an embedded loaderd) trains STEPS optimizer steps uninterrupted; the same run
is started again, killed with SIGKILL (trainer and its daemon: the process
group) after the checkpoint of global step EVERY, and started once more, which
resumes from last.ckpt. Every micro-batch the resumed run trains equals the
uninterrupted run's, and so do the final parameters, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import skip_unless_installed

pytestmark = pytest.mark.slow  # three trainer processes

skip_unless_installed("lightning", "lightning is not installed (pip install 'sluice[lightning]')")
skip_unless_installed("transformers", "the example model is transformers' GPT-2 (pip install 'sluice[hf]')")
torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")

from integrations_support import (  # noqa: E402
    EVERY, MICROS, RANKS, STEPS, assert_ranks_resumed_exactly, assert_ranks_split_the_global_batch,
    assert_resumed_exactly, finish, kill_when, lines, rank_batches, start, trained_past,
)
from loaderd_support import build_corpus  # noqa: E402

SCRIPT = "lightning_train.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("integ-pl"), "jsonl.zst", tokenizer_file, docs=160)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pl-reference")
    finish(start(SCRIPT, corpus, run), run)
    return run


def ckpt_of(path: Path) -> dict:
    return torch.load(path, weights_only=False, map_location="cpu")  # this test's own Lightning checkpoint


def test_uninterrupted_run_checkpoints_the_data_state(reference):
    batches = lines(reference / "batches.jsonl")
    assert [(b["step"], b["micro"]) for b in batches] == [(s, m) for s in range(STEPS) for m in range(MICROS)]
    for g in (EVERY, STEPS):
        ck = ckpt_of(reference / "ckpt" / f"step={g}.ckpt")
        assert ck["global_step"] == g
        state = ck["SluiceDataModule"]["sluice_data"]
        assert state["kind"] == "sluice.data-state" and state["step"] == g - 1


def test_kill9_after_a_checkpoint_resumes_bit_for_bit(corpus, reference, tmp_path):
    run = tmp_path / "run"
    saved, last = run / "ckpt" / f"step={EVERY}.ckpt", run / "ckpt" / "last.ckpt"
    kill_when(start(SCRIPT, corpus, run), lambda: saved.is_file() and last.exists() and trained_past(run, EVERY))
    crashed = lines(run / "batches.jsonl")
    skip = (run / "batches.jsonl").stat().st_size
    first = ckpt_of(last)["global_step"]  # what the restart resumes from
    assert EVERY <= first < STEPS

    finish(start(SCRIPT, corpus, run), run)

    assert_resumed_exactly(reference, run, crashed, skip, first)


def test_accumulation_and_checkpoints_without_data_state_are_refused():
    import lightning.pytorch as pl

    from sluice.errors import StateError
    from sluice.integrations.lightning import SluiceDataModule

    dm = SluiceDataModule(client=None)  # refused before the client is touched
    dm.trainer = pl.Trainer(accelerator="cpu", accumulate_grad_batches=4, logger=False, enable_progress_bar=False)
    with pytest.raises(StateError, match=r"accumulate_grad_batches=4\): SluiceDataModule needs 1"):
        dm.train_dataloader()
    with pytest.raises(StateError, match="has no 'sluice_data'"):
        dm.load_state_dict({})


def test_one_rank_reading_one_replica_of_two_fails_at_train_begin_naming_both_sides(corpus, tmp_path):
    """A one-process fit over a client of replica 0 of 2 would train half of every global step (4 of 8
    sequences): refused before the first step, naming micro batch, accumulation, world size and global batch."""
    import lightning.pytorch as pl

    from sluice.client import embedded_client
    from sluice.errors import StateError
    from sluice.integrations.lightning import SluiceDataModule

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.w(torch.ones(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with embedded_client(corpus / "manifest.json", corpus / "run.toml", cache_dir=tmp_path / "cache", replica=0,
                         replicas=2, end_step=2) as client:
        module = Tiny()
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, enable_model_summary=False)
        with pytest.raises(StateError, match=r"^Lightning: micro_batch 2 x micro-batches per batch 2 x "
                           r"accumulate_grad_batches 1 x world size 1 = 4 sequences per optimizer step, but the run "
                           r"spec's global_batch is 8 \(micro_batch 2 x 2 micro-batches per step x 2 replicas\); "
                           r".*run 2 ranks, each with its own replica"):
            trainer.fit(module, datamodule=SluiceDataModule(client))
        assert trainer.global_step == 0


# ----------------------------------------------------------------------------- two ranks (strategy="ddp")
@pytest.fixture(scope="module")
def reference_ddp(corpus, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pl-ddp-reference")
    finish(start(SCRIPT, corpus, run, "--devices", str(RANKS)), run)
    return run


def test_two_ranks_each_train_their_replicas_micro_batches(reference, reference_ddp):
    assert_ranks_split_the_global_batch(reference, reference_ddp)
    state = ckpt_of(reference_ddp / "ckpt" / f"step={EVERY}.ckpt")["SluiceDataModule"]["sluice_data"]
    assert state["step"] == EVERY - 1 and sorted(state["lanes"], key=int) == ["0", "1", "2", "3"]  # both replicas'


def test_two_ranks_kill9_after_a_checkpoint_resume_bit_for_bit(corpus, reference_ddp, tmp_path):
    run = tmp_path / "run"
    saved, last = run / "ckpt" / f"step={EVERY}.ckpt", run / "ckpt" / "last.ckpt"

    def past() -> bool:
        return saved.is_file() and last.exists() and any(s > EVERY for s, _, _ in rank_batches(run, 1))

    kill_when(start(SCRIPT, corpus, run, "--devices", str(RANKS)), past)
    first = ckpt_of(last)["global_step"]
    assert EVERY <= first < STEPS
    skips = [(run / f"batches-r{r}.jsonl").stat().st_size for r in range(RANKS)]

    finish(start(SCRIPT, corpus, run, "--devices", str(RANKS)), run)

    assert_ranks_resumed_exactly(reference_ddp, run, skips, first)
