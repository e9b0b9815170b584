"""Helpers for the loaderd/client tests: real corpora, a real daemon process, the reference stream.

`build_corpus(root, kind, tokenizer_file)` writes a small real corpus (stdlib
sources as text) in one format, freezes it in this process (`freeze_here`: the
bytes `sluice manifest freeze` writes) and writes a run spec; `kind` is "jsonl.zst", "parquet", "wds" or
"sltok" (the jsonl.zst corpus pre-tokenized with `pretokenize`).

`Daemon` runs `loaderd` as a real child process and kills it on exit.
`reference(root, steps, replicas)` computes the expected (digest, samples) of
every (step, replica) with the pure Plan over a DocSource: what `sluice plan`
prints.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from support import freeze_here, stdlib_texts

from sluice.client.embedded import first_line

BOOT = "import sys; from sluice.loaderd.cli import main; sys.exit(main(sys.argv[1:]))"


def chunks(limit: int, lines_per: int = 20) -> list[str]:
    out: list[str] = []
    for text in stdlib_texts(60):
        lines = text.splitlines(keepends=True)
        out += ["".join(lines[i : i + lines_per]) for i in range(0, len(lines), lines_per)]
        if len(out) >= limit:
            break
    return out[:limit]


def _wds(path: Path, texts: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for i, t in enumerate(texts):
            data = t.encode()
            info = tarfile.TarInfo(f"s{i:06d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def build_corpus(root: Path, kind: str, tokenizer_file: Path, *, docs: int = 240, objects: int = 3,
                 seq_len: int = 64, lanes: int = 4, global_batch: int = 8, micro_batch: int = 2,
                 max_steps: int = 0, run_id: str = "t", unit: str = "documents") -> Path:
    import shutil

    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    (root / "shards").mkdir(exist_ok=True)
    texts = chunks(docs)
    per = len(texts) // objects
    parts = [texts[i * per : (i + 1) * per] for i in range(objects)]
    base = "jsonl.zst" if kind == "sltok" else kind
    if base == "jsonl.zst":
        cctx = zstandard.ZstdCompressor()
        for i, part in enumerate(parts):
            data = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
            (root / "shards" / f"c-{i}.jsonl.zst").write_bytes(cctx.compress(data))
        fmt, pattern, field = "jsonl", "shards/c-*.jsonl.zst", "text"
    elif base == "jsonl":
        for i, part in enumerate(parts):
            (root / "shards" / f"c-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        fmt, pattern, field = "jsonl", "shards/c-*.jsonl", "text"
    elif base == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for i, part in enumerate(parts):
            pq.write_table(pa.table({"text": part}), root / "shards" / f"c-{i}.parquet")
        fmt, pattern, field = "parquet", "shards/c-*.parquet", "text"
    elif base == "wds":
        for i, part in enumerate(parts):
            _wds(root / "shards" / f"c-{i}.tar", part)
        fmt, pattern, field = "webdataset", "shards/c-*.tar", "txt"
    else:
        raise ValueError(kind)
    (root / "dataset.toml").write_text(
        f'name = "loaderd-test"\ntokenizer = "tokenizer.json"\n'
        f'[packing]\nseq_len = {seq_len}\nalgorithm = "concat"\neos = "<|endoftext|>"\npad = "<|pad|>"\n'
        f'[mixture]\npolicy = "quota"\nunit = "{unit}"\n'
        f'[[sources]]\nname = "code"\npaths = ["{pattern}"]\nformat = "{fmt}"\ntext_field = "{field}"\n'
        f'weight = "1"\nexhaustion = "repeat"\n'
    )
    (root / "run.toml").write_text(
        f'run_id = "{run_id}"\nseed = 7\nlanes = {lanes}\nglobal_batch = {global_batch}\n'
        f'micro_batch = {micro_batch}\nmax_steps = {max_steps}\n'
    )
    freeze_here(root / "dataset.toml", root / "manifest.json")
    if kind == "sltok":
        from sluice.manifest.model import load_manifest
        from sluice.tokenize.pretokenize import pretokenize

        res = pretokenize(load_manifest(root / "manifest.json"), root / "tok", workers=1, progress=False)
        # the derived manifest's locations are relative to its own folder: point at it
        (root / "manifest.json").rename(root / "raw-manifest.json")
        os.symlink(res.path, root / "manifest.json")
    return root


def demo_corpus(root: Path, tokenizer_file: Path, *, files: int, per_shard: int, run_spec: str) -> Path:
    """The demo's two-source corpus (jsonl.zst code, parquet docstrings) under `root`, frozen; seq_len 64."""
    import shutil

    from sluice import demo

    demo.build_corpus(root, files=files, per_shard=per_shard)
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    (root / "dataset.toml").write_text(demo.DATASET_SPEC.replace("seq_len = 128", "seq_len = 64"))
    (root / "run.toml").write_text(run_spec)
    freeze_here(root / "dataset.toml", root / "manifest.json")
    return root


class Daemon:
    """A real `loaderd` child process; `endpoint` once started."""

    def __init__(self, root: Path, *, replicas: int = 1, serve: str | None = None, extra: tuple[str, ...] = (),
                 cache: Path | None = None, endpoint: str | None = None, token: str | None = None) -> None:
        self.root = root
        self.token = token
        self.args = [sys.executable, "-c", BOOT, str(root / "manifest.json"), str(root / "run.toml"),
                     "--cache", str(cache or root / "cache"), "--cache-budget", "256MiB",
                     "--replicas", str(replicas), "--log-level", "warning", *extra]
        if serve is not None:
            self.args += ["--serve", serve]
        if endpoint is not None:
            self.args += ["--endpoint", endpoint]
        if token is not None:  # the launcher's secret, in a 0600 file
            token_file = root / f"token-{time.time_ns()}"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            self.args += ["--token-file", str(token_file)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.log = root / f"loaderd-{time.time_ns()}.log"

    def start(self, timeout: float = 60.0) -> Daemon:
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._logf)
        line = first_line(self.proc, timeout)
        if line is None:
            raise AssertionError(f"loaderd did not start: {self.log.read_text()[-3000:]}")
        self.info = json.loads(line)
        return self

    @property
    def endpoint(self) -> str:
        return self.info["endpoint"]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, replica: int = 0, replicas: int = 1, **kw: Any) -> Any:
        from sluice.client import Client

        kw.setdefault("as_numpy", True)  # torch's import costs seconds; tensors are tested in test_client
        kw.setdefault("token", self.token)
        return Client(self.endpoint, replica, replicas, run_id=self.info["run_id"],
                      dataset_id=self.info["dataset_id"], **kw)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._logf.close()
        return self.proc.returncode

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def dealer(d: Daemon) -> Any:
    """A bare DEALER connected to `d` (no handshake, no token), linger 0: the wire as a stranger speaks it."""
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    return s


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """/metrics as {sample name: {labels (without run/dataset, le): value}}, _created samples left out."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run_id", "dataset_id")))
            if fam.type == "histogram":
                name, labels = s.name, labels
            out.setdefault(name, {})[labels] = s.value
    return out


def reference(root: Path, steps: int, replicas: int, start_state: Any = None,
              cache_dir: Path | None = None) -> dict[tuple[int, int], tuple[str, list[str]]]:
    """(step, replica) -> (digest, samples) from the pure reference Plan (what `sluice plan` prints).

    `cache_dir`: a node cache to read the objects from (default: a new one, filled from their locations)."""
    import contextlib
    import tempfile

    from sluice.errors import EndOfStream
    from sluice.loaderd.logical import Plan, micro_batches_digest, samples_of
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    out = {}
    with (contextlib.nullcontext(str(cache_dir)) if cache_dir else tempfile.TemporaryDirectory()) as d, open_data_path(
        load_manifest(root / "manifest.json"), load_runspec(root / "run.toml"),
        DataPathConfig(cache_dir=d, cache_budget=1 << 30, verify_on_read=False),
    ) as data:
        # `Plan.step` (the oracle), while the daemon serves from the fast path: every daemon-vs-plan test also
        # checks the fast path on a real corpus and tokenizer.
        plan, docs = Plan(data.manifest, data.spec, reference=True), data.docs
        state = start_state or plan.initial_state()
        while state.step + 1 < steps:
            try:
                batch, state = plan.step(state, docs)
            except EndOfStream:
                break
            for r in range(replicas):
                mbs = plan.replica_micro_batches(batch, replicas, r)
                out[(batch.step, r)] = (micro_batches_digest(mbs), samples_of(mbs))
    return out


def stream_digests(batches: list[dict[str, Any]], micro_per_step: int) -> dict[int, str]:
    """step -> digest of the received micro-batches (same algorithm as micro_batches_digest)."""
    import numpy as np

    from sluice.loaderd.logical.batch import arrays_digest

    by_step: dict[int, list[dict[str, Any]]] = {}
    for b in batches:
        by_step.setdefault(b["step"], []).append({k: np.asarray(b[k]) for k in
                                                  ("input_ids", "labels", "position_ids", "cu_seqlens")})
    return {s: arrays_digest(v) for s, v in by_step.items() if len(v) == micro_per_step}


def take_until(client: Any, steps: int, then: Any = None) -> list[dict[str, Any]]:
    """Copies of the client's micro-batches until step `steps - 1` is whole (from its current position); `then`
    (optional) is called with each batch as received, after its copy (a trainer's own use of it)."""
    import numpy as np

    out = []
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v) for k, v in mb.items()})
        if then is not None:
            then(mb)
        if mb["step"] + 1 >= steps and mb["micro"] + 1 == client.info["micro_per_step"]:
            break
    return out


def assert_the_plans_stream(root: Path, batches: list[dict[str, Any]], micro_per_step: int) -> None:
    """The whole steps of `batches` are consecutive and each is the reference plan's (replica 0 of 1)."""
    got = stream_digests(batches, micro_per_step)
    ref = reference(root, max(got) + 1, 1)
    assert sorted(got) == list(range(min(got), max(got) + 1))
    assert all(d == ref[(s, 0)][0] for s, d in got.items()), "a step differs from the plan"
