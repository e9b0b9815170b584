"""The `sluice` command: one CLI with subcommands.

Each component registers its own subcommands (`register(subparsers)` in its
`cli` module), so this file only wires them. Nothing is parsed or imported
heavily at import time; `main(argv=None) -> int`.

Exit codes: 0 success; 1 a check found problems (verify, diff); 2 bad input
(`sluice: error: ...`, any SluiceError, or an argparse usage error); 3 a bug in
sluice (an unexpected exception, reported in one line, never a traceback);
4 `sluice preflight`: the checks passed but the node does not keep up;
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sluice.errors import InternalError, SluiceError

# Modules that contribute subcommands, in help order. Each has
# `register(subparsers: argparse._SubParsersAction) -> None` and sets
# `func=` on its parsers: `func(args) -> int`.
_REGISTRARS = (
    "sluice.manifest.cli",
    "sluice.cache.cli",
    "sluice.tokenize.cli",
    "sluice.loaderd.plan_cli",
    "sluice.loaderd.cli",
    "sluice.run_cli",
    "sluice.client.cli",
    "sluice.trainer_hooks.cli",
    "sluice.curve",
    "sluice.observe.cli",
    "sluice.preflight.cli",
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
    try:
        return _run(argv)
    except SluiceError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a command may say what it had done: KeyboardInterrupt(message)
        print(f"sluice: interrupted: {exc}" if str(exc) else "sluice: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - no command ends in a traceback
        return report_bug(exc)


def _run(argv: Sequence[str] | None) -> int:
    # Parsing imports the components: a Ctrl-C there is handled like one in the command.
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


def report_bug(exc: Exception) -> int:
    """Report an exception sluice did not expect as one line naming where it rose; exit 3.

    Set SLUICE_TRACEBACK=1 to get the full traceback instead (read at call time).
    """
    import os
    import traceback

    if os.environ.get("SLUICE_TRACEBACK") == "1":
        traceback.print_exception(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    print(
        f"sluice: error: bug in sluice: {type(exc).__name__}: {str(exc)[:500]}{where} "
        "(please report it; SLUICE_TRACEBACK=1 shows the traceback)",
        file=sys.stderr,
    )
    return InternalError.exit_code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
