"""The post-run record, end to end: a real daemon serves a short run to real torch trainers (two replicas),
is killed -9 and restarted under them (they restore an older checkpoint's data state, so two steps are
served again), while `sluice top --record` samples it; `sluice report` then says what was served and
trained.

Specification (issue 26, part 5): the report's tokens served equal the daemons' own
``sluice_served_tokens_total`` (scraped from each daemon before it went away) and the trainers' count of
the tokens they received, in all and per replica; per source they equal the daemons'
``sluice_source_served_tokens_total``; the steps trained are the steps the trainers committed (not a
command line's ``--until-step``), the tokens trained those steps' tokens, the replayed tokens the two steps
served again; one restart, a fencing event, an ETTR in (0, 1]. The page renders in headless Chromium with
no console message (its Content Security Policy would report anything it blocked) and shows the key
figures in the rendered DOM.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from loaderd_support import Daemon, demo_corpus, scrape
from sluice import demo

pytestmark = pytest.mark.slow  # two daemons, torch, a browser

STEPS = 12  # steps 0..11
KILL_AFTER = 6  # the first daemon serves steps 0..5, then is killed -9
RESUME_AFTER = 3  # the trainers restore the data state after step 3: steps 4 and 5 are served again
RESTORED_GENERATION = 5  # the generation the resumed trainers fence with (a CheckpointManager's run record)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file) -> Path:
    """The demo's two-source corpus (code and docstrings, token units, concat: rows are never padded)."""
    return demo_corpus(tmp_path_factory.mktemp("record"), tokenizer_file, files=12, per_shard=200,
                       run_spec=demo.RUN_SPEC)


class Trainer(threading.Thread):
    """One replica's trainer: a tiny torch language model stepped once per global step, committing each
    step; counts the tokens it received and the loss tokens it trained on."""

    def __init__(self, d: Daemon, replica: int, end_step: int, state: dict | None, counts: dict) -> None:
        super().__init__(daemon=True)
        self.client = d.client(replica, 2, end_step=end_step)
        self.replica, self.state, self.counts = replica, state, counts
        self.saved: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        import torch

        torch.manual_seed(self.replica)
        model = torch.nn.Sequential(torch.nn.Embedding(1024, 16), torch.nn.Linear(16, 1024))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            c = self.client
            if self.state is not None:  # both ranks take the checkpoint writer's generation, then RESTORE:
                c.fence(RESTORED_GENERATION)  # the daemon's generation moves on, older readers are fenced
                c.reset(self.state)
            start = None if self.state is None else int(self.state["step"]) + 1
            for step, micros in c.steps(start):
                opt.zero_grad()
                for mb in micros:
                    ids, labels = torch.from_numpy(mb["input_ids"]).long(), torch.from_numpy(mb["labels"]).long()
                    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(),
                                                             ignore_index=-100)
                    loss.backward()
                    self.counts["tokens"][self.replica] += ids.numel()
                    self.counts["loss_tokens"] += int((labels != -100).sum())
                opt.step()
                c.commit(step)
                if step == RESUME_AFTER:
                    self.saved = c.state_dict_at(step)  # "the checkpoint" the second daemon's run restores
        except BaseException as exc:  # reported by finish()
            self.error = exc
        finally:
            self.client.close()

    def finish(self) -> None:
        self.join(180)
        assert not self.is_alive(), "the trainer did not finish"
        if self.error is not None:
            raise self.error


def served(d: Daemon) -> tuple[int, dict[str, int]]:
    """The daemon's own counters: sluice_served_tokens_total and sluice_source_served_tokens_total per source."""
    got = scrape(d.info["metrics_port"])
    per: dict[str, int] = {}
    for labels, v in got.get("sluice_source_served_tokens_total", {}).items():
        per[dict(labels)["source"]] = per.get(dict(labels)["source"], 0) + int(v)
    return int(sum(got["sluice_served_tokens_total"].values())), per


def recorded(samples: Path, port: int, want: int, timeout: float = 60, at_least: int = 3) -> None:
    """Wait (bounded) until `sluice top --record` wrote at least `at_least` samples of the daemon at `port`
    (what ETTR needs of each daemon, however fast a loaded machine ran the phase) and one that counts `want`
    tokens served: the record then holds everything that daemon served."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine, done = 0, False
        for line in samples.read_text().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a line being written
            if obj["url"].endswith(f":{port}/metrics"):
                mine += 1
                done = done or sum(v for n, _, v in obj["series"] if n == "sluice_served_tokens_total") >= want
        if done and mine >= at_least:
            return
        time.sleep(0.2)
    pytest.fail(f"no {at_least} samples of the daemon on port {port}, one counting {want} tokens served, "
                f"within {timeout} s")


def phase(d: Daemon, end_step: int, states: list, counts: dict) -> list[Trainer]:
    trainers = [Trainer(d, r, end_step, states[r], counts) for r in (0, 1)]
    for t in trainers:
        t.start()
    for t in trainers:
        t.finish()
    return trainers


def test_the_report_counts_what_was_served_and_trained_and_renders_in_chromium(corpus, tmp_path, sluice_cli):
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='sl-rec-')}/d.sock"  # the restarted daemon binds it again
    kw = dict(replicas=2, endpoint=endpoint, cache=corpus / "cache",
              extra=("--metrics-port", "0", "--log-level", "info", "--state-dir", str(tmp_path / "state")))
    counts = {"tokens": [0, 0], "loss_tokens": 0}
    samples = tmp_path / "samples.jsonl"
    samples.touch()
    first = Daemon(corpus, **kw).start()
    top = subprocess.Popen([sys.executable, "-m", "sluice.cli", "top", endpoint, "--interval", "0.3", "--record",
                            str(samples), "--width", "200"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    second = None
    try:
        trainers = phase(first, KILL_AFTER, [None, None], counts)
        by_daemon = [served(first)]
        recorded(samples, first.info["metrics_port"], by_daemon[0][0])
        first.kill9()
        second = Daemon(corpus, **kw).start()
        phase(second, STEPS, [t.saved for t in trainers], counts)
        by_daemon.append(served(second))
        recorded(samples, second.info["metrics_port"], by_daemon[1][0])
    finally:
        top.send_signal(signal.SIGINT)  # the way to leave the live view: exit 0
        _, err = top.communicate(timeout=30)
        if second is not None:
            second.stop()
        first.stop()
    assert top.returncode == 0, err.decode()[-2000:]

    ledger = sluice_cli("ledger", corpus / "manifest.json", corpus / "run.toml", "--until-step", str(STEPS - 1),
                        "--every", "3", "--json", "--cache", corpus / "cache")
    assert ledger.returncode == 0, ledger.stderr
    (tmp_path / "ledger.jsonl").write_text(ledger.stdout)
    page, record = tmp_path / "report.html", tmp_path / "record.json"
    rep = sluice_cli("report", tmp_path / "ledger.jsonl", "--metrics-log", samples, "--metrics-log", first.log,
                     "--metrics-log", second.log, "-o", page, "--json", record)
    assert rep.returncode == 0, rep.stderr
    rec = json.loads(record.read_text())

    # served: the daemons' own counters, the trainers' count, the record
    daemons_total = sum(total for total, _ in by_daemon)
    assert rec["served"]["tokens"] == daemons_total == sum(counts["tokens"])
    assert rec["served"]["per_replica"] == {"0": counts["tokens"][0], "1": counts["tokens"][1]}  # no padding
    per_source = {s: sum(per.get(s, 0) for _, per in by_daemon) for s in ("code", "docs")}
    assert rec["served"]["per_source"] == per_source and min(per_source.values()) > 0
    assert rec["served"]["padding_tokens"] == 0 and counts["loss_tokens"] <= daemons_total
    # trained: the committed steps, their tokens; the replayed steps 4 and 5
    tps = 16 * 64  # global_batch x seq_len
    assert rec["trained"]["steps"] == STEPS and rec["trained"]["tokens_per_step"] == tps
    assert rec["trained"]["tokens"] == STEPS * tps
    assert daemons_total == (STEPS + KILL_AFTER - RESUME_AFTER - 1) * tps
    assert rec["ettr"]["replayed_tokens"] == (KILL_AFTER - RESUME_AFTER - 1) * tps
    assert rec["restarts"] == 1 and rec["daemon_starts"] == 2 and rec["restores"] >= 2
    assert rec["fencing"]["generation_changes"] >= 1
    assert 0 < rec["ettr"]["value"] <= 1 and rec["duration_s"] > 0
    assert rec["trained"]["effective_tokens_per_s"] == pytest.approx(STEPS * tps / rec["duration_s"])
    assert rec["dataset_id"] == first.info["dataset_id"] and rec["runspec_digest"].startswith("b3:")
    assert rec["input_wait"]["micro_batches"] > 0 and rec["time_to_batch"]["p50_s"] is not None

    # the page, in a real browser
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    dom, console = render(chromium, page, tmp_path / "profile")
    assert console == [], console
    figure = dict(re.findall(r'<div data-figure="([\w-]+)"><dt>[^<]*</dt><dd>([^<]*)</dd>', dom))
    assert figure["served-tokens"] == f"{daemons_total:,}"
    assert figure["trained-steps"] == f"{STEPS:,}" and figure["trained-tokens"] == f"{STEPS * tps:,}"
    assert figure["restarts"] == "1" and figure["ettr"].endswith("%")
    assert dom.count('src="data:image/png;base64,') == 5  # every chart drawn, embedded


def render(chromium: str, page: Path, profile: Path) -> tuple[str, list[str]]:
    """(the DOM headless Chromium built from `page`, the console messages it logged)."""
    proc = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
                           "--v=0", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [x for x in proc.stderr.splitlines() if ":CONSOLE" in x]


def test_the_console_check_sees_what_a_page_logs_and_what_its_policy_blocks(tmp_path):
    """The check above can fail: a script's console.error, and a fetch the page's policy blocks, are seen."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    from sluice.observe.page import CSP

    bad = tmp_path / "bad.html"
    bad.write_text(f'<!DOCTYPE html><meta http-equiv="Content-Security-Policy" content="{CSP}">'
                   '<p>x</p><img src="http://127.0.0.1:9/x.png">')
    _, console = render(chromium, bad, tmp_path / "p1")
    assert any("violates the following Content Security Policy" in x for x in console), console
    bad.write_text('<!DOCTYPE html><p>x</p><script>console.error("boom")</script>')
    _, console = render(chromium, bad, tmp_path / "p2")
    assert any('"boom"' in x for x in console), console
