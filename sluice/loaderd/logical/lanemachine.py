"""One lane's draws and rows of a step, document by document: `LaneMachine`, what `Plan.step` drives.

For every lane the `LaneMachine` repeats: pick a source (mixture), take the
lane's next position of that source's epoch order, frame the document and give
it to the packer, until the packer yields a row. With piece draws
(`mixture.piece_tokens` = B, token units) a pick takes at most B framed tokens:
the next piece of the source's open document if it has one (its cursor's
`open` offset), else the first piece of its next document; the packer gets
pieces ``(source, epoch, index, start, end)`` either way. Exhaustion rules
(`repeat`, `renormalize`, `stop`, `fail`) apply when a source's share of an
epoch is taken. This is the reference the fast path (`fusedmix`,
`fusedbins`, the compiled kernels) is held to.

Token data enters only through the `docs` callback (`plan.DocTokens`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sluice.datastate import CUR_ACTIVE, CUR_DOCS, CUR_EPOCH, CUR_LOSS_TOKENS, CUR_OPEN, CUR_ROWS, CUR_TAKEN
from sluice.datastate import CUR_TOKENS
from sluice.errors import EndOfStream, ExhaustedError, StateError
from sluice.loaderd.logical.mixture import categorical_pick, quota_pick
from sluice.loaderd.logical.packing import Row, make_packer, materialize
from sluice.loaderd.logical.state import LaneState, SourceCursor

if TYPE_CHECKING:
    from sluice.loaderd.logical.plan import DocTokens, Plan


class LaneMachine:
    """Mutable working copy of one lane's state while a step is computed."""

    def __init__(self, plan: Plan, lane: int, state: LaneState, docs: DocTokens, cache: dict) -> None:
        self.plan = plan
        self.lane = lane
        self.docs = docs
        self.cache = cache  # (s, e, idx) -> (framed tokens, sample_id), for this step
        self.draws = state.draws
        self.rows = state.rows
        self.cursors = [c.to_list() for c in state.sources]  # a fresh list per cursor
        self.shares = plan.lane_shares(lane)
        m = plan.manifest
        self.packers = {}
        for key in plan.packer_keys:
            p = make_packer(m.packing.algorithm, m.packing.seq_len, m.packing.window)
            if key in state.packers:
                p.load(state.packers[key], f"lane {lane} packer {key}")
            self.packers[key] = p
        self.rng = plan.rng(lane)
        self._wraps: dict[int, int] = {}  # source -> the lane's tokens at its last `repeat` wrap (_check_progress)

    # -- documents ---------------------------------------------------------
    def framed(self, s: int, e: int, idx: int) -> tuple[np.ndarray, str]:
        key = (s, e, idx)
        hit = self.cache.get(key)
        if hit is None:
            ref = self.plan.ref(s, e, idx)
            hit = (self.plan.framing.frame(self.docs(ref)), ref.sample_id)
            self.cache[key] = hit
        return hit

    def _advance(self, s: int) -> int | None:
        """Sample index of source s's next document for this lane (cursor moved past it), applying its
        exhaustion rule: None when the source just became inactive; EndOfStream / ExhaustedError for
        `stop` / `fail`."""
        plan = self.plan
        c = self.cursors[s]
        share = self.shares[s]
        if c[CUR_TAKEN] >= share:
            rule = plan.manifest.sources[s].exhaustion
            name = plan.manifest.sources[s].name
            if rule == "repeat" and share > 0:
                self._check_progress(s, share)
                c[CUR_EPOCH] += 1
                c[CUR_TAKEN] = 0
            elif rule in ("renormalize", "repeat"):
                c[CUR_ACTIVE] = 0  # repeat with an empty share behaves as renormalize
                return None
            elif rule == "stop":
                raise EndOfStream(f"source {name!r} exhausted in lane {self.lane} (epoch {c[CUR_EPOCH]}, rule stop)")
            else:
                raise ExhaustedError(
                    f"source {name!r} exhausted in lane {self.lane} after {c[CUR_TAKEN]} documents of epoch "
                    f"{c[CUR_EPOCH]} (exhaustion rule 'fail')"
                )
        idx = plan.lane_sample(s, c[CUR_EPOCH], self.lane, c[CUR_TAKEN])
        c[CUR_TAKEN] += 1
        return idx

    def _check_progress(self, s: int, share: int) -> None:
        """At a `repeat` wrap of source s: raise ExhaustedError when the lane drew no token at all since
        s's previous wrap in this machine (a whole epoch of s's share, and everything else drawn between).

        Only empty documents without separators weigh nothing; a lane whose draws are all such would
        repeat them forever without filling a row (a silent, unbounded loop). The check needs two wraps
        inside one machine (one step, or one multi-step call), so it costs nothing in a normal stream
        and ends a stuck one within two epochs of that share.
        """
        total = sum(c[CUR_TOKENS] for c in self.cursors)
        wraps = self._wraps
        if wraps.get(s) == total:
            name = self.plan.manifest.sources[s].name
            raise ExhaustedError(
                f"source {name!r} in lane {self.lane}: a whole epoch of its share ({share} documents) drew no "
                f"token, and nothing else was drawn meanwhile: its documents are all empty and the separator "
                f"is 'none', so exhaustion rule 'repeat' would draw them forever without filling a row; "
                f"give the packing a separator, drop empty documents, or use exhaustion 'renormalize'"
            )
        wraps[s] = total

    def _next_doc(self, s: int) -> tuple[int, int, int] | None:
        """Where source s's next draw starts, as (epoch, sample index, framed offset): its open document
        at the open offset (piece draws), else its next document at 0 (counted as a document taken);
        None when the source just became inactive (see `_advance`)."""
        c = self.cursors[s]
        off = c[CUR_OPEN]
        if off:  # the open document is the lane's (taken - 1)-th of the cursor's epoch
            return c[CUR_EPOCH], self.plan.lane_sample(s, c[CUR_EPOCH], self.lane, c[CUR_TAKEN] - 1), off
        idx = self._advance(s)
        if idx is None:
            return None
        c[CUR_DOCS] += 1
        return c[CUR_EPOCH], idx, 0

    def _cut(self, s: int, idx: int, off: int, length: int) -> int:
        """End of the piece drawn from framed offset `off` of source s's `length`-token document `idx`:
        the document's end, or ``off + piece_tokens`` under piece draws (the rest stays open). Counts
        the piece's tokens and loss tokens as realized."""
        if off and off >= length:
            name = self.plan.manifest.sources[s].name
            raise StateError(f"lane {self.lane}: source {name!r}: the open document (sample index {idx}) has "
                             f"{length} framed tokens, but the data state continues it at offset {off}")
        b = self.plan.piece_tokens
        end = length if b is None or length - off <= b else off + b
        c = self.cursors[s]
        c[CUR_OPEN] = 0 if end == length else end
        c[CUR_TOKENS] += end - off
        c[CUR_LOSS_TOKENS] += self.plan.framing.loss_tokens_in(off, end, length)
        return end

    def _take(self, s: int) -> tuple[int, int, int, int, int] | None:
        """Source s's next draw for this lane as a piece (s, epoch, index, start, end) of a framed document
        (the whole document unless piece draws cut it), or None when the source just became inactive."""
        got = self._next_doc(s)
        if got is None:
            return None
        e, idx, off = got
        tokens, _ = self.framed(s, e, idx)
        return s, e, idx, off, self._cut(s, idx, off, int(tokens.size))

    def _active(self) -> list[bool]:
        """The sources a pick may choose: those with documents left and, with a packer per source, those whose
        packer still holds rows (a best-fit packer whose source ran out flushed its open bins: they are served
        before the source leaves, not dropped)."""
        active = [bool(c[CUR_ACTIVE]) for c in self.cursors]
        if self.plan.per_source_packers:
            for s, key in enumerate(self.plan.packer_keys):
                if not active[s] and getattr(self.packers[key], "pending", None):
                    active[s] = True
        return active

    def _pick(self) -> int:
        plan = self.plan
        active = self._active()
        if plan.manifest.mixture.policy == "categorical":
            s = categorical_pick(plan.weights, active, self.rng.u64(self.draws))
        else:
            unit_col = plan.unit_column
            s = quota_pick(plan.weights, [c[unit_col] for c in self.cursors], active, plan.counted)
        return s

    def _pull_mixed(self) -> tuple[int, int, int, int, int] | None:
        while True:
            s = self._pick()
            if s < 0:
                return None
            got = self._take(s)
            if got is not None:
                self.draws += 1
                return got

    # -- rows ----------------------------------------------------------------
    def next_pieces(self) -> list:
        """Pointers of the lane's next row (the packer decides; arrays come later)."""
        plan = self.plan
        if plan.per_source_packers:
            while True:
                s = self._pick()
                if s < 0:
                    raise EndOfStream(f"lane {self.lane}: every source is exhausted")
                self.draws += 1
                pieces = self.packers[str(s)].next_row(lambda s=s: self._take(s))
                if pieces is not None:
                    self.cursors[s][CUR_ROWS] += 1
                    break
                self.cursors[s][CUR_ACTIVE] = 0
        else:
            pieces = self.packers["*"].next_row(self._pull_mixed)
            if pieces is None:
                raise EndOfStream(f"lane {self.lane}: every source is exhausted")
        self.rows += 1
        return pieces

    def next_rows(self, k: int) -> list[Row]:
        pieces = [self.next_pieces() for _ in range(k)]
        m = self.plan.manifest.packing
        return materialize(pieces, m.seq_len, m.pad_id, self.framed, self.plan.framing.masks_eos_target)

    def state(self) -> LaneState:
        return LaneState(
            draws=self.draws,
            rows=self.rows,
            sources=tuple(SourceCursor.from_columns(c) for c in self.cursors),
            packers={k: p.state() for k, p in self.packers.items()},
        )
