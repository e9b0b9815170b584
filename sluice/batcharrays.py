"""The arrays of a BATCH (one micro-batch), declared once: name, dtype, shape rule, digest, how each is made.

`ARRAYS` is the one list. From it come:

* the order and names of a BATCH's arrays (`wire.BATCH_ARRAYS`) and of the
  step digest (`wire.ARRAY_ORDER`: the arrays marked `digest`);
* what the producer adds to every micro-batch it makes, on both of its paths
  (`Plan.step`'s and the fast path's): the derived arrays, each computed by
  its `derive` from the packer's arrays and the rows' segments (`complete`);
* the array table of docs/protocol.md (`markdown_table`; a test checks the
  page holds exactly it, and ``python -m sluice.batcharrays docs/protocol.md``
  writes it there).

The client needs nothing per array: it decodes whatever the header lists and
hands each as a tensor (or numpy array) under its name.

A new array is one `BatchArray` here with its `derive` function (numpy on
one micro-batch; no per-token Python), the regenerated table, and a test::

    def attention_mask(micro: Micro) -> np.ndarray:
        mask = np.ones((micro.rows, micro.seq_len), dtype=np.uint8)
        for r, segs in enumerate(micro.segments or ()):  # padding follows a row's pieces
            mask[r, sum(end - start for _, start, end in segs):] = 0
        return mask

    BatchArray("attention_mask", "|u1", ROWS, "1 where the token is not padding", derive=attention_mask),

The packer's own arrays (`derive` None) are what packing writes
(logical/packing.py, the kernels' block planes): adding one of those changes
the packing code too. Derived arrays come after them, so a BATCH's existing
arrays keep their order and bytes, and they stay out of the digest unless
declared in it (a digest recorded before them stays valid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sluice import doctable
from sluice.errors import InternalError

ROWS = "rows"  # shape [micro_batch, seq_len], one item per token
PIECES = "pieces"  # shape [n], n given per micro-batch (cu_seqlens: one per piece, plus one)
SHAPES = {ROWS: "`[micro_batch, seq_len]`", PIECES: "`[segments + 1]`"}

# Per row of a micro-batch: its pieces as (sample ID, start, end) in order (`MicroBatch.segments`), padding in
# none; None where every row is full (the compiled kernel's rows).
Segments = Sequence[Sequence[tuple[str, int, int]]] | None


@dataclass(frozen=True)
class Micro:
    """What a `derive` function sees of one micro-batch: the packer's arrays (by name) and its rows' segments."""

    arrays: Mapping[str, np.ndarray]
    segments: Segments

    @property
    def rows(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.arrays["input_ids"].shape[1])


@dataclass(frozen=True)
class BatchArray:
    """One array of every BATCH.

    `dtype`: its wire dtype (one of `wire.DTYPES`); `shape`: `ROWS` or
    `PIECES`; `digest`: part of the step digest (as int32, in `ARRAYS`
    order); `derive`: None for the packer's arrays, else the function that
    computes it from a `Micro` (its result is cast to `dtype`).
    """

    name: str
    dtype: str
    shape: str
    help: str
    digest: bool = False
    derive: Callable[[Micro], np.ndarray] | None = None


ARRAYS: tuple[BatchArray, ...] = (
    BatchArray("input_ids", "<i4", ROWS, "token ids; padding is the manifest's `pad_id`", digest=True),
    BatchArray("labels", "<i4", ROWS, "targets, already shifted: `labels[i]` is the token after `input_ids[i]` in "
               "the same document; -100 = no loss (a document's last token, padding, a masked eos target)",
               digest=True),
    BatchArray("position_ids", "<i4", ROWS, "positions, restarting at 0 at every piece", digest=True),
    BatchArray("cu_seqlens", "<i4", PIECES, "offsets of the pieces in the flattened `[micro_batch * seq_len]` "
               "tokens; padding is a piece of its own (flash-attention varlen form)", digest=True),
)

NAMES = tuple(a.name for a in ARRAYS)
BY_NAME = {a.name: a for a in ARRAYS}
DIGESTED = tuple(a.name for a in ARRAYS if a.digest)
PACKED = tuple(a.name for a in ARRAYS if a.derive is None)  # the packer's: its rows' planes, then cu_seqlens
PLANES = tuple(a.name for a in ARRAYS if a.derive is None and a.shape == ROWS)  # the fast path's block planes
DERIVED = tuple(a for a in ARRAYS if a.derive is not None)


def check_declaration(arrays: Sequence[BatchArray]) -> None:
    """The declaration's own rules (checked at import: a mistake here is a bug, found before anything runs)."""
    made = [a.derive is None for a in arrays]
    if made != sorted(made, reverse=True):
        raise InternalError("batcharrays: the derived arrays must come after the packer's (a BATCH's order)")
    packer = [a.shape for a in arrays if a.derive is None]
    if packer.count(PIECES) != 1 or packer[-1] != PIECES:
        raise InternalError("batcharrays: the packer's arrays are its row planes, then cu_seqlens (`packer_micro`)")
    if len(set(a.name for a in arrays)) != len(arrays) or any(a.shape not in SHAPES for a in arrays):
        raise InternalError("batcharrays: names must be unique and shapes one of " + ", ".join(SHAPES))
    if any(np.dtype(a.dtype).str != a.dtype for a in arrays):
        raise InternalError("batcharrays: dtypes must be numpy's explicit little-endian strings ('<i4', '|u1')")


check_declaration(ARRAYS)
_CU = PACKED[-1]  # cu_seqlens


def packer_micro(planes: Iterable[np.ndarray], cu_seqlens: np.ndarray) -> dict[str, np.ndarray]:
    """The packer's arrays of one micro-batch by name, in order: `planes` (its rows' `PLANES`, in order: a
    block's ``(3, rows, seq_len)`` range) and `cu_seqlens` (made per micro-batch: once a micro-batch, so
    no loop beyond the planes')."""
    micro = dict(zip(PLANES, planes))  # (zipped as it is: unpacking a block into a tuple costs twice as much)
    micro[_CU] = cu_seqlens
    return micro


def complete(micro: dict[str, np.ndarray], segments: Segments) -> int:
    """Add every derived array to `micro` (the packer's arrays of one micro-batch), in declaration order;
    returns the bytes added. Nothing to do (and nothing computed) while none is declared."""
    if not DERIVED:
        return 0
    seen = Micro(micro, segments)
    added = 0
    for a in DERIVED:
        got = micro[a.name] = np.ascontiguousarray(a.derive(seen), dtype=a.dtype)  # type: ignore[misc]
        added += got.nbytes
    return added


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The array table of docs/protocol.md: every array in BATCH order, its dtype, shape, digest and meaning."""
    rows = ["| array | dtype | shape | in the digest | made by | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for a in ARRAYS:
        rows.append(f"| `{a.name}` | `{a.dtype}` | {SHAPES[a.shape]} | {'yes' if a.digest else 'no'} | "
                    f"{'derived' if a.derive else 'packer'} | {_cell(a.help)} |")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- batch arrays: generated from sluice/batcharrays.py by `python -m sluice.batcharrays docs/protocol.md` -->"
END = "<!-- end of batch arrays -->"


def with_table(page: str, where: str = "docs/protocol.md") -> str:
    """`page` with the text between `BEGIN` and `END` replaced by `markdown_table()`; SpecError without them."""
    return doctable.with_table(page, BEGIN, END, markdown_table(), where, "batch array table")


def main(argv: Iterable[str] | None = None) -> int:
    """Write the array table into each page named (docs/protocol.md); 2 for a page without its markers."""
    return doctable.write_tables(argv, with_table, "batcharrays")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
