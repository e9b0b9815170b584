"""CPU per job, on the fly with tiktoken: sluice's job (its embedded daemon included) against the raw tiktoken loop.

Runs the two jobs of bench/peers ("sluice tiktoken", "raw_tiktoken") over the
whole corpus once, alternated for `--rounds` rounds, each in a fresh process,
and prints each job's wall time and CPU seconds (user + system of the job and
its children: getrusage). Where the steady rates track CPU per token (a loaded
machine) this is what separates them. sluice's job also starts two more
daemons for its restore figures (bench/peers/jobs/sluice_job.py): counted.

Run: ``.venv/bin/python bench/peers/jobcpu.py [--rounds 2]`` (the corpus of
bench/peers/work/full, prepared by bench/peers/run.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
import run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    paths = corpus.prepare(HERE / "work" / "full", mb=50, vocab=32000)
    batches = run.corpus_batches(paths)
    specs = {label: (script, extra) for label, _, _, script, extra in run.LOADERS}
    for rnd in range(args.rounds):
        for label in ("sluice tiktoken", "raw_tiktoken"):
            script, extra = specs[label]
            scratch = Path(tempfile.mkdtemp(prefix="jobcpu-"))
            try:
                cfg = run.job_config(label, extra, paths, batches, scratch, 60)
                before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                proc = subprocess.run([sys.executable, str(HERE / "jobs" / script), json.dumps(cfg)],
                                      capture_output=True, text=True, cwd=scratch, timeout=600)
                wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"round {rnd + 1} {label}: failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
                return 1
            got = json.loads(lines[-1])
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            print(f"round {rnd + 1} {label}: wall {wall:.2f} s, CPU {cpu:.2f} s, steady "
                  f"{got['tokens_per_s'] / 1e6:.2f} M tok/s, {got['tokens'] / 1e6:.1f} M tokens", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
