"""Plain helpers shared by test modules (import as `from support import ...`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def stdlib_texts(limit: int = 200) -> list[str]:
    """Real text that exists on every machine: the standard library's own sources."""
    import json as _json  # any stdlib module gives us the folder

    root = Path(_json.__file__).resolve().parent.parent
    out = []
    for path in sorted(root.glob("*.py")):
        try:
            out.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(out) >= limit:
            break
    return out


def skip_unless_installed(module: str, reason: str) -> None:
    """Skip the calling test module (at collection) when `module` is not installed.

    Unlike pytest.importorskip this does not import `module`: a whole-module slow
    test file is still collected by the fast tier (`-m 'not slow'` deselects it only
    afterwards), and importing lightning or transformers there costs seconds of CPU
    per collection, in every pytest-xdist worker.
    """
    if importlib.util.find_spec(module) is None:
        pytest.skip(reason, allow_module_level=True)
