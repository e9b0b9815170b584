"""The views as a person sees them: `sluice top` in a real terminal (tmux,
captured pane) while a trainer consumes, and `sluice report` rendered by a real
browser (headless Chromium, screenshot checked).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loaderd_support import Daemon, build_corpus

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("views"), "jsonl.zst", tokenizer_file)


class Consumer(threading.Thread):
    """A trainer stand-in: reads one replica's micro-batches at a steady pace until stopped."""

    def __init__(self, daemon: Daemon, replica: int, replicas: int) -> None:
        super().__init__(daemon=True)
        self.client = daemon.client(replica, replicas)
        self.stop = threading.Event()
        self.batches = 0

    def run(self) -> None:
        for _ in self.client:
            self.batches += 1
            if self.stop.wait(0.02):
                break

    def close(self) -> None:
        self.stop.set()
        self.join(20)
        self.client.close()


def _pane(tmux: str, sock: str) -> str:
    return subprocess.run([tmux, "-L", sock, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                          timeout=10).stdout


def _terminal_env() -> dict[str, str]:
    """This environment without COLUMNS/LINES (a test worker may carry its own): top then sizes itself to the
    tmux window, as in a user's terminal, instead of an inherited 80 columns that truncate its URL column."""
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


def _wait_pane(tmux: str, sock: str, ok, what: str, timeout: float = 30) -> str:
    pane = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        pane = _pane(tmux, sock)
        if ok(pane):
            return pane
    pytest.fail(f"top never showed {what}:\n{pane}")


def _live_numbers(pane: str) -> bool:
    daemon_row = next((x for x in pane.splitlines() if "/metrics" in x), "")
    tokens = re.findall(r"│\s*([\d.]+k?)\s*│", daemon_row)
    return (bool(re.search(r"\br0\b", pane) and re.search(r"\br1\b", pane)) and bool(tokens)
            and tokens[0] != "0" and "retrying" not in pane)


def test_top_in_a_terminal_shows_both_replicas_live_numbers_and_rides_out_a_restart(corpus, tmp_path):
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed (.ci/run installs it)")
    sock = f"sluice-top-{os.getpid()}"  # a private tmux server: killing it touches nothing else
    endpoint = f"ipc://{tmp_path}/top.sock"
    kw = dict(replicas=2, cache=tmp_path / "cache", endpoint=endpoint, extra=("--metrics-port", "0"))
    d = Daemon(corpus, **kw).start()
    consumers = [Consumer(d, r, 2) for r in (0, 1)]
    try:
        for c in consumers:
            c.start()
        cmd = f"{sys.executable} -m sluice.cli top {endpoint} --interval 0.5 --timeout 1"
        subprocess.run([tmux, "-L", sock, "new-session", "-d", "-x", "200", "-y", "50", "-s", "top", cmd],
                       check=True, timeout=10, env={**_terminal_env(), "TERM": "xterm-256color"})
        pane = _wait_pane(tmux, sock, _live_numbers, "both replicas and a non-zero tokens/s")
        assert "tokens/s" in pane and "replicas" in pane and "code" in pane
        assert "100.0%" in pane  # realized and target share of the one source
        first_port = d.info["metrics_port"]
        d.kill9()
        pane = _wait_pane(tmux, sock, lambda p: "retrying" in p, "the lost daemon")
        assert endpoint in pane
        d = Daemon(corpus, **kw).start()  # same endpoint, another metrics port
        pane = _wait_pane(tmux, sock, _live_numbers, "the restarted daemon with live numbers")
        assert f":{d.info['metrics_port']}/metrics" in pane and f":{first_port}/metrics" not in pane
    finally:
        subprocess.run([tmux, "-L", sock, "kill-server"], timeout=10)
        for c in consumers:
            c.close()
        d.stop()


def test_report_renders_in_headless_chromium(corpus, tmp_path, sluice_cli):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    m, r = corpus / "manifest.json", corpus / "run.toml"
    led = sluice_cli("ledger", m, r, "--until-step", "20", "--every", "4", "--json")
    assert led.returncode == 0, led.stderr
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(led.stdout)
    samples = tmp_path / "samples.jsonl"
    with Daemon(corpus, cache=tmp_path / "cache", extra=("--metrics-port", "0", "--log-level", "info")) as d:
        c = Consumer(d, 0, 1)
        c.start()
        top = sluice_cli("top", d.endpoint, "--once", "--interval", "0.5", "--record", samples)
        c.close()
        assert top.returncode == 0, top.stderr
    html = tmp_path / "report.html"
    rep = sluice_cli("report", ledger, "--metrics-log", samples, "--metrics-log", d.log, "-o", html)
    assert rep.returncode == 0, rep.stderr
    page = html.read_text()
    assert page.count('src="data:image/png;base64,') == 5  # five charts, embedded
    assert not re.search(r'(src|href)="(https?:|file:|/)', page)  # self-contained
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1000,2400", html.as_uri()], capture_output=True, timeout=60, check=True)
    from PIL import Image, ImageStat

    img = Image.open(shot).convert("RGB")
    assert img.size == (1000, 2400)
    top_half = img.crop((0, 0, 1000, 1600))  # the charts: far from a blank page
    stat = ImageStat.Stat(top_half)
    assert max(stat.stddev) > 20, "the screenshot is (nearly) blank"
    colors = top_half.convert("P", palette=Image.Palette.ADAPTIVE, colors=32).getcolors()
    assert colors is not None and len(colors) >= 6  # text, axes and colored series, not one flat color


def test_report_from_a_run_folder_and_bad_input_errors(corpus, tmp_path, sluice_cli):
    html = tmp_path / "r.html"
    rep = sluice_cli("report", corpus, "--until-step", "6", "--every", "3", "-o", html)
    assert rep.returncode == 0, rep.stderr
    assert "ledger up to step 6" in html.read_text()
    bad = tmp_path / "bad.jsonl"
    line = {"until_step": 1, "unit": "documents", "policy": "quota", "ended": None, "sources": [
        {"source": "a", "docs": 1, "tokens": 9, "loss_tokens": 8, "target_share": "1", "realized_share": "1.000000"}]}
    bad.write_text(json.dumps(line) + "\n{not json\n")
    out = sluice_cli("report", bad, "-o", html)
    assert out.returncode == 2 and f"{bad}, line 2: not JSON" in out.stderr and "Traceback" not in out.stderr
    bad.write_text(json.dumps(line) + "\n" + json.dumps({**line, "sources": [{"source": "a"}]}) + "\n")
    out = sluice_cli("report", bad, "-o", html)
    assert out.returncode == 2 and f"{bad}, line 2: not a ledger line" in out.stderr
    out = sluice_cli("report", corpus, "-o", html)
    assert out.returncode == 2 and "--until-step" in out.stderr
    out = sluice_cli("report", Path(tmp_path / "nothing.jsonl"), "-o", html)
    assert out.returncode == 2 and "nothing.jsonl: cannot read" in out.stderr
