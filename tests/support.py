"""Plain helpers shared by test modules (import as `from support import ...`)."""

from __future__ import annotations

from pathlib import Path


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
