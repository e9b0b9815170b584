"""Benchmark: process start to first batch with tokens cached, restore on a new daemon, and their floors.

Issue 9 targets: first batch <= 0.5 s from process start with tokens cached;
restore to first batch as low as the process start allows. Each job is a fresh
consumer process (``python -c``) that imports `sluice.client`, starts an
embedded daemon (`embedded_client`) and takes one micro-batch; the clock starts
in the driver before ``Popen``, as in bench/peers. Jobs, interleaved in rounds
(medians and minimums over rounds):

* ``tokcache``: the raw jsonl manifest, its tokens in the node cache
  (``sluice cache warm --tokens``);
* ``pretok``: the ``sluice tokenize pretokenize`` manifest, cache warm;
* ``restore``: in the consumer, after its first daemon served step 0..9 and
  closed, a new embedded daemon + ``reset(state after step 9)`` to its first
  micro-batch (the client already imported: what a restarted pipeline costs);
* with ``--onfly-tiktoken`` (needs ``--corpus``: its ``manifest-tiktoken.json``):
  ``onfly tiktoken, cold``, a fresh node cache per job (nothing cached: fill,
  decode, build the tiktoken encoding, tokenize step 0), and ``onfly
  tiktoken, encoding cached``, a fresh node cache holding only the built
  encoding (sluice.tokenize.fastcache; put there by the driver, untimed), as a
  restarted daemon on a node that has not tokenized these objects yet finds it;
* floors: ``python -c pass``; ``import numpy, zmq`` (what any client needs);
  the daemon's own imports (``sluice.loaderd.server`` and the data path, the
  node cache and the token cache included).

Corpus: ``--corpus DIR`` reuses a prepared bench/peers corpus
(``bench/peers/work``, 50 MB, 32k vocabulary, the figures in
docs/performance.md); without it a small one is built (Python standard
library, 4k vocabulary) in a temp folder. Python writes no bytecode when
``PYTHONDONTWRITEBYTECODE`` is set (this development machine sets it): every
process then compiles sluice's modules again, which an installed package never
does; the bench reports the variable and, with ``--bytecode``, runs with a
private ``PYTHONPYCACHEPREFIX`` instead.

Before/after: ``--baseline DIR`` runs every job and the daemon-import floor
also against another source tree of sluice (``git archive REV sluice | tar -x
-C DIR``), interleaved in the same rounds, as ``baseline: ...`` rows. Those
processes run with DIR as their working directory, so ``python -c`` (the
consumer and the daemon it spawns) imports sluice from DIR, ahead of this
checkout's editable install.

Run: ``.venv/bin/python bench/startup.py [--rounds 7] [--corpus bench/peers/work/full] [--bytecode]
[--baseline DIR] [--onfly-tiktoken]``.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent

CONSUMER = r"""
import json, sys, time
from sluice.client import embedded_client
manifest, run, cache, restore = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
c = embedded_client(manifest, run, cache_dir=cache, as_numpy=True)
mb = next(c)
first = time.time()
out = {"first": first}
if restore:
    for mb in c:
        if mb["step"] == 9 and mb["micro"] + 1 == c.info["micro_per_step"]:
            break
    state = c.state_dict_at(9)
    c.close()
    t0 = time.perf_counter()
    c = embedded_client(manifest, run, cache_dir=cache, as_numpy=True)
    c.reset(state)
    mb = next(c)
    out["restore_s"] = time.perf_counter() - t0
    assert mb["step"] == 10, mb["step"]
c.close()
print(json.dumps(out))
"""

FLOORS = {
    "python -c pass": "pass",
    "import numpy, zmq": "import numpy, zmq",
    "import the daemon": ("import sluice.loaderd.cli, sluice.loaderd.server, sluice.loaderd.physical.assemble, "
                          "sluice.cache, sluice.cache.core, sluice.runspec, sluice.manifest.model, "
                          "sluice.tokenize.tokcache"),  # what a daemon imports before its first cached batch
}


def _run(cmd: list[str], env: dict[str, str], cwd: Path = _REPO) -> tuple[float, str]:
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(cwd), timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd[:3])} failed:\n{out.stderr[-3000:]}")
    return t0, out.stdout


def small_corpus(work: Path) -> dict[str, str]:
    from sluice.cache import NodeCache  # noqa: F401  (fail early if the venv is broken)
    from sluice.demo import DATASET_SPEC, RUN_SPEC, build_corpus, stdlib_files
    from sluice.manifest.freeze import freeze
    from sluice.tokenize.pretokenize import pretokenize
    from sluice.tokenize.train import train_bpe

    train_bpe([str(p) for p in stdlib_files(60)], work / "tokenizer.json", vocab_size=4096)
    build_corpus(work, files=160, per_shard=200)
    (work / "dataset.toml").write_text(DATASET_SPEC.replace("seq_len = 128", "seq_len = 2048"))
    (work / "run.toml").write_text(RUN_SPEC)
    manifest = freeze(work / "dataset.toml", work / "manifest.json", progress=False)
    derived = pretokenize(manifest, work / "tok", workers=2, progress=False)
    cli = [sys.executable, "-m", "sluice.cli", "cache", "warm"]
    subprocess.run([*cli, str(work / "manifest.json"), str(work / "cache-tok"), "--tokens", "--budget", "8GiB",
                    "--no-progress"],
                   check=True, cwd=str(_REPO), capture_output=True)
    subprocess.run([*cli, str(derived.path), str(work / "cache-pretok"), "--budget", "8GiB", "--no-progress"],
                   check=True, cwd=str(_REPO), capture_output=True)
    return {"manifest": str(work / "manifest.json"), "derived": str(derived.path), "runspec": str(work / "run.toml"),
            "cache_tok": str(work / "cache-tok"), "cache_pretok": str(work / "cache-pretok")}


def _fresh_cache(tmp: Path, manifest: str, with_encoding: bool) -> str:
    """A new node-cache folder; with `with_encoding`, holding the manifest's built tiktoken encoding only."""
    folder = Path(tempfile.mkdtemp(prefix="cache-", dir=tmp))
    if with_encoding:
        from sluice.cache import NodeCache
        from sluice.manifest.model import load_manifest
        from sluice.tokenize import load_tokenizer
        from sluice.tokenize.fastcache import encoding_key, write_encoding

        m = load_manifest(manifest)
        enc = load_tokenizer(m.resolve(m.tokenizer.location), m.tokenizer.digest, backend="tiktoken")
        with NodeCache(folder, 8 << 30) as cache:
            cache.put_derived(encoding_key(enc.digest), lambda p: write_encoding(p, enc)).close()
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--corpus", help="a prepared bench/peers work folder (its prepared.json)")
    ap.add_argument("--bytecode", action="store_true",
                    help="let Python cache bytecode (a private PYTHONPYCACHEPREFIX), as an installed package does")
    ap.add_argument("--baseline", type=Path,
                    help="a source tree holding another sluice/ package: its jobs run in the same rounds")
    ap.add_argument("--onfly-tiktoken", action="store_true",
                    help="also the raw manifest with the tiktoken backend: cold, and with only its encoding cached")
    ap.add_argument("--out", default=str(_REPO / "bench" / "out" / "startup.json"))
    args = ap.parse_args(argv)
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory(prefix="sluice-bench-startup-")
    if args.bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp.name) / "pyc")
    with tmp:
        if args.corpus:
            paths = json.loads((Path(args.corpus) / "prepared.json").read_text())["paths"]
        else:
            paths = small_corpus(Path(tmp.name))
        jobs = {
            "tokcache": (paths["manifest"], paths["cache_tok"], "1"),
            "pretok": (paths["derived"], paths["cache_pretok"], "1"),
        }
        if args.onfly_tiktoken:
            if not args.corpus:
                raise SystemExit("bench: --onfly-tiktoken needs --corpus (a prepared bench/peers work folder)")
            tt = str(Path(args.corpus).resolve() / "manifest-tiktoken.json")
            jobs["onfly tiktoken, cold"] = (tt, "fresh", "0")
            jobs["onfly tiktoken, encoding cached"] = (tt, "encoding", "0")
        runs: dict[str, list[float]] = {}
        trees = [("", _REPO)]
        if args.baseline:
            if not (args.baseline / "sluice" / "__init__.py").is_file():
                raise SystemExit(f"bench: --baseline {args.baseline}: no sluice/__init__.py there")
            trees.append(("baseline: ", args.baseline.resolve()))
        for rnd in range(args.rounds + 1):  # round 0 warms the page cache (and the bytecode cache): not counted
            for tag, tree in trees:
                for name, (manifest, cache, restore) in jobs.items():
                    fresh = cache in ("fresh", "encoding")
                    if fresh:
                        cache = _fresh_cache(Path(tmp.name), manifest, cache == "encoding")
                    t0, out = _run([sys.executable, "-c", CONSUMER, manifest, paths["runspec"], cache, restore],
                                   env, tree)
                    if fresh:
                        shutil.rmtree(cache, ignore_errors=True)
                    got = json.loads(out.strip().splitlines()[-1])
                    if rnd:
                        runs.setdefault(f"{tag}first batch, {name}", []).append(got["first"] - t0)
                        if "restore_s" in got:
                            runs.setdefault(f"{tag}restore on a new daemon, {name}", []).append(got["restore_s"])
                for name, code in FLOORS.items():
                    if tag and name != "import the daemon":
                        continue  # the other floors do not import sluice
                    t0, _ = _run([sys.executable, "-c", code], env, tree)
                    if rnd:
                        runs.setdefault(f"{tag}floor: {name}", []).append(time.time() - t0)
    res = {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": len(v)} for k, v in runs.items()}
    meta = {"bench": "startup", "rounds": args.rounds, "baseline": str(args.baseline or ""), "corpus": args.corpus or "small (stdlib, 4k vocab)",
            "bytecode": "written" if args.bytecode or not os.environ.get("PYTHONDONTWRITEBYTECODE") else "not written",
            "load": os.getloadavg()}
    for k, v in res.items():
        print(f"{k:<50} median {v['median_s']:.3f} s   min {v['min_s']:.3f} s")
    print(f"bytecode {meta['bytecode']}; load average {meta['load'][0]:.1f}; target: first batch <= 0.5 s")
    line = json.dumps({**meta, **res})
    print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
