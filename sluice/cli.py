"""The `sluice` command: one CLI with subcommands.

Each component registers its own subcommands (`register(subparsers)` in its
`cli` module), so this file only wires them. Nothing is parsed or imported
heavily at import time; `main(argv=None) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sluice.errors import SluiceError

# Modules that contribute subcommands, in help order. Each has
# `register(subparsers: argparse._SubParsersAction) -> None` and sets
# `func=` on its parsers: `func(args) -> int`.
_REGISTRARS = (
    "sluice.manifest.cli",
    "sluice.cache.cli",
    "sluice.tokenize.cli",
    "sluice.loaderd.plan_cli",
    "sluice.loaderd.cli",
    "sluice.client.cli",
    "sluice.trainer_hooks.cli",
    "sluice.curve",
    "sluice.observe.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="sluice: exact, resumable, verified data for training runs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _REGISTRARS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # component not present in this build
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except SluiceError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sluice: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
