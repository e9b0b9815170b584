"""Lazy package exports (PEP 562): a package names its public objects, each
imported from its module on first use, so importing the package (as the
`sluice` CLI does for every component) costs nothing until they are used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """(`__getattr__`, `__all__`) for `package`, whose name -> module map is `exports`."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__, sorted(exports)
