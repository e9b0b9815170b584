"""`loaderd --tokenizer-threads`: the daemon's encoder threads are the ones asked for (docs/tokenize.md, "Threads").

Specifications:
* The flag takes `auto` (the CPUs the daemon may run on) or an integer in
  [1, 1024]; anything else is refused naming the flag.
* A real daemon, tokenizing a cold object with fastokens, runs exactly the
  fastokens worker threads its count asks for (none with 1, one beside the
  caller with 2), whatever FASTOKENS_BPE_THREADS, RAYON_NUM_THREADS and
  TOKENIZERS_PARALLELISM its environment carries (the trainer's, when it
  starts the daemon); STATS `tokenizer` and `sluice_tokenizer_threads` say the
  count and the backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loaderd_support import Daemon, build_corpus, scrape


def test_tokenizer_threads_flag_takes_auto_or_a_count_and_names_a_bad_value():
    from sluice.errors import SpecError
    from sluice.loaderd.cli import tokenizer_threads_arg
    from sluice.tokenize.threads import available_cpus

    assert tokenizer_threads_arg("auto") == available_cpus() >= 1
    assert tokenizer_threads_arg("1") == 1 and tokenizer_threads_arg("16") == 16
    for bad in ("0", "-2", "many", "1025", ""):
        with pytest.raises(SpecError, match=f"--tokenizer-threads '{bad}'"):
            tokenizer_threads_arg(bad)


def test_a_bad_count_stops_the_daemon_at_start_naming_the_flag(tmp_path, sluice_main):
    proc = sluice_main("loaderd", tmp_path / "m.json", tmp_path / "r.toml", "--cache", tmp_path / "c",
                       "--tokenizer-threads", "0")
    assert proc.returncode == 2
    assert "--tokenizer-threads" in proc.stderr and "Traceback" not in proc.stderr


def _fastokens_workers(pid: int) -> int:
    """Threads of process `pid` that fastokens started (it names them fastokens-N)."""
    names = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(n.startswith("fastokens") for n in names)


@pytest.mark.slow  # two daemons
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="fastokens caps its pool at the CPUs available")
def test_the_daemon_encodes_with_the_threads_asked_for_whatever_its_environment(tmp_path, tokenizer_file,
                                                                                 monkeypatch):
    pytest.importorskip("fastokens")
    root = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=400, objects=2, seq_len=256,
                        max_steps=20)
    spec = (root / "dataset.toml").read_text()
    (root / "dataset.toml").write_text('tokenizer_backend = "fastokens"\n' + spec)
    freeze = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(root / "dataset.toml"),
                             "-o", str(root / "manifest.json"), "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert freeze.returncode == 0, freeze.stderr
    # What a trainer's environment may carry: each would give the encoder another count.
    for var, value in (("FASTOKENS_BPE_THREADS", "8"), ("RAYON_NUM_THREADS", "8"), ("TOKENIZERS_PARALLELISM", "true")):
        monkeypatch.setenv(var, value)
    seen = {}
    for n in (1, 2):
        with Daemon(root, cache=tmp_path / f"cache-{n}", extra=("--tokenizer-threads", str(n),
                                                               "--metrics-port", "0")) as d:
            c = d.client(0, 1)
            batches = sum(1 for _ in c)  # every step: its objects tokenized on the way (a cold cache)
            stats = c.stats()
            c.close()
            assert batches == 20 * 4  # max_steps x micro-batches per step (global 8 / micro 2)
            assert stats["tokenizer"]["backend"] == "fastokens"
            assert stats["tokenizer"]["threads"] == n
            assert scrape(d.info["metrics_port"])["sluice_tokenizer_threads"][(("backend", "fastokens"),)] == n
            seen[n] = _fastokens_workers(d.pid)
    # fastokens' pool is the caller plus n - 1 workers (tests/test_tokenize_backends.py)
    assert seen == {1: 0, 2: 1}


_PINNED_FIRST_ENCODE = """
import os, sys, threading
from sluice.tokenize import load_tokenizer
from sluice.tokenize.threads import available_cpus

every = os.sched_getaffinity(0)
enc = load_tokenizer(sys.argv[1], threads=2, backend="fastokens")
out = {"cpus": set(), "kept": set()}
together = threading.Barrier(4)

def first_encode():
    os.sched_setaffinity(0, {min(every)})  # as loaderd's producer, fill and demand threads under --gil-cpu
    out["cpus"].add(available_cpus())
    together.wait()  # (loaderd's fill and demand threads make their first encodes at once)
    enc.encode_batch(["def f(x):\\n    return x + 1\\n" * 200] * 16)
    out["kept"].add(tuple(sorted(os.sched_getaffinity(0))))

threads = [threading.Thread(target=first_encode) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
pool = []
for tid in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read()
    except FileNotFoundError:  # (a thread that ended since the listing: one of the joined four, not the pool's)
        continue
    if name.startswith("fastokens"):
        pool.append(sorted(os.sched_getaffinity(int(tid))))
print(out["cpus"] == {len(every)}, sorted(out["kept"]), pool, sorted(every))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: a pinned thread and a wider pool")
def test_a_thread_pinned_to_one_cpu_still_starts_the_pool_asked_for_on_every_cpu(tokenizer_file):
    """loaderd pins its producer to one CPU (--gil-cpu auto): fastokens, which sizes its pool from the CPUs of
    the thread that first encodes and gives its threads those CPUs, must still get the count asked for, spread
    over the process's CPUs, when four pinned threads make their first encodes at once (before the fix one in
    four runs got no worker: a thread entered fastokens pinned while another was widening, so each of four
    processes must get it); the pinned threads keep their pin; `available_cpus` counts the process's CPUs."""
    pytest.importorskip("fastokens")
    env = {k: v for k, v in os.environ.items() if k not in ("FASTOKENS_BPE_THREADS", "RAYON_NUM_THREADS")}
    every = sorted(os.sched_getaffinity(0))
    for run in range(4):
        res = subprocess.run([sys.executable, "-c", _PINNED_FIRST_ENCODE, str(tokenizer_file)], capture_output=True,
                             text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == f"True {[(min(every),)]} {[every]} {every}", f"process {run}"
