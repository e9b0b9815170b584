"""`sluice preflight MANIFEST RUN --tokens-per-step N --step-seconds S`: will this node feed the run?

Before a run gets its allocation: every object reachable with its recorded
size (stat / HEAD, nothing downloaded), the node cache's integrity
(`--cache`), the tokenizer's identity and backend, the metrics port; then
the rate this node delivers for the run spec, measured on the fly and from
tokens for a bounded time in a scratch node cache, against R_req = N / S
tokens per second: keeps up or not, the margin, and what to do if not.
`--canary` also runs a few steps through a real loaderd, kills it (SIGKILL),
restores a new one from the cursor and checks the stream goes on exactly as
`sluice plan` computes it.

Exit status: 0 every check passed and the node keeps up; 1 a check failed
(named); 4 the checks passed but the node does not keep up; 2 bad input.
Reference: docs/preflight.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from sluice.cliargs import ranged

EXIT_CHECK_FAILED = 1
EXIT_SLOW = 4  # the checks passed, the node does not deliver R_req


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("preflight", help="check a node before a run: objects, cache, tokenizer, metrics, "
                              "and whether it keeps up with N tokens every S seconds",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest", metavar="MANIFEST", help="frozen manifest.json")
    p.add_argument("run", metavar="RUN", help="run spec (TOML)")
    p.add_argument("--tokens-per-step", type=ranged(int, 1, 1 << 53, "--tokens-per-step"), required=True,
                   metavar="N", help="tokens the run trains on per optimizer step (all replicas this node feeds)")
    p.add_argument("--step-seconds", type=ranged(float, 0, 86_400, "--step-seconds", low_open=True), required=True,
                   metavar="S", help="seconds one optimizer step takes")
    p.add_argument("--cache", metavar="DIR", help="the run's node cache: verified (damaged objects quarantined), "
                   "and whether it holds the tokens decides the path quoted (default: not checked)")
    p.add_argument("--canary", action="store_true",
                   help="also run a few steps through a real loaderd, kill -9 it, restore a new one, compare")
    p.add_argument("--canary-steps", type=ranged(int, 1, 1000, "--canary-steps"), default=3, metavar="K",
                   help="steps before and after the kill (default 3)")
    p.add_argument("--seconds", type=ranged(float, 0, 3600, "--seconds", low_open=True), default=10.0,
                   help="the longest each measurement phase runs (default 10)")
    p.add_argument("--max-steps", type=ranged(int, 2, 1 << 20, "--max-steps"), default=2000,
                   help="the most steps each measurement phase makes (default 2000)")
    p.add_argument("--workers", type=ranged(int, 1, 1024, "--workers"), default=2,
                   help="read/decode/tokenize workers, as loaderd --workers (default 2)")
    p.add_argument("--metrics-port", type=ranged(int, 0, 65535, "--metrics-port"), default=0,
                   help="the port the run's loaderd will serve metrics on (default 0: any free port)")
    p.add_argument("--allow-root", action="append", metavar="ROOT",
                   help="a folder or s3://bucket/prefix/ object locations may lie within, as loaderd --allow-root")
    p.add_argument("--timeout", type=ranged(float, 0, 86_400, "--timeout", low_open=True), default=120.0,
                   help="the longest wait for the object checks, a daemon's start or one batch (default 120)")
    p.add_argument("--scratch", metavar="DIR", help="folder for the scratch node caches (default: a temporary "
                   "folder, removed after)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from sluice.manifest.model import load_manifest
    from sluice.preflight.checks import check_cache, check_metrics, check_objects, check_tokenizer
    from sluice.runspec import load_runspec

    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.run)
    spec.check_seq_len(manifest.packing.seq_len, f"run spec {args.run}")
    if args.scratch and not os.path.isdir(args.scratch):
        from sluice.errors import SpecError

        raise SpecError(f"preflight: --scratch {args.scratch} is not a folder")
    checks = [check_objects(manifest, args.allow_root, args.timeout), check_cache(args.cache, manifest),
              check_tokenizer(manifest), check_metrics(args.metrics_port)]
    required = args.tokens_per_step / args.step_seconds
    rates = verdict = None
    blocked = [c.name for c in checks if c.failed and c.name in ("objects", "tokenizer")]
    if not blocked:
        with tempfile.TemporaryDirectory(prefix="sluice-preflight-", dir=args.scratch) as scratch:
            rates, verdict, more = _measure(args, manifest, spec, scratch, required, checks)
            checks += more
    code = 0 if verdict is not None and verdict.keeps_up else EXIT_SLOW
    if any(c.failed for c in checks):
        code = EXIT_CHECK_FAILED
    obj = {"ok": code == 0, "exit_code": code, "manifest": args.manifest, "run": args.run,
           "dataset_id": manifest.dataset_id, "tokens_per_step": args.tokens_per_step,
           "step_seconds": args.step_seconds, "required_tokens_per_s": round(required, 3),
           "checks": [c.to_obj() for c in checks], "rates": None if rates is None else rates.to_obj(),
           "verdict": None if verdict is None else verdict.to_obj(),
           "not_measured": f"the {' and '.join(blocked)} check failed" if blocked else None}
    if args.json:
        print(json.dumps(obj, sort_keys=True))
    else:
        from sluice.preflight.table import lines

        print("\n".join(lines(obj, spec_tokens=spec.global_batch * manifest.packing.seq_len)))
    sys.stdout.flush()
    return code


def _measure(args: argparse.Namespace, manifest: Any, spec: Any, scratch: str, required: float,
             checks: list[Any]) -> tuple[Any, Any, list[Any]]:
    """The rates and verdict (and the canary's Check with --canary), in the scratch folder."""
    from sluice.cache.roots import roots_for
    from sluice.errors import SluiceError
    from sluice.preflight.checks import Check
    from sluice.preflight.rate import measure
    from sluice.preflight.verdict import decide

    more: list[Any] = []
    try:
        rates = measure(manifest, spec, os.path.join(scratch, "measure"), seconds=args.seconds,
                        max_steps=args.max_steps, workers=args.workers,
                        allowed_roots=roots_for(manifest, args.allow_root))
    except SluiceError as exc:  # what would stop the daemon at start (a refused order, ...)
        return None, None, [Check("rate", "fail", "the data path did not open: loaderd would not start",
                                  (str(exc),))]
    held = next((c.details for c in checks if c.name == "cache" and c.status != "skip"), {})
    verdict = decide(rates, required, pretokenized=all(s.format == "tokens" for s in manifest.sources),
                     tokens_cached=bool(held) and held["tokens_cached"] == held["text_objects"],
                     manifest=args.manifest, cache=args.cache)
    if args.canary:
        from sluice.preflight.canary import run_canary

        roots = tuple(a for root in args.allow_root or () for a in ("--allow-root", root))
        more.append(run_canary(args.manifest, args.run, manifest, spec, os.path.join(scratch, "canary"),
                               steps=args.canary_steps, timeout_s=args.timeout, daemon_args=roots))
    return rates, verdict, more
