"""`sluice run PATH... --tokenizer T --seq-len N --micro-batch M --global-batch G`: files to a serving daemon.

The command-line form of `sluice.stream` (sluice/runprep.py): freezes the
files into WORKDIR/manifest.json (reusing it while the files are unchanged),
writes WORKDIR/dataset.toml and WORKDIR/run.toml, then runs the node daemon
(`loaderd`) on them in the foreground, with the data folders as its allowed
roots. The daemon's first stdout line is its JSON announcement (endpoint,
run and dataset IDs), as `loaderd` prints it; what was prepared goes to
stderr. `--prepare-only` stops after the files are written and prints them
(`--json`: one object). Trainers connect with `Client(endpoint, ...)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sluice.cliargs import ranged


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="freeze files, write the run spec and serve them (sluice.stream)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="folder, glob or file of jsonl (.gz/.zst) and parquet data (repeatable)")
    p.add_argument("--tokenizer", required=True, metavar="FILE|train",
                   help="a tokenizer.json, or 'train' to train a byte-level BPE offline from the data files "
                        "that `sluice tokenize train` reads")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per packed sequence")
    p.add_argument("--micro-batch", type=int, required=True, help="sequences per micro-batch of one replica")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--text-field", default="text", help="JSON field / parquet column of the text (default: text)")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="folder for dataset.toml, manifest.json, run.toml (default: .sluice/ in the data's folder)")
    p.add_argument("--cache", default=None, metavar="DIR", help="node cache folder (default: WORKDIR/cache)")
    p.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    p.add_argument("--lanes", type=int, default=None, help="logical lanes (default gcd(global batch, 64))")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel size R the daemon serves (default 1)")
    p.add_argument("--order", default="global", help="global | block | none (default global)")
    p.add_argument("--max-steps", type=int, default=0, help="steps in the run (default 0: unbounded)")
    p.add_argument("--unit", default="documents", help="mixture unit: documents | tokens | loss_tokens | sequences")
    p.add_argument("--eos", default="auto",
                   help="end-of-document token string, 'auto' (the tokenizer's <|endoftext|>, </s>, ...) or 'none'")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of --tokenizer train (default 8192)")
    p.add_argument("--run-id", default="stream", help="run ID (default: stream)")
    p.add_argument("--prepare-only", action="store_true", help="write the files and stop; do not start the daemon")
    p.add_argument("--json", action="store_true", help="with --prepare-only: print one JSON object")
    p.add_argument("--endpoint", default=None, help="daemon endpoint (default: ipc socket in a private folder)")
    p.add_argument("--endpoint-file", default=None, help="write the bound endpoint to this file (0600)")
    p.add_argument("--metrics-port", type=ranged(int, 0, 65535, "--metrics-port"), default=None,
                   help="Prometheus metrics port (0: any free port)")
    p.add_argument("--cache-budget", default="8GiB", help="node cache byte budget (default 8GiB)")
    p.set_defaults(func=_run)


def _lines(prepared: Any) -> list[str]:
    return [
        prepared.dataset_id,
        f"manifest  {prepared.manifest}{'  (reused: files unchanged, nothing hashed)' if prepared.reused else ''}",
        f"dataset   {prepared.dataset_spec}",
        f"run spec  {prepared.runspec}",
        f"tokenizer {prepared.tokenizer}",
        f"cache     {prepared.cache_dir}",
        f"sources   {', '.join(prepared.sources)}",
    ]


def _run(args: argparse.Namespace) -> int:
    from sluice.runprep import prepare

    prepared = prepare(
        args.paths, tokenizer=args.tokenizer, seq_len=args.seq_len, micro_batch=args.micro_batch,
        global_batch=args.global_batch, text_field=args.text_field, workdir=args.workdir, cache_dir=args.cache,
        seed=args.seed, lanes=args.lanes, replicas=args.replicas, order=args.order, run_id=args.run_id,
        max_steps=args.max_steps, unit=args.unit, eos=None if args.eos == "none" else args.eos,
        vocab_size=args.vocab_size,
    )
    if args.prepare_only:
        print(json.dumps(prepared.to_obj(), sort_keys=True) if args.json else "\n".join(_lines(prepared)))
        return 0
    print("\n".join(_lines(prepared)), file=sys.stderr)
    from sluice.loaderd.cli import main as loaderd_main

    argv = [str(prepared.manifest), str(prepared.runspec), "--cache", str(prepared.cache_dir),
            "--cache-budget", args.cache_budget, "--replicas", str(args.replicas), *prepared.daemon_args]
    for flag, value in (("--endpoint", args.endpoint), ("--endpoint-file", args.endpoint_file),
                        ("--metrics-port", args.metrics_port)):
        if value is not None:
            argv += [flag, str(value)]
    sys.stdout.flush()
    return loaderd_main(argv)
