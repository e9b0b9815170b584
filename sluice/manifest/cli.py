"""`sluice manifest {freeze,verify,show,diff}`.

Exit codes: 0 success; 1 `verify` found problems or `diff` found differences;
2 bad input (any SluiceError, printed as `sluice: error: ...`); 3 a bug in
sluice (one line, see sluice.cli); 130 interrupted. Human output escapes
control characters a manifest's strings may hold (`terminal_safe`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

# Characters a manifest may hold in names, notes and locations that a terminal
# would act on (escape sequences, backspace) or that hide/reorder text (bidi
# overrides, zero-width): human output shows them escaped. JSON output escapes
# everything non-ASCII already.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` with control, bidi and zero-width characters written as \\xNN / \\uNNNN escapes."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)

from sluice.cliargs import ranged
from sluice.errors import SpecError
from sluice.progress import add_progress_argument, progress_wanted

MAX_THREADS = 1024  # --threads: objects hashed at once (a pool of threads, each holding one object's reader)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True))


def _freeze(args: argparse.Namespace) -> int:
    from sluice.manifest.freeze import freeze, freeze_summary

    t0 = time.perf_counter()
    notes: list[str] = []
    if args.engine == "ray":
        from sluice.engines.ray_engine import LOCAL_CPUS, freeze_ray

        manifest = freeze_ray(args.spec, args.output, address=args.address, progress=progress_wanted(args),
                              check=args.check, num_cpus=args.threads or LOCAL_CPUS, notes=notes)
    else:
        if args.address:
            raise SpecError("manifest freeze: --address names a Ray cluster; it needs --engine ray")
        if args.processes is not None and args.processes < 0:
            raise SpecError(f"manifest freeze: --processes must be 0 (threads only) or more, got {args.processes}")
        manifest = freeze(args.spec, args.output, threads=args.threads, processes=args.processes,
                          progress=progress_wanted(args), check=args.check, notes=notes)
    if args.json:
        _print_json({**freeze_summary(manifest, args.output, time.perf_counter() - t0), "notes": notes})
    else:
        for line in notes:  # how the tokenizer backend was proven or chosen
            print(f"sluice: {line}", file=sys.stderr)
        print(manifest.dataset_id)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from sluice.manifest.model import load_manifest
    from sluice.manifest.verify import verify

    report = verify(load_manifest(args.manifest), sample=args.sample, seed=args.seed, threads=args.threads)
    if args.json:
        _print_json(report.to_obj())
    else:
        for p in report.problems:
            print(terminal_safe(str(p)))
        state = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
        tok = " and the tokenizer" if report.tokenizer_checked else ""
        print(f"{report.dataset_id}: checked {report.checked} of {report.total} objects{tok}: {state}")
    return 0 if report.ok else 1


def _show(args: argparse.Namespace) -> int:
    from sluice.manifest.model import load_manifest
    from sluice.manifest.show import render, summary

    manifest = load_manifest(args.manifest)
    if args.json:
        _print_json(summary(manifest))
    else:
        print(terminal_safe(render(manifest)))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from sluice.manifest.diff import diff, render
    from sluice.manifest.model import load_manifest

    d = diff(load_manifest(args.a), load_manifest(args.b))
    if args.json:
        _print_json(d)
    else:
        print(terminal_safe(render(d)))
    return 0 if d["identical"] else 1


def register(subparsers: Any) -> None:
    """Add `manifest` and its subcommands to the top-level CLI."""
    p = subparsers.add_parser("manifest", help="freeze, verify, show and diff dataset manifests")
    sub = p.add_subparsers(dest="manifest_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])

    f = sub.add_parser("freeze", help="resolve a dataset spec into a content-addressed manifest",
                       description="Resolve every alias in SPEC to immutable objects, hash them (BLAKE3), count "
                       "records and write the manifest atomically; prints the dataset ID.")
    f.add_argument("spec", metavar="SPEC", help="dataset spec (TOML)")
    f.add_argument("-o", "--output", required=True, metavar="MANIFEST", help="manifest file to write")
    f.add_argument("--threads", type=ranged(int, 1, MAX_THREADS, "--threads"), default=None, metavar="N",
                   help="objects hashed at once on threads (default: min(8, max(2, cores)))")
    f.add_argument("--processes", type=int, default=None, metavar="N",
                   help="objects checked at once in N processes (0: threads only; default: one per core when "
                   "jsonl/webdataset objects hold at least 1 GiB, else threads); same manifest bytes either way")
    add_progress_argument(f)
    f.add_argument("--check", choices=("full", "count"), default="full",
                   help="jsonl validation: full = parse every line (default), count = count lines only (faster)")
    f.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="who hashes the objects: local threads (default) or one Ray task per object "
                   "(needs sluice[ray]; same manifest bytes; see docs/deploy.md)")
    f.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster for --engine ray (auto, ray://HEAD:10001); default: a local Ray for the call")
    f.add_argument("--json", action="store_true", help="print a JSON summary instead of the dataset ID")
    f.set_defaults(func=_freeze)

    v = sub.add_parser("verify", help="re-hash a manifest's objects; exit 1 naming each change")
    v.add_argument("manifest", metavar="MANIFEST", help="frozen manifest (manifest.json)")
    v.add_argument("--sample", type=ranged(float, 0.0, 1.0, "--sample", low_open=True), default=1.0,
                   metavar="FRACTION",
                   help="check only this fraction of objects (deterministic for a --seed)")
    v.add_argument("--seed", type=int, default=0, help="seed of the --sample choice (default 0)")
    v.add_argument("--threads", type=ranged(int, 1, MAX_THREADS, "--threads"), default=None, metavar="N",
                   help="objects re-hashed at once (default: min(8, max(2, cores)))")
    v.add_argument("--json", action="store_true", help="one JSON object")
    v.set_defaults(func=_verify)

    s = sub.add_parser("show", help="summarize a manifest")
    s.add_argument("manifest", metavar="MANIFEST", help="frozen manifest (manifest.json)")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.set_defaults(func=_show)

    d = sub.add_parser("diff", help="what changed between two manifests (exit 0 identical, 1 different)")
    d.add_argument("a", metavar="A", help="the older manifest")
    d.add_argument("b", metavar="B", help="the newer manifest")
    d.add_argument("--json", action="store_true", help="one JSON object")
    d.set_defaults(func=_diff)
