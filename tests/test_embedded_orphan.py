"""An embedded daemon dies with its trainer: kill -9 of the trainer alone leaves no daemon behind.

Real processes: a trainer (python -c) opens `embedded_client`, takes a few
micro-batches and idles; the test kills it with SIGKILL (the trainer only,
not its process group, as the OOM killer would) and waits up to 2 s for the
daemon and every process under it to be gone, then runs `sluice cache
verify` on the daemon's node cache. Started from the main thread, the daemon
has the parent-death signal and the pipe; started from a thread that has
ended before the kill, it has the pipe only (the parent-death signal would
have fired at that thread's end, so the trainer does not ask for it), and
it must still serve after that thread's end.
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
from loaderd_support import build_corpus

from sluice.client.embedded import first_line

pytestmark = pytest.mark.slow  # a trainer process and its daemon per case

TRAINER = r"""
import json, sys, threading
from sluice.client import embedded_client
manifest, runspec, cache, where = sys.argv[1:5]
held = {}
def start():
    held["client"] = embedded_client(manifest, runspec, cache_dir=cache, as_numpy=True)
if where == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()  # the starting thread has ended: the daemon must still serve
else:
    start()
client = held["client"]
it = iter(client)
for _ in range(6):
    next(it)
print(json.dumps({"daemon": client.daemon.proc.pid}), flush=True)
threading.Event().wait()  # idle until killed
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file) -> Path:
    return build_corpus(tmp_path_factory.mktemp("orphan"), "jsonl", tokenizer_file, docs=120)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper that may never come in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _descendants(pid: int) -> set[int]:
    """`pid` and every process under it, from /proc (ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, ()))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_kill9_of_the_trainer_takes_its_embedded_daemon_within_2s(corpus, tmp_path, sluice_cli, where):
    cache = tmp_path / "cache"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(corpus / "manifest.json"), str(corpus / "run.toml"), str(cache), where],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs: set[int] = set()
    try:
        line = first_line(trainer, 120.0)
        assert line, f"the trainer did not start: {trainer.stderr.read().decode(errors='replace')[-3000:]}"
        daemon = json.loads(line)["daemon"]
        procs = _descendants(daemon)
        assert _alive(daemon)
        trainer.send_signal(signal.SIGKILL)  # the trainer only: its daemon is not in the signal's way
        trainer.wait(10)
        t0 = time.monotonic()
        while any(map(_alive, procs)) and time.monotonic() - t0 < 5.0:
            time.sleep(0.02)
        took = time.monotonic() - t0
        left = sorted(p for p in procs if _alive(p))
        assert not left, f"still running {took:.1f} s after the trainer's kill -9: {left} (daemon {daemon})"
        assert took < 2.0, f"the daemon and its children took {took:.2f} s to exit"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in procs:  # a failed run leaves nothing behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    res = sluice_cli("cache", "verify", cache)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("fd, says", [("97", "not an open file descriptor"), ("0", "not a pipe")])
def test_a_bad_parent_fd_is_refused_by_name(tmp_path, fd, says):
    res = subprocess.run([sys.executable, "-m", "sluice.loaderd.cli", str(tmp_path / "m.json"), str(tmp_path / "r.toml"),
                          "--cache", str(tmp_path / "c"), "--parent-fd", fd],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and f"--parent-fd {fd}: {says}" in res.stderr and "Traceback" not in res.stderr
