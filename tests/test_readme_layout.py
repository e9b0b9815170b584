"""README's layout section names every module of the package, and nothing that is not there.

Specification (issue 25, "README's layout section matches the tree"): the first fenced block under
"## Layout" in README.md lists, per package line (`manifest/`, `loaderd/physical/`, ...; the leaves of
`sluice/` itself on lines that do not end in `/`), the modules of that folder by file stem, with
`__init__` left out. A module added, moved or removed without its line failing here keeps the
README true as the tree changes.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sluice"


def layout_block(readme: str) -> str:
    """The first fenced block after the '## Layout' heading; AssertionError naming what is missing."""
    head = readme.find("\n## Layout\n")
    assert head >= 0, "README.md has no '## Layout' section"
    match = re.search(r"^```[^\n]*\n(.*?)^```", readme[head:], re.MULTILINE | re.DOTALL)
    assert match, "README.md's layout section has no fenced block"
    return match.group(1)


def listed_modules(block: str) -> dict[str, set[str]]:
    """{folder relative to sluice/ ('' for the top), module stems} read from the layout block.

    After the `sluice/` line, a line indented by two spaces starts an entry: a label, two or more spaces,
    then module stems. A label ending in '/' is a package (`loaderd/physical/`); any other label
    (`shared leaves`) names modules of `sluice/` itself. A line indented by ten or more spaces continues
    the entry above. Within an entry, `group: a b; other: c` names a, b and c, and parentheses are notes.
    The first line not indented ends the package part.
    """
    found: dict[str, set[str]] = {}
    current = ""
    for line in block.splitlines()[1:]:
        if not line.startswith("  "):
            break  # deploy/, tests/ ...: outside the package
        if line.startswith(" " * 10):
            words = line
        else:
            label, _, words = line.strip().partition("  ")
            current = label.rstrip("/") if label.endswith("/") else ""
        words = re.sub(r"\([^)]*\)", " ", words)
        for part in words.split(";"):
            found.setdefault(current, set()).update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", part.split(":")[-1]))
    return found


def actual_modules() -> dict[str, set[str]]:
    """{folder relative to sluice/, module stems} of the package as it is on disk (no __init__)."""
    tree: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" in path.parts or path.stem == "__init__":
            continue
        folder = path.parent.relative_to(PACKAGE).as_posix()
        tree.setdefault("" if folder == "." else folder, set()).add(path.stem)
    return tree


def test_the_layout_parser_reads_packages_continuations_and_leaves():
    block = ("sluice/      header\n  shared leaves   errors wire\n  cache/   store core\n"
             "               fill budget\n  loaderd/logical/   pure: order plan; fast: walk\n"
             "  engines/   ray_engine (sluice[ray])\ndeploy/ x\n")
    assert listed_modules(block) == {"": {"errors", "wire"}, "cache": {"store", "core", "fill", "budget"},
                                     "loaderd/logical": {"order", "plan", "walk"}, "engines": {"ray_engine"}}


def test_readme_layout_names_every_module_and_only_those():
    listed = listed_modules(layout_block((ROOT / "README.md").read_text(encoding="utf-8")))
    actual = actual_modules()
    problems = []
    for folder in sorted(set(listed) | set(actual)):
        where = f"sluice/{folder}/" if folder else "sluice/"
        missing = sorted(actual.get(folder, set()) - listed.get(folder, set()))
        if missing:
            problems.append(f"{where}: {missing} not in README.md's layout")
        if folder not in actual:
            problems.append(f"{where}: listed in README.md's layout, but no such package")
    stale = sorted((f"sluice/{f}/{m}.py" if f else f"sluice/{m}.py")
                   for f, names in listed.items() for m in names if f in actual and m not in actual[f])
    if stale:
        problems.append(f"named in README.md's layout but not in the tree: {stale}")
    assert not problems, "README.md's layout differs from the tree:\n" + "\n".join(problems)

