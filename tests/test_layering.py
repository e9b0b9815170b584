"""Imports point one way: sluice's layers, written down as data, and the checks that hold the code to them.

`LAYERS` lists the layers bottom first (DESIGN.md "Data flow" and STYLE.md's
layout: manifest <- cache <- tokenize <- loaderd; the logical plane is pure; the
client depends only on the wire format and errors; nothing imports loaderd but
the commands). A module may import from its own group and from any lower
layer; never from a higher layer, nor from another group of its own layer
(groups of one layer are independent of each other: the client and the
trainer hooks).

A module belongs to the entry of `LAYERS` that names it or its longest
enclosing package, so a package can keep a module in a higher layer than the
rest of it (`sluice.manifest.freeze` proves the tokenizer backend, so it sits
above `sluice.tokenize`; the rest of `sluice.manifest` sits below it). Every
module must be placed: a new one fails `test_every_module_has_a_layer` until it
is written into `LAYERS`.

A private name (``_x``) is private to the module that defines it; a private
module (``_m.py``) to its package. Neither is imported, nor read as an
attribute of an imported module, anywhere else: what another module needs is
public, with a docstring that states its contract.

Every import counts: at module level, inside a function (a lazy import is still
a dependency) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent / "sluice"

# Bottom first. Each layer: (its name, its groups); each group: the modules or packages in it.
LAYERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("shared leaves", (("sluice.errors", "sluice._lazy", "sluice.fsutil", "sluice.progress", "sluice.cliargs",
                        "sluice.flatfile", "sluice.procpool", "sluice.curve", "sluice.datastate", "sluice.doctable",
                        "sluice.batcharrays", "sluice.npsets", "sluice.waits", "sluice.affinity",
                        "sluice.wire"),)),
    # The trainer's side: a rank imports these and nothing of the daemon (it reaches it over the wire).
    ("client | trainer hooks", (("sluice.client",), ("sluice.trainer_hooks",))),
    ("integrations", (("sluice.integrations",),)),
    ("manifest", (("sluice.manifest", "sluice.runspec"),)),
    ("logical plane (pure)", (("sluice.loaderd.logical",),)),
    ("cache", (("sluice.cache",),)),
    ("tokenize", (("sluice.tokenize",),)),
    # Freezing resolves and hashes sources and proves the tokenizer backend; engines run that work on Ray.
    ("preparing", (("sluice.manifest.freeze", "sluice.manifest.scan_pool", "sluice.manifest.tokenizer_ref",
                    "sluice.engines"),)),
    # What the physical plane and the server share: the daemon's metric families (the physical plane records
    # into them, the server exports them) and its options (the data path's config is made from them).
    ("daemon declarations", (("sluice.loaderd.metrics", "sluice.loaderd.metricvalues", "sluice.loaderd.options"),)),
    ("physical plane", (("sluice.loaderd.physical",),)),
    ("daemon", (("sluice.loaderd",),)),
    # Entry points: they parse arguments and compose the layers below (and each other).
    ("commands", (("sluice", "sluice.cli", "sluice.run_cli", "sluice.runprep", "sluice.runinputs", "sluice.demo",
                   "sluice.demo_train", "sluice.observe", "sluice.cache.cli", "sluice.client.cli",
                   "sluice.manifest.cli", "sluice.tokenize.cli", "sluice.trainer_hooks.cli", "sluice.loaderd.cli",
                   "sluice.loaderd.plan_cli"),)),
)


class Import(NamedTuple):
    """One imported thing: `module` (a sluice module), `name` (a name taken from it, or "" for the module)."""

    module: str
    name: str
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    """``sluice/loaderd/server.py`` -> ``sluice.loaderd.server``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under `root`, by its dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def relevant_nodes(source: str) -> list[ast.AST]:
    """The import statements and attribute reads of `source`, in one walk of its tree."""
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom, ast.Attribute))]


def imports_of(nodes: list[ast.AST], module: str, is_package: bool, known: set[str]) -> list[Import]:
    """The sluice modules and names `module` (its `relevant_nodes`) imports, relative imports resolved.

    ``from P import x`` where ``P.x`` is a module of `known` counts as importing that module.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [Import(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "sluice"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "sluice":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append(Import(sub, "", node.lineno) if sub in known else Import(target, a.name, node.lineno))
    return found


def layer_of(module: str) -> tuple[int, int] | None:
    """(layer index, group index) of the longest entry of `LAYERS` that is `module` or a package enclosing it."""
    best: tuple[int, int, int] | None = None
    for li, (_, groups) in enumerate(LAYERS):
        for gi, group in enumerate(groups):
            for entry in group:
                if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                    best = (len(entry), li, gi)
    return None if best is None else best[1:]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def layer_violations(module: str, found: list[Import]) -> list[str]:
    """Imports of `module` that go up a layer or across to another group of its layer."""
    here = layer_of(module)
    problems = []
    for imp in found:
        there = layer_of(imp.module)
        if here is None or there is None or there == here or there[0] < here[0]:
            continue
        how = "up" if there[0] > here[0] else "across"
        problems.append(f"{module}:{imp.line} imports {imp.module} ({how}: layer {LAYERS[here[0]][0]!r} "
                        f"-> {LAYERS[there[0]][0]!r})")
    return problems


def private_violations(module: str, nodes: list[ast.AST], found: list[Import], known: set[str]) -> list[str]:
    """Private names `module` takes from another module, and private modules outside their package."""
    problems = []
    for imp in found:
        if imp.name and _private(imp.name) and imp.module != module:
            problems.append(f"{module}:{imp.line} imports the private name {imp.name} of {imp.module}")
        parts = imp.module.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _private(part) and module != owner and not module.startswith(owner + "."):
                problems.append(f"{module}:{imp.line} imports the private module {imp.module}")
    # `from sluice.x import mod; mod._y` or `import sluice.x as m; m._y`: the same reach, by attribute.
    bound: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in known})
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
    for node in nodes:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr) and bound[node.value.id] != module):
            problems.append(f"{module}:{node.lineno} reads the private name {node.attr} of {bound[node.value.id]}")
    return problems


def check(modules: dict[str, Path]) -> tuple[list[str], list[str]]:
    """(layer violations, private-name violations) of every module in `modules`."""
    known = set(modules)
    layers, private = [], []
    for name, path in modules.items():
        nodes = relevant_nodes(path.read_text(encoding="utf-8"))
        found = imports_of(nodes, name, path.name == "__init__.py", known)
        layers += layer_violations(name, found)
        private += private_violations(name, nodes, found, known)
    return layers, private


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in all_modules() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS (tests/test_layering.py): {unplaced}"


@functools.cache
def _tree() -> tuple[list[str], list[str]]:
    """`check` of sluice/ itself, once for both tests that read it."""
    return check(all_modules())


def test_no_import_goes_up_a_layer() -> None:
    layers, _ = _tree()
    assert not layers, "imports against the layer order (tests/test_layering.py LAYERS):\n" + "\n".join(layers)


def test_no_private_name_crosses_a_module() -> None:
    _, private = _tree()
    assert not private, "private names used outside their module:\n" + "\n".join(private)


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """A small tree with one of each forbidden import: every one is reported, the allowed ones are not."""
    files = {
        "sluice/__init__.py": "",
        "sluice/_lazy.py": "",
        "sluice/errors.py": "",
        "sluice/client/__init__.py": "from sluice._lazy import x\n",
        "sluice/client/iterator.py": "from sluice.loaderd.server import Server\nfrom sluice.errors import E\n",
        "sluice/loaderd/__init__.py": "",
        "sluice/loaderd/server.py": "from sluice.loaderd.physical import producer\nfrom . import upkeep\n",
        "sluice/loaderd/upkeep.py": "",
        "sluice/loaderd/logical/__init__.py": "",
        "sluice/loaderd/logical/plan.py": "def f():\n    from ..physical.producer import StepMaker\n",
        "sluice/loaderd/physical/__init__.py": "",
        "sluice/loaderd/physical/producer.py": (
            "from sluice.loaderd.server import Server\nfrom sluice.loaderd.logical.plan import _helper\n"
            "from sluice.loaderd.logical import plan\nplan._other()\n"),
        "sluice/trainer_hooks/__init__.py": "import sluice.client\n",
        "sluice/manifest/__init__.py": "import sluice._lazy\n",
        "sluice/manifest/freeze.py": "from sluice import tokenize\n",
        "sluice/tokenize/__init__.py": "",
        "sluice/loaderd/_shared.py": "",
        "sluice/integrations/__init__.py": "from sluice.loaderd import _shared\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    layers, private = check(all_modules(tmp_path / "sluice"))
    assert sorted(v.split(" (")[0] for v in layers) == [
        "sluice.client.iterator:1 imports sluice.loaderd.server",
        "sluice.integrations:1 imports sluice.loaderd._shared",
        "sluice.loaderd.logical.plan:2 imports sluice.loaderd.physical.producer",
        "sluice.loaderd.physical.producer:1 imports sluice.loaderd.server",
        "sluice.trainer_hooks:1 imports sluice.client",
    ]
    assert sorted(private) == [
        "sluice.integrations:1 imports the private module sluice.loaderd._shared",
        "sluice.loaderd.physical.producer:2 imports the private name _helper of sluice.loaderd.logical.plan",
        "sluice.loaderd.physical.producer:4 reads the private name _other of sluice.loaderd.logical.plan",
    ]
