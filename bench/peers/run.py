"""Side by side with the peer loaders (issue 9 item 7): `make bench-peers`.

Builds one corpus and one byte-level BPE (bench/peers/corpus.py), installs each
peer in its own venv (bench/peers/venvs.py), then runs the same job for every
loader, interleaved round-robin over --rounds rounds: tokenize on the fly (or
read tokens) + concat-pack to 2048 + micro-batches of 8 handed to a consumer
loop. Each job is a fresh process (jobs/<peer>_job.py; the job files carry a
suffix so a job named after its package does not shadow it) that prints one JSON
line; every job delivers torch tensors to the same consumer loop (jobs/common.py).
Per loader: delivered tokens/s (steady), first batch from process start,
restore-to-first-batch at 90% of the measured stream (where the loader can
resume), and CPU seconds per million tokens of all the job's processes
(steady and end to end). Medians over rounds; sluice's ratio to the best peer
of its group. sluice's jobs report the steps each producer path served (STATS
`fast_path`): a warning line (and `fast_path_under_99` in the JSON) where the
fast path served under 99% of them; where a row from tokens did, the run
exits 1 (after the table and the JSON). `--workload` picks the corpus: `single` (one source), `mixture`
(five sources weighted by tokens, default piece_tokens; corpus.py) or `both`;
"sluice tokcache bestfit" reads it frozen with the best-fit packer, "sluice tokcache sequences" with the
mixture's unit `sequences` (a row a draw, one concat packer per source; the same token cache either way).
sluice's jobs declare the run's length (the run spec's `max_steps`), as a
trainer does. Once a round the start floor is timed (a process that only
imports torch, as every job does first); after the table, `e2e bound` (a loader
delivering in no time) and each sluice row's `e2e ceiling` (its steady rate
after that floor). Then a shard-size sweep of sluice's first-batch time (one
generated jsonl object per size, a fresh node cache, block order).

Prints one table; writes bench/out/peers.json and bench/out/peers.png
(peers-mixture / peers-both for the other workloads).
Nothing here is hard-coded: a peer that did not install or whose job failed is
reported as such.

    .venv/bin/python bench/peers/run.py [--quick] [--rounds N] [--peers a,b] [--workload single|mixture|both]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import corpus  # noqa: E402
import venvs  # noqa: E402
from report import FAST_SHARE_MIN, chart, fast_path_warnings, fmt, mixture_to_single, summarize, table  # noqa: E402

# --quick: table 2 of docs/performance.md (from tokens, both workloads) in 3 rounds; the daemon loads its
# compiled kernel after its first call, as in the full table
QUICK_PEERS = "sluice pretok,sluice tokcache,litdata"
QUICK_BATCHES = 12000
# A median of 2 rounds is their mean: one round of a busy or cold hour (a first process start of 4.4 s against
# 1.1-1.4 s, one job at 23 against 36 M tok/s) moved a ratio out of the docs' spread; the median of 3 drops it.
QUICK_ROUNDS = 3

# (label, group, peer venv or None for the repo's, job script, extra config)
LOADERS = [
    ("sluice", "on the fly", None, "sluice_job.py", {"variant": "onfly"}),
    ("webdataset", "on the fly", "webdataset", "webdataset_job.py", {}),
    ("hf_datasets", "on the fly", "hf_datasets", "hf_datasets_job.py", {}),
    ("grain", "on the fly", "grain", "grain_job.py", {}),
    ("raw_tokenizers", "on the fly", None, "raw_tokenizers_job.py", {}),
    # The same job with the manifest's `tokenizer.backend = "tiktoken"` (same ids, checked at preparation),
    # and its baseline: tiktoken's own thread pool alone on the same cores.
    ("sluice tiktoken", "on the fly", None, "sluice_job.py", {"variant": "onfly-tiktoken"}),
    ("raw_tiktoken", "on the fly", None, "raw_tokenizers_job.py", {"backend": "tiktoken"}),
    # The same with `tokenizer.backend = "fastokens"` (proven on every document at preparation), and its raw loop.
    ("sluice fastokens", "on the fly", None, "sluice_job.py", {"variant": "onfly-fastokens"}),
    ("raw_fastokens", "on the fly", None, "raw_tokenizers_job.py", {"backend": "fastokens"}),
    # The demand path (records a step needs, out of order) in 2 tokenizer processes / in the daemon's threads,
    # whatever `--demand-workers auto` picks on this machine (docs/tokenize.md, "Out of order").
    ("sluice pool", "on the fly", None, "sluice_job.py", {"variant": "onfly", "daemon_args": ["--demand-workers", "2"]}),
    ("sluice tiktoken pool", "on the fly", None, "sluice_job.py",
     {"variant": "onfly-tiktoken", "daemon_args": ["--demand-workers", "2"]}),
    ("sluice threads", "on the fly", None, "sluice_job.py", {"variant": "onfly", "daemon_args": ["--demand-workers", "0"]}),
    ("sluice tiktoken threads", "on the fly", None, "sluice_job.py",
     {"variant": "onfly-tiktoken", "daemon_args": ["--demand-workers", "0"]}),
    ("sluice tokcache", "pre-tokenized", None, "sluice_job.py", {"variant": "tokcache"}),
    ("sluice tokcache bestfit", "pre-tokenized", None, "sluice_job.py", {"variant": "tokcache", "packer": "bestfit"}),
    ("sluice tokcache sequences", "pre-tokenized", None, "sluice_job.py", {"variant": "tokcache", "unit": "sequences"}),
    ("sluice pretok", "pre-tokenized", None, "sluice_job.py", {"variant": "pretok"}),
    ("litdata", "pre-tokenized", "litdata", "litdata_job.py", {"prepare": True}),
    ("streaming", "pre-tokenized", "streaming", "streaming_job.py", {"prepare": True}),
]


# Steps a sluice job's run spec declares beyond its micro-batches (`max_steps`): room for the restore.
STEPS_MARGIN = 64


def shown(path: Path) -> str:
    """`path` as the output says it: relative to the repository where it lies inside (a log kept under
    bench/results names no machine's folders), else as it is."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def variant_manifest(out: Path, tag: str, old: str, new: str) -> str:
    """The prepared corpus's manifest frozen with the line `old` of its dataset spec replaced by `new` (once per
    prepared folder, named by `tag`); its path. The token cache `cache warm --tokens` filled serves it too:
    cached tokens depend on neither the packer nor the mixture's unit."""
    manifest = out / f"manifest-{tag}.json"
    if not manifest.exists():
        spec_text = (out / "dataset.toml").read_text()
        if old not in spec_text:
            raise SystemExit(f"bench/peers: {out / 'dataset.toml'} has no line {old!r} to replace")
        (out / f"dataset-{tag}.toml").write_text(spec_text.replace(old, new))
        corpus.sluice("manifest", "freeze", str(out / f"dataset-{tag}.toml"), "-o", str(manifest), "--no-progress")
    return str(manifest)


def job_config(label: str, extra: dict, paths: dict, batches: int, scratch: Path,
               client_timeout_s: float | None = None) -> dict:
    cfg = {**paths, **extra, "batches": batches, "repo": extra.get("repo", str(REPO)), "work": str(scratch),
           "client_timeout_s": client_timeout_s,
           "peer_data": str(Path(paths["manifest"]).parent / "peerdata" / label)}
    variant = extra.get("variant")
    if variant is not None and "runspec" in paths:
        # A training run declares its length (the run spec's `max_steps`), as a trainer that stops at N steps
        # does; one step a micro-batch here, and room for the restore after 90% of it (sluice_job.py).
        text = Path(paths["runspec"]).read_text()
        (scratch / "run.toml").write_text(text + f"\nmax_steps = {batches + STEPS_MARGIN}\n")
        cfg["runspec"] = str(scratch / "run.toml")
    if variant == "onfly":
        cfg["cache"] = str(scratch / "cache")  # fresh per run: cold node cache, no tokens
    elif variant in ("onfly-tiktoken", "onfly-fastokens"):
        cfg["manifest"] = corpus.backend_manifest(Path(paths["manifest"]).parent, variant.split("-")[1])
        cfg["cache"] = str(scratch / "cache")
    elif variant == "tokcache":
        cfg["cache"] = paths["cache_tok"]
        folder = Path(paths["manifest"]).parent
        if extra.get("packer"):
            cfg["manifest"] = variant_manifest(folder, extra["packer"], 'algorithm = "concat"',
                                               f'algorithm = "{extra["packer"]}"')
        elif extra.get("unit"):
            cfg["manifest"] = variant_manifest(folder, extra["unit"], 'unit = "tokens"', f'unit = "{extra["unit"]}"')
    elif variant == "pretok":
        cfg["manifest"], cfg["cache"] = paths["derived"], paths["cache_pretok"]
    return cfg


def run_job(python: Path, script: str, cfg: dict, timeout_s: float) -> dict:
    """Run one job in a fresh process; its JSON line plus first_batch_s, or {"error": ...}."""
    launched = time.time()
    try:
        proc = subprocess.run([str(python), str(HERE / "jobs" / script), json.dumps(cfg)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=cfg["work"],
                              env=base_env(cfg) if python == Path(sys.executable) else None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": f"job failed (exit {proc.returncode}): {tail[:200]}",
                "stderr_tail": proc.stderr.strip().splitlines()[-25:]}
    out = json.loads(lines[-1])
    out["first_batch_s"] = out.pop("first_batch_wall") - launched
    # End to end: every token delivered over the whole life of the process (start included).
    out["e2e_tokens_per_s"] = out["tokens"] / (out.pop("last_batch_wall") - launched)
    return out


def base_env(cfg: dict) -> dict:
    """A job's environment: its tree (this one, or a `--base` twin's) first on PYTHONPATH, so the embedded
    daemon (a child process that imports sluice on its own) runs the job's code too, also where the venv's
    installed sluice is another checkout's (a git worktree)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (cfg["repo"], os.environ.get("PYTHONPATH")) if p)}


def run_job_raw(python: Path, script: str, cfg: dict, timeout_s: float) -> str | None:
    """Run a job's untimed prepare step; None or why it failed."""
    try:
        proc = subprocess.run([str(python), str(HERE / "jobs" / script), json.dumps(cfg)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=cfg["work"])
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/peers/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"table 2 of docs/performance.md in short (a few minutes): {QUICK_PEERS}, both "
                         f"workloads, {QUICK_BATCHES} micro-batches, {QUICK_ROUNDS} rounds, no sweep, --bytecode (flags given "
                         "as well win)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument("--peers", default=None, help="comma-separated loader labels to run (default: all)")
    ap.add_argument("--batches", default=None,
                    help="micro-batches per job, every loader alike (default 150), or `corpus`: the "
                         "whole corpus once (its tokens, one eos per document, over 8 x 2048)")
    ap.add_argument("--sweep", default=None, help="object sizes in MB for the sweep (default 10,100,300)")
    ap.add_argument("--sweep-orders", default="block", help="run-spec orders for the sweep (e.g. block,none)")
    ap.add_argument("--contend", type=int, default=0,
                    help="CPU-bound busy processes (normal priority) running during every job")
    ap.add_argument("--client-timeout", type=float, default=None,
                    help="sluice client's silence timeout in sluice's jobs (default: the client's own, 10 s)")
    ap.add_argument("--workload", choices=("single", *corpus.WORKLOADS[1:], "both"), default=None,
                    help="single: one source (default; --quick both); mixture: five sources weighted by tokens, "
                         "default piece_tokens, concat 2048 (corpus.py); both: one after the other")
    ap.add_argument("--work", default=str(HERE / "work"), help="folder for the corpus and caches (reused)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it is counted failed")
    ap.add_argument("--base", metavar="TREE", help="also run each chosen sluice loader from this source tree "
                    "(e.g. `git archive` of a baseline commit), interleaved in the same rounds")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the chart of a results file (next to it, .png)")
    ap.add_argument("--bytecode", action="store_true",
                    help="let every job's Python cache bytecode (a private PYTHONPYCACHEPREFIX, written by the "
                         "first round), as an installed package does, where PYTHONDONTWRITEBYTECODE is set")
    args = ap.parse_args(argv)
    if args.quick:  # the standing comparison from tokens, shortened: what a newcomer checks the docs' ratios with
        args.peers = args.peers or QUICK_PEERS
        args.batches = args.batches or str(QUICK_BATCHES)
        args.workload = args.workload or "both"
        args.sweep = "" if args.sweep is None else args.sweep
        args.bytecode = True
    args.workload = args.workload or "single"
    if args.bytecode:
        # With PYTHONDONTWRITEBYTECODE set (this development machine sets it) each sluice process (the job,
        # its daemon) compiles sluice's modules at every start, which an installed package never does; the
        # peers import from their venvs' site-packages. The prefix holds every loader's bytecode alike.
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = pyc = tempfile.mkdtemp(prefix="peers-pyc-")
        atexit.register(shutil.rmtree, pyc, True)
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        chart(record["rows"], record["sweep"], Path(args.replot).with_suffix(".png"))
        return 0
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else 3)
    if args.batches not in (None, "corpus") and not (args.batches.isdigit() and int(args.batches) > 2):
        ap.error(f"--batches: {args.batches!r} is neither a count above 2 nor `corpus`")
    sweep_sizes = [int(s) for s in (args.sweep if args.sweep is not None else "10,100,300").split(",") if s]
    work = Path(args.work) / "full"
    chosen = set(args.peers.split(",")) if args.peers else None
    loaders = [spec for spec in LOADERS if chosen is None or spec[0] in chosen]
    if args.base:  # each chosen sluice loader again, from the baseline tree, in the same rounds
        base = str(Path(args.base).resolve())
        loaders += [(f"{label} @base", group, None, script, {**extra, "repo": base})
                    for label, group, peer, script, extra in list(loaders) if label.startswith("sluice")]

    status: dict[str, str | None] = {}
    for label, _, peer, script, _ in loaders:
        if peer is not None:
            print(f"bench/peers: venv for {peer}", flush=True)
            status[label] = venvs.install(peer) or (None if (HERE / "jobs" / script).exists()
                                                    else f"no job script {script}")
    workloads = corpus.WORKLOADS if args.workload == "both" else (args.workload,)
    rows, runs, corpora, batches_of = [], {}, {}, {}
    # Contention: busy loops at the priority they were started with, as a trainer's own threads would be.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.contend)]
    try:
        for workload in workloads:
            folder = work if workload == "single" else work.with_name(f"{work.name}-{workload}")
            got, results, paths, batches = run_workload(workload, folder, args, loaders, dict(status), rounds)
            rows += got
            runs[workload], batches_of[workload] = results, batches
            corpora[workload] = {k: paths[k] for k in ("documents", "text_bytes")}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    first = work if workloads[0] == "single" else work.with_name(f"{work.name}-{workloads[0]}")
    sweep = run_sweep(sweep_sizes if chosen is None or "sluice" in chosen else [], first, args.timeout,
                      args.client_timeout, args.sweep_orders.split(","))
    mixture_to_single(rows)
    print()
    print(table(rows))
    for line in ceiling_lines(rows):
        print(line)
    warnings = fast_path_warnings(rows)
    for line in warnings:
        print(line)
    missing = [name for name, v in speed_extras().items() if v is None]
    if missing:
        print(f"note: sluice ran without {', '.join(missing)} (`make venv` installs them): slower than it can be")
    for s in sweep:
        print(f"sweep: one {s['object_mb']} MB jsonl object, cold cache, order {s.get('order', 'block')}: first batch "
              f"{fmt(s['first_batch_s'])} s" + (f" ({s['error']})" if s.get("error") else ""))
    out_dir = REPO / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["bench/peers/run.py", *(argv if argv is not None else sys.argv[1:])]),
              "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rounds": rounds,
              "batches": batches_of[workloads[0]] if len(workloads) == 1 else batches_of,
              "contend": args.contend, "sluice_extras": speed_extras(), "workloads": list(workloads),
              "corpus": corpora[workloads[0]] if len(workloads) == 1 else corpora, "rows": rows, "sweep": sweep,
              "fast_path_under_99": any(r.get("fast_path_under_99") for r in rows),
              "fast_path_warnings": warnings,
              "runs": runs[workloads[0]] if len(workloads) == 1 else runs}
    name = "peers" + ("" if args.workload == "single" else f"-{args.workload}") + \
        (f"-contend{args.contend}" if args.contend else "")
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
    chart(rows, sweep, out_dir / f"{name}.png")
    print(f"wrote {shown(out_dir / (name + '.json'))} and {shown(out_dir / (name + '.png'))}")
    return verdict(rows)


def ceiling_lines(rows: list[dict]) -> list[str]:
    """After the table: per workload, the end-to-end bound of a loader that delivers in no time (its tokens over
    the start floor), as ratios to each peer's e2e rate; then per sluice row its end-to-end ceiling at its steady
    rate (`add_ceilings`), as a ratio to the e2e rate of the best peer its row is compared with."""
    by_key = {(r["loader"], r["workload"]): r for r in rows}
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):  # a loader that delivers in no time
        r = next((r for r in rows if r["workload"] == workload and r.get("start_floor_s")), None)
        if r is not None:
            bound = r["delivered_tokens"] / r["start_floor_s"]
            peers = [p for p in rows if p["workload"] == workload and not p["loader"].startswith(("sluice", "raw_"))
                     and p.get("e2e_tokens_per_s")]
            out.append(f"e2e bound ({workload}): {bound / 1e6:.2f} M tok/s for any loader (its tokens over the start "
                       "floor alone) = " + ", ".join(f"{bound / p['e2e_tokens_per_s']:.2f}x {p['loader']}"
                                                     for p in peers))
    for r in rows:
        peer = by_key.get((r.get("best_peer_e2e"), r["workload"]))
        if not r["loader"].startswith("sluice") or not r.get("e2e_ceiling_tokens_per_s") or not peer \
                or not peer.get("e2e_tokens_per_s"):
            continue
        ceiling = r["e2e_ceiling_tokens_per_s"]
        out.append(f"e2e ceiling {r['loader']} ({r['workload']}): {ceiling / 1e6:.2f} M tok/s = "
                   f"{ceiling / peer['e2e_tokens_per_s']:.2f}x {peer['loader']} e2e (its steady rate after the "
                   f"{r['start_floor_s']:.2f} s start floor; measured {r['e2e_tokens_per_s'] / 1e6:.2f})")
    return out


def verdict(rows: list[dict]) -> int:
    """The run's exit status: 1 (saying why on stderr) where the fast path served under `FAST_SHARE_MIN` of the
    steps of a sluice row from tokens (issue 23: such a run fails; its table and JSON are written first), else 0.
    On the fly the objects fill during the whole run and their steps take the plan's path (fall-back
    `filling`): those rows are warned about, not failed."""
    under = [r for r in rows if r.get("fast_path_under_99") and r["group"] in FAIL_GROUPS]
    if under:
        print(f"bench/peers: FAILED: the fast path served under {FAST_SHARE_MIN * 100:.0f}% of the steps of "
              f"{', '.join(r['loader'] + ' (' + r.get('workload', 'single') + ')' for r in under)} "
              "(the WARNING lines above)", file=sys.stderr)
        return 1
    return 0


FAIL_GROUPS = ("pre-tokenized",)  # the groups whose fast-path share decides `verdict`


def run_workload(workload: str, folder: Path, args: argparse.Namespace, loaders: list,
                 status: dict[str, str | None], rounds: int) -> tuple[list[dict], dict, dict, int]:
    """Prepare `workload`'s corpus in `folder`, each peer's own data, and run the rounds; (rows, runs by
    loader, the corpus's paths, micro-batches per job)."""
    print(f"bench/peers: preparing the {workload} corpus under {shown(folder)}", flush=True)
    paths = corpus.prepare(folder, mb=50, vocab=32000,
                           workload=workload)
    if args.batches == "corpus":
        batches = corpus_batches(paths)
        print(f"bench/peers: the whole corpus once is {batches} micro-batches", flush=True)
    else:
        batches = int(args.batches) if args.batches else 150
    runnable = []
    for label, group, peer, script, extra in loaders:
        if status.get(label) is None and extra.get("prepare"):
            # The peer's own pre-tokenized format, written once per corpus; not timed.
            print(f"bench/peers: preparing {label}'s data", flush=True)
            scratch = Path(tempfile.mkdtemp(prefix="peers-prep-"))
            cfg = {**job_config(label, extra, paths, batches, scratch), "prepare_only": True}
            prep = run_job_raw(venvs.python_of(peer), script, cfg, 1800.0)
            shutil.rmtree(scratch, ignore_errors=True)
            if prep is not None:
                status[label] = f"prepare failed: {prep}"
        if status.get(label) is None:
            runnable.append((label, group, peer, script, extra))
    results: dict[str, list[dict]] = {spec[0]: [] for spec in runnable}
    # The daemon's compiled kernel (docs/logical.md) built first, as on a node that ran sluice before (the first run
    # ever compiles it, ~16 s of one core in a child: the module every later run loads at its first call).
    trees = {extra.get("repo", str(REPO)) for label, _, _, _, extra in runnable if label.startswith("sluice")}
    for repo in sorted(trees):
        warm = subprocess.run([sys.executable, "-m", "sluice.loaderd.physical.jitload"], capture_output=True,
                              env=base_env({"repo": repo}), cwd=repo, timeout=600)
        if warm.returncode != 0:
            print(f"bench/peers: note: {repo}: the compiled kernel did not load; it runs on numpy", flush=True)
    floors: list[float] = []
    run_rounds(rounds, runnable, results, paths, batches, args.timeout, args.client_timeout, floors)
    rows = summarize(results, status, loaders, workload)
    add_ceilings(rows, floors, batches)
    return rows, results, paths, batches


def time_start_floor(timeout_s: float) -> float | None:
    """Wall seconds from launching a process to the end of its `import torch`, as every job imports torch before
    its loader (common.py; the e2e clock runs from launch to the last micro-batch, exit excluded): the part of
    each job's end-to-end time no loader can take away; None if it failed."""
    launched = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", "import time, torch; print(time.time())"], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    try:
        return float(proc.stdout.split()[-1]) - launched if proc.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def add_ceilings(rows: list[dict], floors: list[float], batches: int) -> None:
    """Each row's end-to-end ceiling at its own steady rate: its tokens delivered at that rate after the start
    floor (`time_start_floor`, median of the rounds). An e2e ratio target above ceiling / peer's e2e cannot be
    met by a faster loader of the same steady rate, only by a faster steady rate or a shorter start."""
    if not floors:
        return
    floor = statistics.median(floors)
    tokens = batches * 8 * 2048
    for row in rows:
        row["start_floor_s"], row["delivered_tokens"] = floor, tokens
        rate = row.get("tokens_per_s")
        if rate:
            row["e2e_ceiling_tokens_per_s"] = tokens / (floor + tokens / rate)


def speed_extras() -> dict[str, str | None]:
    """The optional speed-ups sluice's jobs run with (this interpreter's), by version, None where absent: without
    them the same code is slower (the stdlib JSON for headers and states), so a figure says what it had."""
    from importlib.metadata import PackageNotFoundError, version

    got: dict[str, str | None] = {}
    for name in ("msgspec", "tiktoken", "numba"):
        try:
            got[name] = version(name)
        except PackageNotFoundError:
            got[name] = None
    return got


def corpus_batches(paths: dict) -> int:
    """Micro-batches in one pass over the corpus: its tokens (from the pre-tokenized shards) plus one eos per
    document, over MICRO x SEQ; every loader packs the same documents the same way."""
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard

    derived = load_manifest(paths["derived"])
    shards = [open_shard(derived.resolve(o.location)) for s in derived.sources for o in s.objects]
    tokens = sum(int(sh.header["n_tokens"]) + sh.n_docs for sh in shards)
    return tokens // (8 * 2048)


def run_rounds(rounds: int, runnable: list, results: dict, paths: dict, batches: int, timeout_s: float,
               client_timeout_s: float | None, floors: list[float]) -> None:
    """Round-robin: every loader once per round, so slow swings of the machine's load hit all alike; the start
    floor (`time_start_floor`) once a round, appended to `floors`."""
    for rnd in range(rounds):
        floor = time_start_floor(timeout_s)
        if floor is not None:
            floors.append(floor)
            print(f"  round {rnd + 1}/{rounds} start floor (python -c 'import torch'): {floor:.2f} s", flush=True)
        for label, _, peer, script, extra in runnable:
            scratch = Path(tempfile.mkdtemp(prefix="peers-job-"))
            try:
                cfg = job_config(label, extra, paths, batches, scratch, client_timeout_s)
                python = venvs.python_of(peer) if peer else Path(sys.executable)
                out = run_job(python, script, cfg, timeout_s)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            results[label].append(out)
            shown = out.get("error") or (f"{out['tokens_per_s'] / 1e6:.2f} M tok/s, first {out['first_batch_s']:.2f} s"
                                         + (f", restore {out['restore_s']:.3f} s" if out.get("restore_s") else "")
                                         + (f", on the running daemon {out['restore_running_s']:.3f} s"
                                            if out.get("restore_running_s") else ""))
            print(f"  round {rnd + 1}/{rounds} {label}: {shown}", flush=True)


def run_sweep(sizes: list[int], work: Path, timeout_s: float, client_timeout_s: float | None,
              orders: list[str]) -> list[dict]:
    """sluice's first batch from process start for one generated jsonl object per size (cold node cache)."""
    sweep = []
    for mb, order in ((mb, order) for mb in sizes for order in orders):
        manifest, runspec = corpus.one_object(work, mb, order)
        scratch = Path(tempfile.mkdtemp(prefix="peers-sweep-"))
        try:
            cfg = {"manifest": manifest, "runspec": runspec, "cache": str(scratch / "cache"), "batches": 3,
                   "repo": str(REPO), "work": str(scratch), "variant": "onfly", "client_timeout_s": client_timeout_s}
            out = run_job(Path(sys.executable), "sluice_job.py", cfg, timeout_s)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        sweep.append({"object_mb": mb, "order": order,
                      **{k: out.get(k) for k in ("first_batch_s", "restore_s", "error")}})
        shown = out.get("error") or f"first batch {out['first_batch_s']:.2f} s"
        print(f"  sweep {mb} MB object, order {order}: {shown}", flush=True)
    return sweep


if __name__ == "__main__":
    sys.exit(main())
