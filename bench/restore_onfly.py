"""Restore to the first batch on a running daemon, on the fly (issue 9: "a RESTORE cancels stale work").

A corpus of three plain jsonl objects read in order (`order = "none"`, one
lane): a big object 0 first, then objects 1 and 2. A daemon with a cold node
cache serves step 0 (object 0's fill starts), then the client RESTOREs to a
state deep in object 2 (taken once from a daemon with its own cache) and
times its first batch. Object 0's fill is then work for a position left
behind. Per round: restore-to-first-batch, the fills stopped
(`sluice_stale_fills_stopped_total` from STATS, where the tree has it) and
the CPU seconds the daemon used until 3 s after the restore. With `--base
TREE` the same rounds run a daemon from that tree too (interleaved).

    .venv/bin/python bench/restore_onfly.py [--rounds 5] [--mb 24] [--base TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BOOT = "import sys; from sluice.loaderd.cli import main; sys.exit(main(sys.argv[1:]))"


def build(root: Path, tokenizer: Path, mb: float) -> Path:
    """Three plain jsonl objects (object 0 holds `mb` MB, the others a tenth each), frozen."""
    import random

    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer, root / "tokenizer.json")
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "loader", "token", "shard", "cache", "lane", "step", "def", "x = 1"]
    for i, size in enumerate((mb, mb / 10, mb / 10)):
        with open(root / f"o{i}.jsonl", "w") as f:
            written = 0
            while written < size * 1e6:
                text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
    (root / "dataset.toml").write_text(
        'name = "restore-onfly"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 2048\nalgorithm = "concat"\n'
        'eos = "<|endoftext|>"\npad = "<|pad|>"\n[[sources]]\nname = "s"\npaths = ["o0.jsonl", "o1.jsonl", '
        '"o2.jsonl"]\nformat = "jsonl"\ntext_field = "text"\nweight = "1"\nexhaustion = "repeat"\n')
    (root / "run.toml").write_text('run_id = "r"\nseed = 7\nlanes = 1\nglobal_batch = 4\nmicro_batch = 4\n'
                                   'order = "none"\n')
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(root / "dataset.toml"),
                           "-o", str(root / "manifest.json"), "--no-progress"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"freeze failed: {proc.stderr}")
    return root


class Loaderd:
    """A `loaderd` process from `tree` (PYTHONPATH), its endpoint once started."""

    def __init__(self, root: Path, cache: Path, tree: Path, extra: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.log = open(cache.parent / f"{cache.name}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", BOOT, str(root / "manifest.json"), str(root / "run.toml"),
                                      "--cache", str(cache), "--cache-budget", "4GiB", "--log-level", "warning",
                                      *extra], stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=str(tree))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"loaderd did not start: see {self.log.name}")
        self.info = json.loads(line)

    def client(self):  # noqa: ANN201
        from sluice.client import Client

        return Client(self.info["endpoint"], 0, 1, run_id=self.info["run_id"], dataset_id=self.info["dataset_id"],
                      as_numpy=True, timeout_s=120)

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick  # incl. children

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def far_state(root: Path, work: Path, steps: int) -> dict:
    """The data state after step `steps - 1`, read from a daemon with its own cache."""
    d = Loaderd(root, work / "cache-far", REPO)
    try:
        c = d.client()
        for mb in c:
            if mb["step"] == steps - 1:
                break
        state = c.state_dict()
        c.close()
        return state
    finally:
        d.close()


def one(root: Path, work: Path, tree: Path, state: dict, tag: str) -> dict:
    cache = work / f"cache-{tag}"
    shutil.rmtree(cache, ignore_errors=True)
    d = Loaderd(root, cache, tree)
    try:
        c = d.client()
        first = next(iter(c))
        assert first["step"] == 0
        cpu0 = d.cpu_s()
        t0 = time.perf_counter()
        c.load_state_dict(state)
        mb = next(iter(c))
        restore_s = time.perf_counter() - t0
        assert mb["step"] == state["step"] + 1, mb["step"]
        time.sleep(max(0.0, 3.0 - (time.perf_counter() - t0)))
        cpu = d.cpu_s() - cpu0
        stats = c.stats()
        c.close()
        stopped = stats.get("producer", {}).get("sluice_stale_fills_stopped_total")
        return {"restore_s": restore_s, "cpu_3s": cpu, "stale_fills_stopped": stopped}
    finally:
        d.close()
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=float, default=24.0, help="MB of object 0 (objects 1 and 2: a tenth each)")
    ap.add_argument("--tokenizer", default=str(REPO / "bench/peers/work/full/tokenizer.json"))
    ap.add_argument("--base", metavar="TREE", help="also run a daemon from this source tree in the same rounds")
    ap.add_argument("--out", default=str(REPO / "bench/out/restore_onfly.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="restore-onfly-"))
    try:
        root = build(work / "corpus", Path(args.tokenizer), args.mb)
        from sluice.manifest.model import load_manifest

        objs = load_manifest(root / "manifest.json").sources[0].objects
        # deep in object 2: the records of objects 0 and 1 and half of 2, at ~ 1.3 steps per 8k tokens
        steps = _steps_into(root, work, objs)
        state = far_state(root, work, steps)
        trees = [("this", REPO)] + ([("base", Path(args.base).resolve())] if args.base else [])
        rows: dict[str, list[dict]] = {t: [] for t, _ in trees}
        for r in range(args.rounds):
            for tag, tree in (trees if r % 2 == 0 else trees[::-1]):
                got = one(root, work, tree, state, tag)
                rows[tag].append(got)
                print(f"  round {r + 1}/{args.rounds} {tag}: restore {got['restore_s']:.3f} s, daemon CPU in 3 s "
                      f"{got['cpu_3s']:.2f} s, stale fills stopped {got['stale_fills_stopped']}", flush=True)
        summary = {t: {"restore_s_median": statistics.median(x["restore_s"] for x in v),
                       "cpu_3s_median": statistics.median(x["cpu_3s"] for x in v)} for t, v in rows.items()}
        for t, s in summary.items():
            print(f"{t}: restore to first batch {s['restore_s_median']:.3f} s (median of {args.rounds}), "
                  f"daemon CPU in the 3 s after the restore {s['cpu_3s_median']:.2f} s")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "restore_step": steps, "rows": rows,
                                              "summary": summary, "load": os.getloadavg()}, indent=1))
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _steps_into(root: Path, work: Path, objs: list) -> int:
    """A step whose position lies in object 2 (by tokens: the tokenizer counts object 0 and 1's tokens)."""
    from sluice.manifest.model import load_manifest
    from sluice.tokenize import encoder_for_manifest
    from sluice.manifest.formats import read_texts

    m = load_manifest(root / "manifest.json")
    enc = encoder_for_manifest(m)
    tokens = 0
    for i in (0, 1):
        texts = read_texts(str(root / f"o{i}.jsonl"), "jsonl", "none", "text", f"o{i}")
        tokens += sum(len(a) + 1 for a in enc.encode_batch(texts))
    return tokens // (4 * 2048) + 20


if __name__ == "__main__":
    sys.exit(main())
