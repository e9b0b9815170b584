"""`sluice ckpt {list,verify,gc,drill}` and `sluice cadence`.

Every command that shows something takes --json (one JSON document on stdout).
Bad input raises a SluiceError (the top-level CLI prints it and exits 2); a
checkpoint that fails `verify` or `drill` is reported and the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from sluice.errors import CheckpointError, SluiceError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|m|min|h|d)?\s*$")


def parse_duration(text: str) -> float:
    """'90', '90s', '1.5m', '24h', '7d' -> seconds; SluiceError naming the text otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (seconds, or a number with s, m, h or d)")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def register(subparsers: Any) -> None:
    ckpt = subparsers.add_parser("ckpt", help="inspect, verify, collect and drill checkpoint folders",
                                 description="Checkpoint folders written by sluice.trainer_hooks (docs/checkpoints.md).")
    sub = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION")
    ckpt.set_defaults(func=lambda args: (ckpt.print_help(), 2)[1])

    p = sub.add_parser("list", help="list checkpoints (newest first) with step, generation, data step and size")
    p.add_argument("dir", type=Path, help="checkpoint folder")
    p.add_argument("--verify", action="store_true", help="also check every shard's size and BLAKE3")
    p.add_argument("--key-file", type=Path, default=None, help="HMAC key the run signs manifests with")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("verify", help="verify the latest checkpoint (or all with --all); exit 1 if any fails",
                       description="A checkpoint verifies when its manifest is well-formed (and signed, with "
                                   "--key-file), every listed shard has its size and BLAKE3, every key has its "
                                   "shard for each rank, and every shard loads as restore would load it (torch "
                                   "shards and DCP values without any unpickler, or with weights_only=True when "
                                   "--key-file checked the MAC; JSON shards parsed, RNG states checked, DCP "
                                   "metadata read without pickle). A checkpoint that fails is one restore skips.")
    p.add_argument("dir", type=Path, help="checkpoint folder")
    p.add_argument("--all", action="store_true", help="verify every checkpoint, not only the latest")
    p.add_argument("--key-file", type=Path, default=None,
                   help="HMAC key the run signs manifests with (CheckpointConfig.hmac_key_file)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gc", help="apply retention and delete debris (bounded; never deletes `latest`)")
    p.add_argument("dir", type=Path, help="checkpoint folder")
    p.add_argument("--keep-last", type=int, default=None,
                   help="newest checkpoints to keep (default: the run's own setting from the newest manifest, else 3)")
    p.add_argument("--keep-every", type=int, default=None,
                   help="also keep steps that are multiples of N, 0 for none (default: the run's own setting, else 0)")
    p.add_argument("--max-deletions", type=int, default=64, help="folders deleted at most in this call (default 64)")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser("drill", help="restore the latest and an older checkpoint in a scratch process; RTO and RPO")
    p.add_argument("dir", type=Path, help="checkpoint folder")
    p.add_argument("--head-step", type=int, default=None,
                   help="the trainer's newest step for RPO (default: the newest committed checkpoint)")
    p.add_argument("--key-file", type=Path, default=None,
                   help="HMAC key the run signs manifests with: a checkpoint without its MAC fails the drill")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_drill)

    p = subparsers.add_parser("cadence", help="Young's checkpoint interval and the expected waste W(T)",
                              description="T* = sqrt(2 C M); W(T) = C/T + T/(2M) + (R+D)/M. Durations in seconds "
                                          "or with a unit: 90s, 1.5m, 24h, 7d.")
    p.add_argument("--cost", required=True, type=parse_duration, help="exposed cost C of one checkpoint")
    p.add_argument("--mtbf", required=True, type=parse_duration, help="mean time between failures M")
    p.add_argument("--restore", type=parse_duration, default=0.0, help="restore time R (default 0)")
    p.add_argument("--detect", type=parse_duration, default=0.0, help="failure detection time D (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_cadence)


def _need_dir(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _status(root: Path) -> tuple[int, str | None]:
    from sluice.trainer_hooks.layout import Paths, ckpt_name
    from sluice.trainer_hooks.retention import read_latest
    from sluice.trainer_hooks.runrecord import RunRecord

    latest = read_latest(Paths(root))
    return RunRecord(root).generation(), None if latest is None else ckpt_name(*latest)


def _signer(args: argparse.Namespace) -> Any:
    from sluice.trainer_hooks.signing import Signer

    return None if args.key_file is None else Signer.from_file(args.key_file, args.dir)


def _cmd_list(args: argparse.Namespace) -> int:
    from sluice.trainer_hooks.verify import scan

    _need_dir(args.dir)
    generation, latest = _status(args.dir)
    infos = scan(args.dir, verify=args.verify, signer=_signer(args))
    if args.json:
        print(json.dumps({"dir": str(args.dir), "generation": generation, "latest": latest,
                          "checkpoints": [i.to_obj() for i in infos]}, indent=1))
        return 0
    print(f"{args.dir}: run generation {generation}, latest -> {latest or '(none)'}")
    print(f"{'':2}{'name':24} {'step':>8} {'gen':>5} {'state':10} {'size':>10} {'data step':>10}  dataset")
    for i in infos:
        state = "damaged" if i.verified is False else ("verified" if i.verified else "committed")
        if not i.committed:
            state = "incomplete"
        data = (i.manifest.data if i.manifest else None) or {}
        ds = data.get("dataset_id") or "-"
        print(f"{'*' if i.name == latest else ' ':2}{i.name:24} {i.step:>8} {i.generation:>5} {state:10} "
              f"{_fmt_bytes(i.manifest.total_bytes if i.manifest else None):>10} "
              f"{str(data.get('step', '-')) if data.get('step') is not None else '-':>10}  {ds[:19]}")
        for problem in i.problems:
            print(f"{'':4}! {problem}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from sluice.trainer_hooks.verify import check_loadable, scan, verify_one

    _need_dir(args.dir)
    _, latest = _status(args.dir)
    signer = _signer(args)
    infos = scan(args.dir, signer=signer)
    if not infos:
        raise CheckpointError(f"checkpoint folder {args.dir}: no checkpoints to verify")
    if not args.all:
        pick = next((i for i in infos if i.name == latest), None) or next((i for i in infos if i.committed), infos[0])
        infos = [pick]
    for i in infos:
        verify_one(i)
        if i.verified and i.manifest is not None:
            i.problems = check_loadable(i.path, i.manifest, signed=signer is not None)
            i.verified = not i.problems
    bad = [i for i in infos if not i.verified]
    if args.json:
        print(json.dumps({"dir": str(args.dir), "latest": latest, "ok": not bad,
                          "checkpoints": [i.to_obj() for i in infos]}, indent=1))
    else:
        for i in infos:
            print(f"{'ok ' if i.verified else 'BAD'} {i.name}" + ("" if i.verified else ": " + "; ".join(i.problems)))
    return 1 if bad else 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from sluice.trainer_hooks.retention import collect_garbage

    from sluice.trainer_hooks.verify import scan

    _need_dir(args.dir)
    newest = next((i.manifest for i in scan(args.dir) if i.manifest is not None), None)
    policy = (newest.extra.get("retention") if newest is not None else None) or {}
    keep_last = args.keep_last if args.keep_last is not None else int(policy.get("keep_last", 3))
    keep_every = args.keep_every if args.keep_every is not None else int(policy.get("keep_every", 0))
    if keep_last < 1 or keep_every < 0 or args.max_deletions < 1:
        raise CheckpointError("gc: --keep-last and --max-deletions must be >= 1, --keep-every >= 0")
    report = collect_garbage(args.dir, keep_last=keep_last, keep_every=keep_every,
                             max_deletions=args.max_deletions, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"dir": str(args.dir), "dry_run": args.dry_run, "keep_last": keep_last,
                          "keep_every": keep_every, **report.to_obj()}, indent=1))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(report.deleted)} folder(s), kept {len(report.kept)} checkpoint(s), "
              f"{report.pending} left for a later call")
        for name in report.deleted:
            print(f"  - {name}")
    return 0


def _cmd_drill(args: argparse.Namespace) -> int:
    from sluice.trainer_hooks.drill import run_drill

    results = run_drill(args.dir, head_step=args.head_step, key_file=args.key_file)
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"dir": str(args.dir), "ok": ok, "results": [r.to_obj() for r in results]}, indent=1))
    else:
        print(f"{'role':7} {'name':24} {'ok':3} {'RTO s':>8} {'wall s':>8} {'RPO steps':>9} {'tensors':>8} {'size':>10}")
        for r in results:
            rto = "-" if r.restore_s is None else f"{r.restore_s:.3f}"
            print(f"{r.role:7} {r.name:24} {'yes' if r.ok else 'NO':3} {rto:>8} {r.wall_s:>8.3f} {r.rpo_steps:>9} "
                  f"{r.tensors:>8} {_fmt_bytes(r.bytes):>10}")
            for problem in r.problems:
                print(f"  ! {problem}")
    return 0 if ok else 1


def _cmd_cadence(args: argparse.Namespace) -> int:
    from sluice.trainer_hooks.cadence import cadence_table, young_interval

    try:
        best = young_interval(args.cost, args.mtbf)
        rows = cadence_table(args.cost, args.mtbf, args.restore, args.detect)
    except SluiceError:
        raise
    if args.json:
        print(json.dumps({"cost_s": args.cost, "mtbf_s": args.mtbf, "restore_s": args.restore,
                          "detect_s": args.detect, "young_interval_s": best,
                          "table": [r.to_obj() for r in rows]}, indent=1))
        return 0
    print(f"Young's interval T* = sqrt(2 * {args.cost:g} s * {args.mtbf:g} s) = {best:.1f} s ({best / 60:.1f} min)")
    print(f"{'interval':>12} {'seconds':>12} {'W(T)':>9}")
    for r in rows:
        print(f"{r.label:>12} {r.interval_s:>12.1f} {100 * r.waste:>8.3f}%")
    return 0
