"""Best-fit packing (`packing.BestfitPacker`), held to its rules as the docstring states them.

Specification (a model written from the rules alone, below): a drawn piece's
framed tokens are cut into seq_len chunks, each a row of its own; the
remainder goes to the open bin with the least room that still fits it (ties:
the oldest); with none, a new bin opens, after the fullest open bin (ties: the
oldest) is closed when `window` are open; a bin that becomes exactly full is
closed at once; closed bins are served in closing order; at the end of the
stream the open bins are flushed oldest first. A packer restored from its
`state()` at any row goes on with the same rows.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.loaderd.logical.packing import BestfitPacker


def model_rows(pieces: list[tuple[int, ...]], L: int, window: int) -> list[list[tuple[int, ...]]]:
    """Every row best-fit makes of `pieces` (the rules, nothing kept between placements but the bins)."""
    open_bins: list[list[tuple[int, ...]]] = []
    rows: list[list[tuple[int, ...]]] = []

    def fill(b: list[tuple[int, ...]]) -> int:
        return sum(p[4] - p[3] for p in b)

    for s, e, idx, off, end in pieces:
        while end - off >= L:
            rows.append([(s, e, idx, off, off + L)])
            off += L
        if end == off:
            continue
        piece, size = (s, e, idx, off, end), end - off
        fits = [i for i, b in enumerate(open_bins) if L - fill(b) >= size]
        if fits:
            best = min(fits, key=lambda i: (L - fill(open_bins[i]), i))
            open_bins[best].append(piece)
            if fill(open_bins[best]) == L:
                rows.append(open_bins.pop(best))
            continue
        if len(open_bins) >= window:
            fullest = max(range(len(open_bins)), key=lambda i: (fill(open_bins[i]), -i))
            rows.append(open_bins.pop(fullest))
        open_bins.append([piece])
    return rows + open_bins


def drain(packer: BestfitPacker, pieces: list[tuple[int, ...]], restore_at: set[int]) -> list[list[tuple]]:
    """The packer's rows pulled from `pieces` until it runs dry, restored from its own state after the rows in
    `restore_at`."""
    it = iter(pieces)
    rows = []
    while True:
        row = packer.next_row(lambda: next(it, None))
        if row is None:
            return rows
        rows.append(row)
        if len(rows) in restore_at:
            state = packer.state()
            packer = BestfitPacker(packer.seq_len, packer.window)
            packer.load(state, "test")


@settings(max_examples=300, deadline=None)
@given(L=st.sampled_from([4, 8, 16, 2048]), window=st.integers(1, 8),
       sizes=st.lists(st.integers(0, 40), max_size=60), restore_at=st.sets(st.integers(1, 40), max_size=4))
def test_bestfit_rows_follow_the_rules_and_survive_a_restore(L, window, sizes, restore_at):
    scale = 1 if L < 2048 else 128
    pieces = [(i % 3, 0, i, 0, n * scale) for i, n in enumerate(sizes)]
    assert drain(BestfitPacker(L, window), pieces, restore_at) == model_rows(pieces, L, window)


def test_the_docstring_example():
    """seq_len 8, window 2; documents A=5, B=6, C=3: A opens bin 0, B opens bin 1, C fills bin 0 exactly."""
    a, b, c = (0, 0, 0, 0, 5), (0, 0, 1, 0, 6), (0, 0, 2, 0, 3)
    assert drain(BestfitPacker(8, 2), [a, b, c], set()) == [[a, c], [b]]
