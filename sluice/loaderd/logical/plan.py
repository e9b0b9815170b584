"""The logical plane: what step k serves, as a pure function of (manifest, run spec, state).

`Plan` holds what one (manifest, run spec) fixes: each source's epoch orders
and every lane's share of them, the mixture's weights and unit, the framing;
`Plan.step` computes a global step by driving one `LaneMachine` per lane
(lanemachine.py: the draws, exhaustion and packing of a lane, document by
document). Global step k takes ``global_batch / lanes`` rows from every lane,
in lane order; replica r of R serves lanes ``[r*P/R, (r+1)*P/R)``, so the
global batch of a step is the same for every R.

Token data enters only through the `docs` callback (`DocTokens`): the physical
plane decides how fast documents are read and tokenized; nothing here depends
on timing.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sluice.datastate import CUR_DOCS, CUR_LOSS_TOKENS, CUR_ROWS, CUR_TOKENS
from sluice.errors import EndOfStream, ExhaustedError, SpecError, StateError
from sluice.loaderd.logical.batch import MicroBatch, micro_batches
from sluice.loaderd.logical.lanemachine import LaneMachine
from sluice.loaderd.logical.mixture import CounterRNG, integer_weights
from sluice.loaderd.logical.order import Order, lane_share, make_order
from sluice.loaderd.logical.packing import Framing, Row, make_packer
from sluice.loaderd.logical.ref import DocRef
from sluice.loaderd.logical.state import DataState, LaneState, SourceCursor
from sluice.manifest.model import Manifest
from sluice.runspec import RunSpec


DocTokens = Callable[[DocRef], np.ndarray]


@dataclass(frozen=True)
class StepBatch:
    step: int
    rows: dict[int, list[Row]]  # lane -> rows, per_lane each


class Plan:
    """Pure logical plane for one (manifest, run spec)."""

    ORDER_CACHE = 256  # (source, epoch) orders kept; bounded, evicted LRU
    LANE_CHUNK = 1024  # lane positions evaluated at once (vectorized: 2.7x cheaper per position than 256), memoized
    LANE_GROUP = 8  # lanes whose chunks are evaluated together
    CHUNK_CACHE = 1024  # chunks kept (8 MiB at most); bounded, oldest inserted dropped first

    def __init__(self, manifest: Manifest, spec: RunSpec, *, reference: bool = False) -> None:
        """`reference=True` marks the plan as the tests' oracle: `fast.fast_steps` never serves it (its steps
        are `Plan.step`'s, as every plan's are)."""
        spec.check_seq_len(manifest.packing.seq_len)  # bounds the memory of one step
        self.manifest = manifest
        self.spec = spec
        self.dataset_id = manifest.dataset_id
        self.runspec_digest = spec.digest
        self.source_records = [s.records for s in manifest.sources]
        self.weights = integer_weights([s.weight for s in manifest.sources])
        p = manifest.packing
        self.framing = Framing(
            bos=p.bos_id if p.separator in ("bos", "bos_eos") else None,
            eos=p.eos_id if p.separator in ("eos", "bos_eos") else None,
            exclude_separator=p.loss_mask == "exclude_separator",
        )
        unit = manifest.mixture.unit
        self.counted = unit in ("documents", "sequences")
        self.unit_column = {"documents": CUR_DOCS, "tokens": CUR_TOKENS, "loss_tokens": CUR_LOSS_TOKENS,
                            "sequences": CUR_ROWS}[unit]
        self.per_source_packers = unit == "sequences"
        self.piece_tokens = manifest.mixture.piece_tokens  # None: whole documents
        self.packer_keys = [str(i) for i in range(len(manifest.sources))] if self.per_source_packers else ["*"]
        self.reference = reference
        self._orders: OrderedDict[tuple[int, int], Order] = OrderedDict()
        self._rngs: dict[int, CounterRNG] = {}
        self._shares: dict[int, list[int]] = {}  # lane -> lane_share per source (bounded by spec.lanes)
        self.sample_keys = [[o.sample_key for o in src.objects] for src in manifest.sources]  # ID prefixes
        self._chunks: OrderedDict[tuple[int, int, int, int], np.ndarray] = OrderedDict()
        # Per source: starts of its non-empty objects and their indices (bisect in C).
        self._starts = []
        for src in manifest.sources:
            nonempty = [(o.start, i) for i, o in enumerate(src.objects) if o.records]
            self._starts.append(([st for st, _ in nonempty], [i for _, i in nonempty]))
        self._starts_np = [(np.asarray(st, dtype=np.int64), np.asarray(ids, dtype=np.int64)) for st, ids in self._starts]
        self.mean_framed_len = 512.0  # the fast path's estimate of positions a call draws (never the stream)

    # -- identities ------------------------------------------------------------
    def order(self, s: int, epoch: int) -> Order:
        key = (s, epoch)
        o = self._orders.get(key)
        if o is None:
            src = self.manifest.sources[s]
            o = make_order(
                self.spec.order,
                tuple(obj.records for obj in src.objects),
                dataset_id=self.dataset_id,
                seed=self.spec.seed,
                source=src.name,
                epoch=epoch,
                window=self.spec.block_window,
            )
            self._orders[key] = o
            if len(self._orders) > self.ORDER_CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return o

    def rng(self, lane: int) -> CounterRNG:
        """The lane's categorical generator (a pure function of its draw counter)."""
        got = self._rngs.get(lane)
        if got is None:
            got = self._rngs[lane] = CounterRNG(self.dataset_id, self.spec.seed, lane)
        return got

    def lane_shares(self, lane: int) -> list[int]:
        """Per source, the positions of an epoch that `lane` owns (memoized; callers never modify it)."""
        got = self._shares.get(lane)
        if got is None:
            got = self._shares[lane] = [lane_share(n, self.spec.lanes, lane) for n in self.source_records]
        return got

    def lane_sample(self, s: int, epoch: int, lane: int, n: int) -> int:
        """Sample index of the n-th document of `lane`'s share of source s in `epoch`.

        Pure (position ``lane + n * lanes`` of the epoch order); evaluated a chunk
        of positions at a time with the vectorized permutation and memoized.
        """
        chunk = n // self.LANE_CHUNK
        return int(self._lane_chunk(s, epoch, lane, chunk)[n - chunk * self.LANE_CHUNK])

    def lane_samples(self, s: int, epoch: int, lane: int, lo: int, hi: int) -> np.ndarray:
        """`lane_sample` for n in [lo, hi) (within the lane's share), as an int64 array."""
        parts = []
        n = lo
        while n < hi:
            chunk = n // self.LANE_CHUNK
            base = chunk * self.LANE_CHUNK
            arr = self._lane_chunk(s, epoch, lane, chunk)
            parts.append(arr[n - base : min(hi - base, len(arr))])
            n = base + min(hi - base, len(arr))
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def _lane_chunk(self, s: int, epoch: int, lane: int, chunk: int) -> np.ndarray:
        key = (s, epoch, lane, chunk)
        arr = self._chunks.get(key)
        if arr is None:
            # The chunks of the lane's group of LANE_GROUP lanes in one vectorized call: its cost is mostly
            # per call (8 lanes' chunks cost 2.1-2.6x one lane's, measured), and the others come soon.
            P, lo, first = self.spec.lanes, chunk * self.LANE_CHUNK, lane - lane % self.LANE_GROUP
            group = range(first, min(first + self.LANE_GROUP, P))
            pos = [l + np.arange(lo, min(lo + self.LANE_CHUNK, lane_share(self.source_records[s], P, l)),
                                 dtype=np.int64) * P for l in group]
            got = self.order(s, epoch).sample_many(np.concatenate(pos))
            for l, part in zip(group, np.split(got, np.cumsum([len(p) for p in pos])[:-1])):
                self._chunks[(s, epoch, l, chunk)] = part.copy()  # no view pins the group's array
            arr = self._chunks[key]
            while len(self._chunks) > self.CHUNK_CACHE:
                self._chunks.popitem(last=False)
        return arr

    def ref(self, s: int, epoch: int, index: int) -> DocRef:
        src = self.manifest.sources[s]
        if not 0 <= index < self.source_records[s]:
            raise StateError(f"source {src.name!r}: sample index {index} outside [0, {self.source_records[s]})")
        starts, ids = self._starts[s]
        k = bisect.bisect_right(starts, index) - 1
        oi = ids[k]
        record = index - starts[k]
        return DocRef(s, epoch, index, oi, record, f"{self.sample_keys[s][oi]}:{record}")

    def locate(self, s: int, indices: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """(sample indices, objects, records) for valid sample indices of source s, one vectorized lookup: `ref`
        without the DocRef, made by the caller only for what it uses (ID: sample_keys[s][object]:record)."""
        starts, ids = self._starts_np[s]
        k = np.searchsorted(starts, indices, side="right") - 1
        return indices.tolist(), ids[k].tolist(), (indices - starts[k]).tolist()

    def lanes_of(self, replicas: int, replica: int) -> range:
        self.spec.check_replicas(replicas)
        if not 0 <= replica < replicas:
            raise SpecError(f"replica {replica} outside [0, {replicas})")
        per = self.spec.lanes // replicas
        return range(replica * per, (replica + 1) * per)

    # -- states ------------------------------------------------------------
    def initial_state(self) -> DataState:
        n = len(self.manifest.sources)
        lane = LaneState(sources=tuple(SourceCursor() for _ in range(n)), packers={})
        return DataState(self.dataset_id, self.runspec_digest, -1, {i: lane for i in range(self.spec.lanes)})

    def load_state(self, d: object) -> DataState:
        return DataState.from_state_dict(
            d,
            dataset_id=self.dataset_id,
            runspec_digest=self.runspec_digest,
            n_sources=len(self.manifest.sources),
            n_lanes=self.spec.lanes,
        )

    # -- steps -------------------------------------------------------------
    def step(
        self, state: DataState, docs: DocTokens, lanes: Sequence[int] | None = None
    ) -> tuple[StepBatch, DataState]:
        """Global step `state.step + 1` for `lanes` (default all) and the state of those lanes after it.

        Raises EndOfStream when some lane cannot fill its rows (the stream ends at
        the last whole step), ExhaustedError for a `fail` source; `state` is
        never modified.
        """
        if (state.dataset_id, state.runspec_digest) != (self.dataset_id, self.runspec_digest):
            raise StateError("data state belongs to another dataset or run spec")
        lanes = list(range(self.spec.lanes)) if lanes is None else list(lanes)
        step = state.step + 1
        if self.spec.max_steps and step >= self.spec.max_steps:
            raise EndOfStream(f"run spec max_steps={self.spec.max_steps} reached")
        rows: dict[int, list[Row]] = {}
        # The state after the step holds exactly the lanes computed: a lane left
        # out would otherwise claim step k while still at step k-1.
        new_lanes: dict[int, LaneState] = {}
        k = self.spec.per_lane
        for lane in lanes:
            if lane not in state.lanes:
                raise StateError(f"step {step}: the data state does not hold lane {lane}")
            machine = LaneMachine(self, lane, state.lanes[lane], docs, {})
            try:
                rows[lane] = machine.next_rows(k)
            except ExhaustedError as exc:
                raise type(exc)(f"step {step}: {exc}") from exc
            new_lanes[lane] = machine.state()
        return StepBatch(step, rows), DataState(self.dataset_id, self.runspec_digest, step, new_lanes)

    def replica_micro_batches(self, batch: StepBatch, replicas: int, replica: int) -> list[MicroBatch]:
        rows = [r for lane in self.lanes_of(replicas, replica) for r in batch.rows[lane]]
        return micro_batches(batch.step, replica, rows, self.spec.micro_batch)

    def upcoming(self, state: DataState, lane: int, n: int) -> list[DocRef]:
        """Documents lane `lane` will need next: its residual, then per active source its open document
        (piece draws) and the next n."""
        ls = state.lanes[lane]
        out: list[DocRef] = []
        m = self.manifest
        for key in self.packer_keys:
            p = make_packer(m.packing.algorithm, m.packing.seq_len, m.packing.window)
            if key in ls.packers:
                p.load(ls.packers[key], f"lane {lane}")
            out.extend(self.ref(*r) for r in p.residual_refs())
        for s, c in enumerate(ls.sources):
            if not c.active:
                continue
            share = lane_share(self.source_records[s], self.spec.lanes, lane)
            epoch, taken = c.epoch, c.taken
            if c.open and 0 < taken <= share:  # the open document's next pieces come first
                out.append(self.ref(s, epoch, self.lane_sample(s, epoch, lane, taken - 1)))
            for _ in range(n):
                if taken >= share:
                    if m.sources[s].exhaustion != "repeat" or share == 0:
                        break
                    epoch, taken = epoch + 1, 0
                idx = self.lane_sample(s, epoch, lane, taken)
                out.append(self.ref(s, epoch, idx))
                taken += 1
        return out
