"""Two "nodes" on one machine, as in production: each its own loaderd, node cache and state.

Node n runs `loaderd --replicas 4 --node-rank n --ranks-per-node 2` (replicas
2n, 2n+1) on its own ipc socket, and `torchrun --nnodes 2 --nproc-per-node 2`
with a c10d rendezvous on loopback trains examples/train_lm.py (gloo). Node 0
hosts the rendezvous store; `--local-addr` 127.0.0.1 / 127.0.0.2 fixes which
node gets group rank 0 (c10d orders nodes by address), so node n's trainers are
global ranks 2n, 2n+1: exactly the replicas its daemon serves.

* reference: an uninterrupted run; every step's global batch (rows of replicas
  0..3) equals what the pure plan computes for `sluice plan --replicas 4`;
* crash: node 1 is lost mid-run (its daemon, torchrun and trainers killed -9);
  node 0's trainers fail on the broken collective; node 1's daemon is restarted
  on its cache and state, the job is restarted (a new rendezvous) while node
  0's daemon keeps running; every step and the final parameters equal the
  reference bit for bit;
* resize: 4 ranks stop at a checkpoint, 2 ranks (one per node) resume under
  `exact-elastic`: the same global batch every step.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of real multi-node training: the full tier only

from loaderd_support import Daemon  # noqa: E402
# The corpus of the single-node end-to-end test (demo corpus, seq_len 64, 8 lanes, global batch 16, exact-elastic).
from test_e2e_train import corpus  # noqa: E402,F401  (a module-scoped fixture)

from sluice import demo_train  # noqa: E402

STEPS = 16
EVERY = 8
NODES = 2
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
TIMEOUT = 300.0


def free_port() -> int:
    # torchrun's rendezvous needs a port both agents know before either starts.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One "node": a loaderd for its ranks (own cache, state, socket) and a torchrun agent."""

    def __init__(self, corpus: Path, run: Path, rank: int, nproc: int) -> None:
        self.corpus, self.run, self.rank, self.nproc = corpus, run, rank, nproc
        self.home = run / f"node{rank}"
        self.home.mkdir(parents=True, exist_ok=True)
        # a short fixed ipc path (sun_path ~107 bytes) that a restarted daemon binds again
        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix=f'sl-n{rank}-')}/d.sock"
        self.daemon: Daemon | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.log = self.home / f"torchrun-{time.time_ns()}.log"

    def start_daemon(self) -> None:
        self.daemon = Daemon(self.corpus, replicas=NODES * self.nproc, endpoint=self.endpoint,
                             cache=self.home / "cache",
                             extra=("--state-dir", str(self.home / "state"), "--node-rank", str(self.rank),
                                    "--ranks-per-node", str(self.nproc))).start()

    def start_agent(self, port: int, rdzv_id: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
               "--nproc-per-node", str(self.nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"is_host={'true' if self.rank == 0 else 'false'}",
               "--local-addr", f"127.0.0.{self.rank + 1}", "--max-restarts", "0", "--monitor-interval", "0.5",
               str(TRAIN), "--manifest", str(self.corpus / "manifest.json"),
               "--runspec", str(self.corpus / "run.toml"), "--endpoint", self.endpoint,
               "--ckpt", str(self.run / "ckpt"), "--out", str(self.run / "out"),
               "--steps", str(STEPS), "--every", str(EVERY), *extra]
        with open(self.log, "ab") as log:
            self.agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def kill9_all(self) -> None:
        """SIGKILL the torchrun agent and its trainers (torchrun starts each trainer in its own session)."""
        import psutil

        if self.agent is None or self.agent.poll() is not None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [psutil.Process(self.agent.pid), *psutil.Process(self.agent.pid).children(recursive=True)]
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGKILL)
            psutil.wait_procs(tree, timeout=30)
        self.agent.wait()

    def stop(self) -> None:
        self.kill9_all()
        if self.daemon is not None:
            self.daemon.stop()


class Cluster:
    def __init__(self, corpus: Path, run: Path, nproc: int = 2) -> None:
        self.nodes = [Node(corpus, run, n, nproc) for n in range(NODES)]

    def start(self, *extra: str) -> Cluster:
        for node in self.nodes:
            if node.daemon is None or node.daemon.proc is None or node.daemon.proc.poll() is not None:
                node.start_daemon()
        port, rdzv = free_port(), f"sluice-{time.time_ns()}"
        for node in self.nodes:  # node 0 first: it hosts the rendezvous store
            node.start_agent(port, rdzv, *extra)
        return self

    def wait(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            assert node.agent is not None
            try:
                rc = node.agent.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            assert rc == 0, f"node {node.rank}'s torchrun exited {rc}:\n{node.log.read_text()[-4000:]}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def plan_stream(corpus: Path, steps: int, replicas: int) -> tuple[dict[int, tuple[str, ...]], dict[tuple[int, int], str]]:
    """From the pure plan: step -> row digests of the global batch (replicas in order, as train_lm digests
    rows), and (step, replica) -> the micro-batch digest that `sluice plan` prints."""
    import blake3
    import numpy as np

    from sluice.loaderd.logical import micro_batches_digest
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    out: dict[int, tuple[str, ...]] = {}
    digests: dict[tuple[int, int], str] = {}
    with tempfile.TemporaryDirectory() as d, open_data_path(
        load_manifest(corpus / "manifest.json"), load_runspec(corpus / "run.toml"),
        DataPathConfig(cache_dir=d, cache_budget=1 << 30, verify_on_read=False),
    ) as data:
        plan, docs = data.plan(), data.docs
        state = plan.initial_state()
        for _ in range(steps):
            batch, state = plan.step(state, docs)
            rows = []
            for r in range(replicas):
                mbs = plan.replica_micro_batches(batch, replicas, r)
                digests[(batch.step, r)] = micro_batches_digest(mbs)
                for mb in mbs:
                    arrays = [np.asarray(getattr(mb, k), dtype="<i4") for k in ("input_ids", "labels", "position_ids")]
                    rows += [blake3.blake3(b"".join(a[i].tobytes() for a in arrays)).hexdigest()
                             for i in range(arrays[0].shape[0])]
            out[batch.step] = tuple(rows)
    return out, digests


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 2-node x 2-rank run; returns its folder (out/, ckpt/)."""
    run = tmp_path_factory.mktemp("mn-reference")
    cluster = Cluster(corpus, run)
    try:
        cluster.start().wait()
    finally:
        cluster.stop()
    return run


def test_two_nodes_train_the_global_batches_of_the_plan(corpus, reference):
    final, earlier = demo_train.read_steps(reference / "out")
    assert sorted(final) == list(range(STEPS)) and earlier == []
    assert all(r.replicas == 4 and len(r.rows) == 16 for r in final.values())
    expected, _ = plan_stream(corpus, STEPS, 4)
    assert [final[s].rows for s in range(STEPS)] == [expected[s] for s in range(STEPS)]
    losses = [final[s].loss for s in range(STEPS)]
    assert losses[-1] < losses[0], losses  # it learns
    for r in (1, 2, 3):  # four replicas on two nodes end with the same parameters, bit for bit
        problems, _ = demo_train.compare_params(reference / "out" / "params-r0.pt",
                                                reference / "out" / f"params-r{r}.pt")
        assert problems == []
    # each node's daemon served only its own ranks: rank r's shard holds lanes [2r, 2r + 2) of 8
    latest = (reference / "ckpt" / "latest").read_text().strip()
    lanes = [sorted(json.loads((reference / "ckpt" / "ckpt" / latest / f"data-r{r}.json").read_text())["lanes"],
                    key=int) for r in range(4)]
    assert lanes == [[str(2 * r), str(2 * r + 1)] for r in range(4)]


def test_sluice_plan_prints_the_same_stream(corpus):
    """`sluice plan --replicas 4` (the CLI) prints the digests of the micro-batches whose rows are compared above."""
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "plan", str(corpus / "manifest.json"),
                           str(corpus / "run.toml"), "--steps", "0:2", "--replicas", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    _, digests = plan_stream(corpus, 2, 4)
    assert {(x["step"], x["replica"]): x["digest"] for x in lines} == digests


def test_a_node_killed_mid_run_resumes_bit_for_bit(corpus, reference, tmp_path):
    kill_step = EVERY + 1  # just past the checkpoint of step EVERY: the steps after it are trained twice
    run = tmp_path / "crash"
    cluster = Cluster(corpus, run)
    try:
        cluster.start()
        lost, survivor = cluster.nodes[1], cluster.nodes[0]
        demo_train.wait_for_step(run / "out", kill_step, [n.agent for n in cluster.nodes], TIMEOUT, rank=2)
        assert lost.daemon is not None and lost.agent is not None
        lost.daemon.kill9()  # node 1 is lost: its daemon, torchrun agent and trainers, kill -9 at once
        lost.kill9_all()
        # node 0's trainers fail on the broken collective and its torchrun exits non-zero
        assert survivor.agent is not None and survivor.agent.wait(120) != 0
        lost.start_daemon()  # restarted (or replaced) node: same socket path, cache and fencing state
        cluster.start().wait()  # the job restarts; node 0's daemon is the same process throughout
    finally:
        cluster.stop()

    restores = [e for e in demo_train.read_events(run / "out", rank=2) if e["event"] == "restore"]
    assert [e["generation"] for e in restores] == [1, 2] and restores[1]["step"] is not None
    final, earlier = demo_train.read_steps(run / "out")
    assert earlier, "the steps after the checkpoint were trained twice and must match too"
    ref, _ = demo_train.read_steps(reference / "out")
    assert demo_train.compare_streams(ref, final, STEPS, earlier=earlier) == []
    for r in range(4):
        problems, _ = demo_train.compare_params(reference / "out" / f"params-r{r}.pt", run / "out" / f"params-r{r}.pt")
        assert problems == [], problems


def test_resize_four_ranks_to_two_at_a_checkpoint_keeps_the_global_stream(corpus, reference, tmp_path):
    stop = EVERY
    run = tmp_path / "resize"
    cluster = Cluster(corpus, run)
    try:
        cluster.start("--stop-after", str(stop)).wait()
    finally:
        cluster.stop()
    cluster = Cluster(corpus, run, nproc=1)  # one rank per node: daemons of --replicas 2
    try:
        cluster.start().wait()
    finally:
        cluster.stop()
    ref, _ = demo_train.read_steps(reference / "out")
    final, earlier = demo_train.read_steps(run / "out")
    assert earlier == []
    assert [final[s].replicas for s in range(STEPS)] == [4] * (stop + 1) + [2] * (STEPS - stop - 1)
    assert all(final[s].rows == ref[s].rows for s in range(STEPS))  # the same global batch every step
    assert all(final[s].loss == ref[s].loss for s in range(stop + 1))
    assert demo_train.compare_streams(ref, final, STEPS, loss_rtol=1e-4) == []


# ----------------------------------------------------------------------------- data nodes
def test_data_nodes_serve_remote_ranks_over_curve_tcp(tmp_path, tokenizer_file):
    """Two data nodes (loaderd on TCP with CurveZMQ, distinct ports and keys) split the 4 replicas
    (--serve 0,1 and 2,3); each remote rank reads its replica from its data node and gets the plan's batches."""
    from loaderd_support import build_corpus, reference, stream_digests

    from sluice.client import DaemonError, DaemonUnavailable
    from sluice.curve import generate, load_client_keys

    steps = 4
    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file, docs=120, lanes=4, global_batch=8,
                        micro_batch=2)
    keys = tmp_path / "keys"
    _, trainer_sec = generate(keys / "trainers", "trainer")
    daemons, servers = [], []
    try:
        for n, serve in enumerate(("0,1", "2,3")):
            pub, sec = generate(keys / f"data{n}", "loaderd")
            allowed = keys / f"allowed{n}"
            allowed.mkdir()
            shutil.copy(keys / "trainers" / "trainer.key", allowed / "trainer.key")
            daemons.append(Daemon(root, replicas=4, serve=serve, endpoint="tcp://127.0.0.1:*",
                                  cache=tmp_path / f"data{n}-cache",
                                  extra=("--curve-secret", sec, "--curve-clients", str(allowed),
                                         "--state-dir", str(tmp_path / f"data{n}-state"))).start())
            servers.append(pub)
        assert len({d.endpoint for d in daemons}) == 2  # distinct ports
        expected = reference(root, steps, 4)
        for replica in range(4):
            node = replica // 2
            client = daemons[node].client(replica, 4, curve=load_client_keys(trainer_sec, servers[node]),
                                          end_step=steps)
            with client:
                got = stream_digests(list(client), 1)
            assert got == {s: expected[(s, replica)][0] for s in range(steps)}, replica
        # a rank sent to the wrong data node is refused by name; the other node's key does not open it
        wrong = daemons[0].client(2, 4, curve=load_client_keys(trainer_sec, servers[0]), end_step=steps)
        with wrong, pytest.raises(DaemonError, match="BAD_REPLICA"):
            next(iter(wrong))
        other_key = daemons[0].client(0, 4, curve=load_client_keys(trainer_sec, servers[1]), end_step=steps,
                                      timeout_s=0.5, reconnect_s=1.5)
        with other_key, pytest.raises(DaemonUnavailable):
            next(iter(other_key))
    finally:
        for d in daemons:
            d.stop()
