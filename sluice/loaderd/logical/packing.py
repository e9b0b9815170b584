"""Packing: documents become fixed-length rows, as pointers first, arrays last.

A packer only decides *pieces*: ``(ref, start, end)`` token ranges of framed
documents. Its state is a handful of such pointers (never token data), so it
serializes in a few bytes and restores in O(1). `materialize` turns a row's
pieces into arrays.

Framing: a document's tokens become ``[bos] + ids + [eos]`` per the manifest's
`separator`. Targets are pre-shifted: ``labels[i]`` is the token that follows
``input_ids[i]`` *in the same document* (-100 at a document's last token and on
padding; with ``loss_mask = "exclude_separator"`` also where the target is the
eos). A piece that continues in the next row still gets its true next token as
the last target. Position ids restart at 0 at every piece (each piece is a
segment of `cu_seqlens`), so they never exceed seq_len.

concat (seq_len 8, documents A=5, B=6, C=4 framed tokens)::

    row 0: A0 A1 A2 A3 A4 | B0 B1 B2       cu_seqlens 0 5 8   residual: B@3
    row 1: B3 B4 B5 | C0 C1 C2 C3 | D0 ..  residual: pointer into D

bestfit (seq_len 8, window 2; documents A=5, B=6, C=3): A opens bin 0, B does
not fit (3 left) and opens bin 1, C fits bin 0 exactly and closes it::

    row 0: A0..A4 | C0 C1 C2              open bins: [B]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.errors import StateError

IGNORE = -100

# A piece: (source, epoch, sample index, start, end) of a framed document.
Piece = tuple[int, int, int, int, int]
# `pull()` returns the next draw as a piece (source, epoch, index, start, end) of a framed
# document ((.., 0, framed length) for a whole document), or None when the lane's stream
# has ended.
Pull = Callable[[], "Piece | None"]


@dataclass(frozen=True)
class Framing:
    bos: int | None
    eos: int | None
    exclude_separator: bool

    def frame(self, ids: np.ndarray) -> np.ndarray:
        """Framed tokens of one document (int32): [bos] + ids + [eos] per the policy."""
        n = len(ids)
        lead = self.bos is not None
        out = np.empty(n + lead + (self.eos is not None), dtype=np.int32)
        if lead:
            out[0] = self.bos
        out[lead : lead + n] = ids
        if self.eos is not None:
            out[-1] = self.eos
        return out

    @property
    def masks_eos_target(self) -> bool:
        return self.exclude_separator and self.eos is not None

    def framed_len(self, n_ids: int) -> int:
        return n_ids + (self.bos is not None) + (self.eos is not None)

    def loss_tokens(self, framed_len: int) -> int:
        """Tokens of a framed document that carry a loss target."""
        n = max(framed_len - 1, 0)
        if self.exclude_separator and self.eos is not None and framed_len >= 2:
            n -= 1
        return n

    def loss_tokens_in(self, start: int, end: int, framed_len: int) -> int:
        """Tokens of framed range [start, end) of a `framed_len`-token document that carry a loss target.

        Summed over pieces that tile the document it equals `loss_tokens(framed_len)`:
        targets are the document's own next tokens wherever it is cut.
        """
        n = max(min(end, framed_len - 1) - start, 0)  # the last token has no target
        if self.masks_eos_target and framed_len >= 2 and start <= framed_len - 2 < end:
            n -= 1
        return n


class ConcatPacker:
    """Fill rows back to back, splitting documents; residual = one pointer."""

    kind = "concat"

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        # [source, epoch, index, offset, end]: the rest of the drawn piece; `end` is the framed
        # length for a whole document (so the pointer reads as it did before piece draws).
        self.cur: list[int] | None = None

    def next_row(self, pull: Pull) -> list[Piece] | None:
        pieces: list[Piece] = []
        fill, L = 0, self.seq_len
        while fill < L:
            if self.cur is None:
                nxt = pull()
                if nxt is None:
                    return None  # a partial final row is dropped: steps are whole
                if nxt[4] == nxt[3]:
                    continue
                self.cur = list(nxt)
            s, e, idx, off, end = self.cur
            take = min(end - off, L - fill)
            pieces.append((s, e, idx, off, off + take))
            fill += take
            off += take
            self.cur = None if off == end else [s, e, idx, off, end]
        return pieces

    def state(self) -> dict[str, Any]:
        return {"cur": list(self.cur) if self.cur else None}

    def load(self, state: dict[str, Any], where: str) -> None:
        cur = state.get("cur")
        if cur is not None and not (isinstance(cur, list) and len(cur) == 5 and all(isinstance(v, int) for v in cur)):
            raise StateError(f"{where}: concat residual {cur!r} is not [source, epoch, index, offset, end]")
        self.cur = list(cur) if cur else None

    def residual_pieces(self) -> list[Piece]:
        """The pieces the state holds (the residual), as (source, epoch, index, start, end)."""
        return [tuple(self.cur)] if self.cur else []

    def residual_refs(self) -> list[tuple[int, int, int]]:
        return [p[:3] for p in self.residual_pieces()]


class BestfitPacker:
    """No split (except documents longer than seq_len); best fit among `window` open bins.

    Under piece draws each drawn piece is placed as a document would be, so a
    document longer than `mixture.piece_tokens` is split at its pieces too.
    A document's (or piece's) framed tokens are cut into seq_len chunks that become rows of
    their own; the remainder goes to the open bin with the least room that still
    fits it (ties: the oldest bin). With no fitting bin, a new bin opens; if
    `window` bins are already open, the fullest (ties: oldest) is closed first.
    A bin that becomes exactly full is closed at once. Closed bins are served in
    closing order, padded with pad_id. At the end of the stream open bins are
    flushed oldest first.
    """

    kind = "bestfit"

    def __init__(self, seq_len: int, window: int) -> None:
        self.seq_len = seq_len
        self.window = window
        self.open: list[list[Piece]] = []
        self.fills: list[int] = []  # tokens in each open bin (kept beside `open`, not summed at each placement)
        self.pending: list[list[Piece]] = []
        self.ended = False

    @staticmethod
    def _fill(bin_: list[Piece]) -> int:
        return sum(p[4] - p[3] for p in bin_)

    def _place(self, piece: Piece) -> None:
        L = self.seq_len
        r = piece[4] - piece[3]
        best, best_room = -1, L + 1
        for i, fill in enumerate(self.fills):
            room = L - fill
            if r <= room < best_room:
                best, best_room = i, room
        if best >= 0:
            self.open[best].append(piece)
            if best_room == r:
                self.pending.append(self.open.pop(best))
                del self.fills[best]
            else:
                self.fills[best] += r
            return
        if len(self.open) >= self.window:
            fullest = self.fills.index(max(self.fills))  # (the first of equals: the oldest)
            self.pending.append(self.open.pop(fullest))
            del self.fills[fullest]
        self.open.append([piece])
        self.fills.append(r)

    def next_row(self, pull: Pull) -> list[Piece] | None:
        L = self.seq_len
        while not self.pending:
            nxt = None if self.ended else pull()
            if nxt is None:
                self.ended = True
                if not self.open:
                    return None
                self.pending.extend(self.open)
                self.open, self.fills = [], []
                break
            s, e, idx, off, end = nxt  # a whole document, or a piece of one under piece draws
            while end - off >= L:
                self.pending.append([(s, e, idx, off, off + L)])
                off += L
            if end > off:
                self._place((s, e, idx, off, end))
        return self.pending.pop(0)

    def state(self) -> dict[str, Any]:
        return {
            "open": [[list(p) for p in b] for b in self.open],
            "pending": [[list(p) for p in b] for b in self.pending],
            "ended": self.ended,
        }

    def load(self, state: dict[str, Any], where: str) -> None:
        def bins(key: str) -> list[list[Piece]]:
            value = state.get(key, [])
            out = []
            for b in value if isinstance(value, list) else [None]:
                if not isinstance(b, list) or not all(
                    isinstance(p, list) and len(p) == 5 and all(isinstance(v, int) for v in p) for p in b
                ):
                    raise StateError(f"{where}: bestfit {key} bins are not lists of [source, epoch, index, start, end]")
                out.append([tuple(p) for p in b])
            return out

        self.open = bins("open")
        self.fills = [self._fill(b) for b in self.open]
        self.pending = bins("pending")
        self.ended = bool(state.get("ended", False))

    def residual_pieces(self) -> list[Piece]:
        """The pieces the state holds (open bins, then pending rows), as (source, epoch, index, start, end)."""
        return [tuple(p) for b in self.open + self.pending for p in b]

    def residual_refs(self) -> list[tuple[int, int, int]]:
        return [p[:3] for p in self.residual_pieces()]


def make_packer(algorithm: str, seq_len: int, window: int) -> ConcatPacker | BestfitPacker:
    if algorithm == "concat":
        return ConcatPacker(seq_len)
    if algorithm == "bestfit":
        return BestfitPacker(seq_len, window)
    raise StateError(f"unknown packing algorithm {algorithm!r}")


@dataclass(frozen=True)
class Row:
    """One packed sequence: arrays plus its segments and provenance."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    seqlens: tuple[int, ...]
    segments: tuple[tuple[str, int, int], ...]


_IGNORE1 = np.array([IGNORE], dtype=np.int32)
_ARANGE = np.arange(1 << 16, dtype=np.int32)  # position ids are views of this (grown on demand)


def materialize(
    rows: list[list[Piece]],
    seq_len: int,
    pad_id: int,
    framed: Callable[[int, int, int], tuple[np.ndarray, str]],
    mask_eos_target: bool = False,
) -> list[Row]:
    """Arrays of a lane's rows, built with a few vectorized operations per block.

    `framed(s, e, idx)` gives (framed tokens, sample_id). Targets come from the
    framed tokens: the target of token j is token j + 1 of the same document,
    -100 past a document's end (and on the eos target when `mask_eos_target`).
    The returned rows are views into three [len(rows), seq_len] int32 blocks.
    """
    global _ARANGE
    if seq_len > len(_ARANGE):
        _ARANGE = np.arange(seq_len, dtype=np.int32)
    arange = _ARANGE
    tok_parts: list[np.ndarray] = []
    lab_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    piece_lens: list[int] = []
    row_fill: list[int] = []
    row_segments: list[tuple[tuple[str, int, int], ...]] = []
    masked: list[int] = []
    flat = 0
    for pieces in rows:
        segs = []
        fill = 0
        for s, e, idx, start, end in pieces:
            tokens, sample_id = framed(s, e, idx)
            total = tokens.shape[0]
            tok_parts.append(tokens[start:end])
            if end < total:
                lab_parts.append(tokens[start + 1 : end + 1])
            else:  # the document ends in this piece: its last token has no target
                lab_parts.append(tokens[start + 1 : end])
                lab_parts.append(_IGNORE1)
            if mask_eos_target and start <= total - 2 < end:
                masked.append(flat + total - 2 - start)
            n = end - start
            pos_parts.append(arange[:n])  # positions restart at every piece
            piece_lens.append(n)
            segs.append((sample_id, start, end))
            fill += n
            flat += n
        row_fill.append(fill)
        row_segments.append(tuple(segs))
    k = len(rows)
    if flat:
        tok = np.concatenate(tok_parts)
        lab = np.concatenate(lab_parts)
        pos = np.concatenate(pos_parts)
        if masked:
            lab[masked] = IGNORE
    else:
        tok = lab = pos = np.zeros(0, dtype=np.int32)
    if flat == k * seq_len:  # every row full (always so for concat): reshape, no copy
        inp2, lab2, pos2 = tok.reshape(k, seq_len), lab.reshape(k, seq_len), pos.reshape(k, seq_len)
    else:
        inp2 = np.full((k, seq_len), pad_id, dtype=np.int32)
        lab2 = np.full((k, seq_len), IGNORE, dtype=np.int32)
        pos2 = np.zeros((k, seq_len), dtype=np.int32)
        off = 0
        for r, fill in enumerate(row_fill):
            inp2[r, :fill] = tok[off : off + fill]
            lab2[r, :fill] = lab[off : off + fill]
            pos2[r, :fill] = pos[off : off + fill]
            off += fill
    out = []
    i = 0
    for r, pieces in enumerate(rows):
        seqlens = piece_lens[i : i + len(pieces)]
        i += len(pieces)
        if row_fill[r] < seq_len:
            seqlens = [*seqlens, seq_len - row_fill[r]]  # padding is its own segment
        out.append(Row(inp2[r], lab2[r], pos2[r], tuple(seqlens), row_segments[r]))
    return out
