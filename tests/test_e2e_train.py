"""End-to-end proof: train a real LM from loaderd, crash anywhere, resume bit for bit.

Everything is real: a corpus frozen by `sluice manifest freeze`, `loaderd`
processes, trainer processes running examples/train_lm.py (a causal
transformer in plain torch) as two data-parallel replicas over gloo, kill -9.

* reference: an uninterrupted run of STEPS steps with 2 replicas under
  torchrun, checkpointing every EVERY steps;
* crash: the same run killed -9 inside a checkpoint write (shards and manifest
  staged, nothing published), restarted, its daemon killed -9 and restarted
  under the living trainers (each rank reconnects: see the test), the
  trainers killed -9 again at a seeded random step, restarted: every step's
  global batch and loss and the final parameters equal the reference bit for
  bit;
* resize: 2 replicas stop at a checkpoint, 1 replica resumes under
  `exact-elastic`: the same global batches every step, the loss curve equal up
  to the summation order of gradients (observed values are printed);
* the single-process story of `make demo` (`sluice.demo_train.run`).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of real training: the full tier only

from loaderd_support import Daemon, demo_corpus
from sluice import demo, demo_train

STEPS = 16
EVERY = 4
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
TIMEOUT = 240.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file) -> Path:
    """The demo's two-source corpus (jsonl.zst code, parquet docstrings), frozen; seq_len 64."""
    return demo_corpus(tmp_path_factory.mktemp("e2e"), tokenizer_file, files=40, per_shard=300,
                       run_spec=demo.RUN_SPEC.replace('resume = "exact"', 'resume = "exact-elastic"'))


def ipc_endpoint() -> str:
    """A fixed ipc path (short: sun_path holds ~107 bytes) that a restarted daemon binds again."""
    return f"ipc://{tempfile.mkdtemp(prefix='sl-e2e-')}/d.sock"


def daemon(corpus: Path, endpoint: str, replicas: int, state: Path) -> Daemon:
    return Daemon(corpus, replicas=replicas, endpoint=endpoint, cache=corpus / "cache",
                  extra=("--state-dir", str(state))).start()


def train_args(corpus: Path, endpoint: str, run: Path, *extra: str) -> list[str]:
    return [str(TRAIN), "--manifest", str(corpus / "manifest.json"), "--runspec", str(corpus / "run.toml"),
            "--endpoint", endpoint, "--ckpt", str(run / "ckpt"), "--out", str(run / "out"),
            "--steps", str(STEPS), "--every", str(EVERY), *extra]


def json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by kill -9
            pass
    return out


class Ranks:
    """`world` trainer processes joined by a file:// rendezvous, as torchrun would start them."""

    def __init__(self, corpus: Path, endpoint: str, run: Path, world: int, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        import os

        run.mkdir(parents=True, exist_ok=True)
        rdzv = run / f"rdzv-{time.time_ns()}"
        self.logs = [run / f"rank{r}-{time.time_ns()}.log" for r in range(world)]
        self.procs = []
        for r in range(world):
            full_env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), **(env or {})}
            with open(self.logs[r], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *train_args(corpus, endpoint, run, "--init", f"file://{rdzv}", *extra)],
                    stdout=log, stderr=subprocess.STDOUT, env=full_env))

    def wait(self, timeout: float = TIMEOUT) -> None:
        try:
            for p, log in zip(self.procs, self.logs):
                rc = p.wait(timeout)
                assert rc == 0, f"trainer exited {rc}:\n{log.read_text()[-4000:]}"
        finally:
            self.kill9()

    def kill9(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # SIGKILL
            p.wait()

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """Uninterrupted 2-replica run under torchrun; returns its folder (out/, ckpt/)."""
    run = tmp_path_factory.mktemp("reference")
    endpoint = ipc_endpoint()
    d = daemon(corpus, endpoint, 2, run / "loaderd-state")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             *train_args(corpus, endpoint, run)],
            capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        d.stop()
    return run


def test_reference_run_trains_two_identical_replicas(reference):
    final, earlier = demo_train.read_steps(reference / "out")
    assert sorted(final) == list(range(STEPS)) and earlier == []
    assert all(r.replicas == 2 and len(r.rows) == 16 for r in final.values())  # global batch 16 rows
    losses = [final[s].loss for s in range(STEPS)]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    # data-parallel replicas end with the same parameters, bit for bit
    problems, _ = demo_train.compare_params(reference / "out" / "params-r0.pt", reference / "out" / "params-r1.pt")
    assert problems == []
    # the checkpoints hold one data shard per rank, the model once
    latest = (reference / "ckpt" / "latest").read_text().strip()
    man = json.loads((reference / "ckpt" / "ckpt" / latest / "manifest.json").read_text())
    assert {"data-r0.json", "data-r1.json", "model.pt", "optim.pt"} <= {s["file"] for s in man["shards"]}
    assert man["step"] == STEPS - 1
    # data state is keyed by lane: replica r of 2 holds lanes [4r, 4r + 4) of 8
    assert [lanes_in(reference / "ckpt", latest, f"data-r{r}.json") for r in (0, 1)] == [
        ["0", "1", "2", "3"], ["4", "5", "6", "7"]]


def lanes_in(ckpt: Path, name: str, shard: str) -> list[str]:
    return sorted(json.loads((ckpt / "ckpt" / name / shard).read_text())["lanes"], key=int)


def test_crash_anywhere_resumes_bit_for_bit(corpus, reference, tmp_path):
    rng = random.Random(1729)
    pause_step = rng.choice(range(2 * EVERY, STEPS - EVERY, EVERY))  # a checkpoint step, not the first
    daemon_kill = rng.randrange(pause_step - EVERY + 2, pause_step + 2)
    trainer_kill = rng.randrange(daemon_kill + 4, STEPS - 2)  # past the steps prefetched before the kill
    run = tmp_path / "crash"
    endpoint = ipc_endpoint()
    d = daemon(corpus, endpoint, 2, run / "loaderd-state")
    ranks = None
    try:
        # 1. kill -9 in the middle of the checkpoint write of `pause_step`
        marker = run / "paused.json"
        ranks = Ranks(corpus, endpoint, run, 2, env={"SLUICE_FAULT_PAUSE_PUBLISH": f"{pause_step}:{marker}"})
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            assert all(p.poll() is None for p in ranks.procs), ranks.output()[-4000:]
            assert time.monotonic() < deadline, "the trainer never reached the paused save"
            time.sleep(0.05)
        ranks.kill9()
        staged = [p.name for p in (run / "ckpt" / "staging").iterdir()]
        assert f"g1-s{pause_step}" in staged  # staged, complete with its manifest ...
        assert (run / "ckpt" / "staging" / f"g1-s{pause_step}" / "manifest.json").exists()
        latest = (run / "ckpt" / "latest").read_text().strip()
        assert latest == f"s{pause_step - EVERY:012d}-g000001"  # ... but never published

        # 2. restart; kill -9 the daemon under the living trainers; then kill -9 the trainers.
        # Both ranks pause once they logged `daemon_kill`, so what they hold at the kill is
        # known: the GETs in flight (credits = 2 steps) reach at most into step daemon_kill + 2.
        # A rank whose batches were all delivered before the kill never needs the restarted
        # daemon (a kill that lands late, behind a fast rank 0, made "each rank reconnected"
        # fail once in six runs): the pause makes both ranks need it before trainer_kill.
        pause = run / "pause"
        pause.mkdir()
        ranks = Ranks(corpus, endpoint, run, 2, env={"SLUICE_FAULT_PAUSE_AFTER_STEP": f"{daemon_kill}:{pause}"})
        deadline = time.monotonic() + TIMEOUT
        while not all((pause / f"paused-r{r}").exists() for r in (0, 1)):
            assert all(p.poll() is None for p in ranks.procs), ranks.output()[-4000:]
            assert time.monotonic() < deadline, f"the trainers never paused after step {daemon_kill}"
            time.sleep(0.05)
        d.kill9()
        d.stop()
        (pause / "go").touch()  # the trainers go on against a dead daemon, then a restarted one
        d = daemon(corpus, endpoint, 2, run / "loaderd-state")  # same endpoint, same fencing state
        demo_train.wait_for_step(run / "out", trainer_kill, ranks.procs, TIMEOUT, min_generation=2)
        ranks.kill9()

        # 3. restart and finish
        ranks = Ranks(corpus, endpoint, run, 2)
        ranks.wait()
    finally:
        if ranks is not None:
            ranks.kill9()  # no trainer outlives a failed assertion
        d.stop()

    restores = [e for e in demo_train.read_events(run / "out") if e["event"] == "restore"]
    assert [(e["generation"], e["restored"]) for e in restores[:2]] == [
        (1, None), (2, f"s{pause_step - EVERY:012d}-g000001")]  # the paused step was never visible
    assert len(restores) == 3 and restores[2]["generation"] == 3
    final, earlier = demo_train.read_steps(run / "out")
    # the daemon restart was absorbed by the clients: no trainer restart, and each rank, which
    # held at most up to step daemon_kill + 2 at the kill, reconnected before trainer_kill
    assert trainer_kill >= daemon_kill + 3
    reconnected = {x["rank"] for r in (0, 1) for x in json_lines(run / "out" / f"steps-r{r}.jsonl")
                   if x.get("generation") == 2 and x.get("reconnects", 0) >= 1}
    assert reconnected == {0, 1}
    assert earlier, "some steps were trained twice (after the kills), and must match too"
    ref, _ = demo_train.read_steps(reference / "out")
    assert demo_train.compare_streams(ref, final, STEPS, earlier=earlier) == []
    for r in (0, 1):
        problems, _ = demo_train.compare_params(reference / "out" / f"params-r{r}.pt", run / "out" / f"params-r{r}.pt")
        assert problems == [], problems


def test_resize_two_replicas_to_one_keeps_the_global_batches(corpus, reference, tmp_path):
    stop = 2 * EVERY
    run = tmp_path / "resize"
    endpoint = ipc_endpoint()
    d = daemon(corpus, endpoint, 2, run / "loaderd-state")
    try:
        Ranks(corpus, endpoint, run, 2, "--stop-after", str(stop)).wait()
    finally:
        d.stop()
    d = daemon(corpus, ipc_endpoint(), 1, run / "loaderd-state")
    try:
        Ranks(corpus, d.endpoint, run, 1).wait()
    finally:
        d.stop()

    ref, _ = demo_train.read_steps(reference / "out")
    final, earlier = demo_train.read_steps(run / "out")
    assert earlier == []
    assert [final[s].replicas for s in range(STEPS)] == [2] * (stop + 1) + [1] * (STEPS - stop - 1)
    # the same global batch every step, whatever the number of replicas ...
    assert all(final[s].rows == ref[s].rows for s in range(STEPS))
    # ... so the same loss curve: bitwise while R = 2, up to summation order after the resize
    assert all(final[s].loss == ref[s].loss for s in range(stop + 1))
    assert demo_train.compare_streams(ref, final, STEPS, loss_rtol=1e-4) == []
    # the one replica restored all 8 lanes from the two ranks' shards, and now saves them in one
    latest = (run / "ckpt" / "latest").read_text().strip()
    assert lanes_in(run / "ckpt", latest, "data.json") == [str(lane) for lane in range(8)]
    rel = max(abs(final[s].loss - ref[s].loss) / abs(ref[s].loss) for s in range(STEPS))
    problems, worst = demo_train.compare_params(reference / "out" / "params-r0.pt", run / "out" / "params-r0.pt")
    print(f"resize 2->1 at step {stop}: max relative loss difference {rel:.3g}; parameters "
          f"{'bitwise equal' if not problems else f'differ in {len(problems)} tensors, max |diff| {worst:.3g}'}")
    assert worst < 1e-3


def test_demo_story_trains_crashes_resumes_and_verifies(corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    for name in ("manifest.json", "tokenizer.json"):
        shutil.copy(corpus / name, out / name)
    shutil.copytree(corpus / "shards", out / "shards")
    (out / "run.toml").write_text(demo.RUN_SPEC)  # the demo's own run spec: resume = "exact"
    assert demo_train.run(out, steps=12, every=EVERY) == 0
    text = capsys.readouterr().out
    assert "killed (exit -9)" in text and "final parameters: bitwise equal" in text
    assert "restored s" in text  # the resumed trainer restored a checkpoint


def test_verification_detects_a_different_stream_and_different_parameters(reference, tmp_path):
    import torch

    ref, _ = demo_train.read_steps(reference / "out")
    tampered = dict(ref)
    tampered[3] = demo_train.StepRecord(3, ref[3].generation, 2, ref[3].loss, ref[3].rows[1:] + ref[3].rows[:1])
    tampered[5] = demo_train.StepRecord(5, ref[5].generation, 2, ref[5].loss * (1 + 1e-7), ref[5].rows)
    problems = demo_train.compare_streams(ref, tampered, STEPS)
    assert len(problems) == 2 and "step 3: global batch differs" in problems[0] and "step 5: loss" in problems[1]
    assert demo_train.compare_streams(ref, {s: r for s, r in ref.items() if s != 7}, STEPS) == [
        "step 7: missing from the compared run"]
    params = torch.load(reference / "out" / "params-r0.pt", weights_only=True)
    name = sorted(params)[0]
    params[name].view(-1)[0] = torch.nextafter(params[name].view(-1)[0], torch.tensor(1.0))  # one ulp
    torch.save(params, tmp_path / "p.pt")
    problems, worst = demo_train.compare_params(reference / "out" / "params-r0.pt", tmp_path / "p.pt")
    assert len(problems) == 1 and name in problems[0] and 0 < worst < 1e-6


def test_the_example_says_in_one_line_when_no_daemon_listens_at_its_endpoint(corpus, tmp_path):
    """A trainer started before its node's loaderd (or with a wrong --endpoint): one line naming the
    endpoint, exit 2, no traceback."""
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    proc = subprocess.run([sys.executable, str(TRAIN), "--manifest", str(corpus / "manifest.json"),
                           "--runspec", str(corpus / "run.toml"), "--endpoint", endpoint, "--ckpt", str(tmp_path / "ckpt"),
                           "--out", str(tmp_path / "out"), "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"train_lm: error: no loaderd answered at {endpoint}")
    assert "Traceback" not in proc.stderr
