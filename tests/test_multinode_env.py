"""examples/multinode_train.py on two "nodes": daemons on tcp with CurveZMQ, node files, a rank per process.

Node n has keys made by `sluice curve-keys` (its daemon's pair, its trainers'
pair; the daemon allows only its own node's trainer key), a loaderd on
tcp://127.0.0.1:* serving replicas 2n, 2n+1 (`--node-rank n --ranks-per-node
2`) that writes its endpoint file, and a node file naming the endpoint file
and the key files by relative paths. Ranks 0..3 run the example as separate
processes with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT: gloo) and their node's $SLUICE_NODE_FILE.

Rank 3 is killed after step 6 (the checkpoint is at step 4); the job is
restarted with the same command while both daemons keep running. Every
rank's stream of steps 0..11 equals the digests `sluice plan --replicas 4`
prints for its replica, and the retrained steps 5 and 6 have the same loss,
bit for bit, as before the kill.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loaderd_support import Daemon, build_corpus

pytestmark = pytest.mark.slow  # two daemons and eight torch processes

RANK_SCRIPT = Path(__file__).resolve().parent / "multinode_rank.py"
STEPS, EVERY, PAUSE, NODES, PER_NODE = 12, 4, 6, 2, 2
WORLD = NODES * PER_NODE
TIMEOUT = 240.0


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:  # the rendezvous port every rank must know before any starts
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def provision(home: Path, corpus: Path, n: int) -> tuple[Daemon, Path]:
    """Node n's keys, daemon and node file."""
    keys = home / "keys"
    cli("curve-keys", str(keys), "loaderd")
    cli("curve-keys", str(keys), "trainer")
    (home / "allowed").mkdir()
    (home / "allowed" / "trainer.key").write_bytes((keys / "trainer.key").read_bytes())
    daemon = Daemon(corpus, replicas=WORLD, endpoint="tcp://127.0.0.1:*", cache=home / "cache",
                    extra=("--endpoint-file", str(home / "endpoint"), "--state-dir", str(home / "state"),
                           "--curve-secret", str(keys / "loaderd.key_secret"), "--curve-clients",
                           str(home / "allowed"), "--node-rank", str(n), "--ranks-per-node", str(PER_NODE)))
    node_file = home / "node.env"
    node_file.write_text(f"# node {n}\nSLUICE_NODE_RANK={n}\nSLUICE_ENDPOINT_FILE=endpoint\n"
                         "export SLUICE_CURVE_SECRET=keys/trainer.key_secret\nSLUICE_CURVE_SERVER='keys/loaderd.key'\n")
    return daemon, node_file


def start_ranks(run: Path, corpus: Path, node_files: list[Path], pause: dict[int, str] | None = None
                ) -> list[subprocess.Popen[bytes]]:
    """The ranks as processes; `pause`: rank -> its $TEST_PAUSE_AFTER (tests/multinode_rank.py)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    procs = []
    for rank in range(WORLD):
        env = {**base, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank % PER_NODE),
               "LOCAL_WORLD_SIZE": str(PER_NODE), "GROUP_RANK": str(rank // PER_NODE), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "SLUICE_NODE_FILE": str(node_files[rank // PER_NODE])}
        if pause and rank in pause:
            env["TEST_PAUSE_AFTER"] = pause[rank]
        with open(run / f"rank{rank}.out", "ab") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT), "--manifest", str(corpus / "manifest.json"), "--ckpt",
                 str(run / "ckpt"), "--steps", str(STEPS), "--every", str(EVERY), "--log", str(run / "log")],
                env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def outputs(run: Path) -> str:
    return "\n".join(f"rank {r}: {(run / f'rank{r}.out').read_text()[-1500:]}" for r in range(WORLD))


def generations(run: Path, rank: int) -> list[tuple[dict, dict[int, dict]]]:
    """Per start of the rank: (its restore line, step -> step line)."""
    out: list[tuple[dict, dict[int, dict]]] = []
    for line in (run / "log" / f"steps-r{rank}.jsonl").read_text().splitlines():
        obj = json.loads(line)
        if "restored" in obj:
            out.append((obj, {}))
        else:
            out[-1][1][obj["step"]] = obj
    return out


def test_two_nodes_over_curve_train_the_plan_and_resume_exactly_after_a_rank_is_killed(tmp_path, tokenizer_file):
    corpus = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=240, lanes=8, global_batch=16,
                          micro_batch=2)
    run = tmp_path / "run"
    run.mkdir()
    nodes = [provision(tmp_path / f"node{n}", corpus, n) for n in range(NODES)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for daemon, _ in nodes:
            daemon.start()
        node_files = [f for _, f in nodes]
        paused = run / "paused"
        paused.mkdir()
        procs = start_ranks(run, corpus, node_files, pause={3: f"{PAUSE}:{paused}"})
        deadline = time.monotonic() + TIMEOUT
        while not (paused / "paused-r3").exists():  # rank 3 logged step 6 and waits to be killed
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), outputs(run)
            time.sleep(0.05)
        procs[3].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        for proc in procs[:3]:  # the others fail on the broken all-reduce (a scheduler would kill them anyway)
            assert proc.wait(60) != 0, outputs(run)
        print(f"ranks 0-2 exited {time.monotonic() - t_kill:.1f} s after rank 3's kill")

        procs = start_ranks(run, corpus, node_files)  # the job restarts; both daemons kept running
        for proc in procs:
            assert proc.wait(max(1.0, deadline - time.monotonic())) == 0, outputs(run)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for daemon, _ in nodes:
            daemon.stop()

    plan = {}
    for line in cli("plan", str(corpus / "manifest.json"), str(corpus / "run.toml"), "--steps", f"0:{STEPS}",
                    "--replicas", str(WORLD), "--json", "--no-progress").splitlines():
        obj = json.loads(line)
        plan[(obj["step"], obj["replica"])] = obj["digest"]
    for rank in range(WORLD):
        (first_restore, first), (second_restore, second) = generations(run, rank)
        assert first_restore["restored"] == -1 and sorted(first) == list(range(PAUSE + 1))
        assert second_restore["restored"] == EVERY and second_restore["generation"] > first_restore["generation"]
        assert sorted(second) == list(range(EVERY + 1, STEPS))
        stream = {**first, **second}  # the restarted run's steps replace the killed run's
        assert {s: stream[s]["digest"] for s in range(STEPS)} == {s: plan[(s, rank)] for s in range(STEPS)}
        for step in range(EVERY + 1, PAUSE + 1):  # retrained after the restore: the same update, bit for bit
            assert (second[step]["loss"], second[step]["digest"]) == (first[step]["loss"], first[step]["digest"])
