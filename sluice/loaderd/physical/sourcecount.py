"""Tokens per source of a micro-batch, counted where the step is made and added up when it is sent.

A micro-batch's tokens belong to the documents of its pieces (padding to
none). The producer knows each piece's sample ID (``<object sample key>:<record>``)
and length; `SourceCounts` maps the key to its source once, so that the daemon
can export what each source actually served (``sluice_source_served_tokens_total``,
docs/observe.md) instead of what was drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


Counts = tuple[tuple[int, int], ...]  # (source index, tokens), sources with no token left out


class SourceCounts:
    """(source index, tokens) of a micro-batch from its pieces; one per producer (not thread-safe)."""

    def __init__(self, sample_keys: Sequence[Sequence[str]]) -> None:
        self._keys = sample_keys
        self._single = len(sample_keys) == 1
        self._of: dict[str, int] | None = None  # object sample key -> source, made on first use

    def _source(self, sid: str) -> int:
        if self._of is None:
            self._of = {k: s for s, keys in enumerate(self._keys) for k in keys}
        return self._of[sid.rpartition(":")[0]]

    def _fold(self, pieces: Iterable[tuple[str | None, int]]) -> Counts:
        got: dict[int, int] = {}
        for sid, n in pieces:
            if sid is not None and n:
                s = self._source(sid)
                got[s] = got.get(s, 0) + n
        return tuple(sorted(got.items()))

    def of_segments(self, rows: Sequence[Sequence[tuple[str, int, int]]]) -> Counts:
        """A micro-batch of the step function (`MicroBatch.segments`: per row its (sample ID, start, end))."""
        if self._single:
            n = sum(end - start for row in rows for _, start, end in row)
            return ((0, n),) if n else ()
        return self._fold((sid, end - start) for row in rows for sid, start, end in row)

    def of_tokens(self, tokens: Sequence[int]) -> Counts:
        """A micro-batch whose tokens per source are known (`tokens[s]`: the fast path's, `FusedSteps.unit`'s
        or best-fit's `row_tokens`)."""
        return tuple((s, int(n)) for s, n in enumerate(tokens) if n)
