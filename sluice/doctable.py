"""A generated table in a docs page: the text between two marker lines, written from a declaration.

The daemon's options (loaderd/options.py) and the batch arrays
(batcharrays.py) each keep their docs table this way: a test checks the page
holds exactly the declaration's table, and ``python -m <module> PAGE`` writes
it there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from sluice.errors import SpecError


def with_table(page: str, begin: str, end: str, table: str, where: str, what: str) -> str:
    """`page` with the text between the lines `begin` and `end` replaced by `table`; SpecError naming `where`
    and `what` (the table) when the markers are missing."""
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise SpecError(f"{where}: no {what} between {begin!r} and {end!r}")
    return page[:start + len(begin)] + "\n\n" + table + "\n" + page[stop:]


def write_tables(argv: Iterable[str] | None, fill: Callable[[str, str], str], prog: str) -> int:
    """Rewrite each page named (`argv`, default the command line) with `fill(page, path)`; 2 with the error
    on stderr for a page `fill` refuses (SpecError), 0 otherwise. A page already up to date is not written."""
    for path in list(sys.argv[1:] if argv is None else argv):
        with open(path, encoding="utf-8") as f:
            page = f.read()
        try:
            new = fill(page, path)
        except SpecError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        if new != page:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    return 0
