"""`sluice plan`, `sluice whence`, `sluice ledger`: the logical plane, offline.

These answer "what will step k serve?", "when is sample X consumed?" and "what
did the run consume up to step K?" without a daemon. They read objects through
a node cache (a temporary one unless `--cache DIR` is given) and tokenize with
the manifest's tokenizer, exactly as loaderd does, so `sluice plan` digests
equal what a live daemon serves (`sluice peek`).

Without `--state`, the stream is computed from step 0 (the logical plane
restores in O(1) from a state, but knowing the state of step k from nothing
requires the documents before it). With `--state FILE` (a data state JSON, as
stored in a checkpoint) `plan` and `ledger` start right after that state's step;
`whence` always answers from step 0 and takes no `--state`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from sluice.cliargs import ranged, step_range
from sluice.errors import EndOfStream, SpecError, StateError
from sluice.manifest.cli import terminal_safe  # source names come from the manifest
from sluice.manifest.fields import is_digest
from sluice.progress import add_progress_argument, progress_bar

DEFAULT_CACHE_BUDGET = 8 << 30
MAX_EPOCHS = 10_000  # whence: one inverse permutation per epoch
MAX_STEPS = 1 << 62  # --max-steps, --until-step, --every: a step number as a data state holds it
# whence: steps a call of the fast path at most (one lane's; within the producer's CALL_BYTES)
WHENCE_STEPS = 256
# (`plan` and `ledger` only: `whence` answers for every epoch from step 0, so it takes no state)
STATE_HELP = "start after this data state (JSON file) instead of step 0"


def register(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("manifest", help="frozen manifest (manifest.json)")
    common.add_argument("run", help="run spec (TOML)")
    common.add_argument("--cache", help="node cache directory to read objects through (default: a temporary one)")
    common.add_argument(
        "--cache-budget", type=ranged(int, 1, 1 << 62, "--cache-budget"), default=DEFAULT_CACHE_BUDGET, metavar="BYTES",
        help=f"byte budget of that cache (default {DEFAULT_CACHE_BUDGET} = {DEFAULT_CACHE_BUDGET >> 30} GiB)",
    )
    common.add_argument("--json", action="store_true", help="one JSON object per line")
    add_progress_argument(common)

    p = subparsers.add_parser(
        "plan",
        parents=[common],
        help="print per step and replica the batch digest and sample IDs, computed offline",
        description="Per step and replica: BLAKE3 of the replica's micro-batch tensors (input_ids, labels, "
        "position_ids, cu_seqlens as little-endian int32, micro-batches in order) and the sample IDs in "
        "order of appearance, from the reference Plan.step; the steps before A (whose states only matter) in "
        "the daemon's fast path where its compiled kernel loads.",
    )
    p.add_argument("--steps", type=step_range("--steps"), required=True, metavar="A:B",
                   help="steps A (inclusive) to B (exclusive)")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel size R (divides lanes); default 1")
    p.add_argument("--state", help=STATE_HELP)
    p.set_defaults(func=_plan)

    w = subparsers.add_parser(
        "whence",
        parents=[common],
        help="at which step, lane and replica a sample is consumed, per epoch",
        description="The lane and its ordinal in the lane's share come from the inverse permutation in O(1); "
        "the step needs that one lane's mixture and packing history, computed by running that lane only.",
    )
    w.add_argument("sample_id", help="sample ID b3:<hex>:<record>")
    w.add_argument("--epochs", type=ranged(int, 1, MAX_EPOCHS, "--epochs"), default=1,
                   help=f"how many epochs to report, 1 to {MAX_EPOCHS} (default 1)")
    w.add_argument("--replicas", type=int, default=1, help="data-parallel size R (divides lanes); default 1")
    w.add_argument("--max-steps", type=ranged(int, 1, MAX_STEPS, "--max-steps"), default=100_000,
                   help="give up after this many steps (default 100000)")
    w.set_defaults(func=_whence)

    led = subparsers.add_parser(
        "ledger",
        parents=[common],
        help="per-source documents, tokens and loss tokens consumed up to a step; realized vs target mixture",
    )
    led.add_argument("--until-step", type=ranged(int, 0, MAX_STEPS, "--until-step"), required=True, metavar="K",
                     help="count steps 0..K inclusive")
    led.add_argument("--every", type=ranged(int, 0, MAX_STEPS, "--every"), default=0, metavar="N",
                     help="also print the ledger after every N-th step (a series for `sluice report`; default: only K)")
    led.add_argument("--state", help=STATE_HELP)
    led.set_defaults(func=_ledger)


@contextlib.contextmanager
def open_plan(args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    """(Plan, DocSource) over a node cache; closes both."""
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    manifest = load_manifest(args.manifest)
    spec = load_runspec(args.run)
    with contextlib.ExitStack() as stack:
        root = args.cache or stack.enter_context(tempfile.TemporaryDirectory(prefix="sluice-plan-cache-"))
        data = stack.enter_context(open_data_path(manifest, spec, DataPathConfig(
            cache_dir=root, cache_budget=args.cache_budget, verify_on_read=False)))
        yield data.plan(), data.docs


def _start_state(plan: Any, args: argparse.Namespace) -> Any:
    if not args.state:
        return plan.initial_state()
    from sluice.manifest.inputs import MAX_SPEC_BYTES, decode_utf8, read_input

    where = f"state file {args.state}"
    text = decode_utf8(read_input(args.state, "state file", MAX_SPEC_BYTES, StateError), where, StateError)
    try:
        obj = json.loads(text)
    except RecursionError as exc:
        raise StateError(f"{where}: JSON nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, or an integer beyond 4300 digits
        raise StateError(f"{where}: not valid JSON ({str(exc)[:200]})") from exc
    return plan.load_state(obj)


def _plan(args: argparse.Namespace) -> int:
    from sluice.loaderd.logical import micro_batches_digest, samples_of

    start, stop = args.steps
    with open_plan(args) as (plan, docs):
        plan.spec.check_replicas(args.replicas)
        state = _start_state(plan, args)
        if state.step >= start:
            raise StateError(f"--state is after step {state.step}; it cannot plan from step {start}")
        try:
            with progress_bar(args, total=stop - state.step - 1, desc="plan", unit="step") as bar:
                if start - 1 > state.step:
                    # The steps before the window: only their states matter, so in calls of the fast path
                    # (`advance`, as `sluice ledger`); the steps printed are `Plan.step`'s, the reference.
                    before = state.step
                    state = advance(plan, docs, state, start - 1,
                                    _kernel_loader(docs, start - 1 - state.step, "sluice plan"))
                    bar.update(state.step - before)
                while state.step + 1 < stop:
                    batch, state = plan.step(state, docs)
                    bar.update(1)
                    if batch.step < start:
                        continue
                    for r in range(args.replicas):
                        mbs = plan.replica_micro_batches(batch, args.replicas, r)
                        line = {
                            "step": batch.step,
                            "replica": r,
                            "digest": micro_batches_digest(mbs),
                            "samples": samples_of(mbs),
                        }
                        if args.json:
                            print(json.dumps(line))
                        else:
                            s = line["samples"]
                            print(f"step {batch.step:>6} replica {r}  {line['digest'][:16]}  {len(s)} samples  first {s[0] if s else '-'}")
        except EndOfStream as exc:
            print(f"sluice: end of stream: {exc}", file=sys.stderr)
    return 0


def _parse_sample(manifest: Any, sample_id: str) -> tuple[int, int]:
    """sample ID -> (source index, sample index in source)."""
    digest, _, rec = sample_id.rpartition(":")
    if not is_digest(digest) or not re.fullmatch(r"[0-9]{1,16}", rec):
        raise SpecError(f"sample ID {sample_id!r:.120}: expected b3:<64 lowercase hex>:<record>")
    record = int(rec)
    for s, src in enumerate(manifest.sources):
        for obj in src.objects:
            if obj.sample_key == digest:
                if record >= obj.records:
                    raise SpecError(f"sample ID {sample_id!r}: object has only {obj.records} records")
                return s, obj.start + record
    raise SpecError(f"sample ID {sample_id!r}: no object with digest {digest} in manifest {manifest.name!r}")


def _whence(args: argparse.Namespace) -> int:
    from sluice.loaderd.logical.order import lane_share

    with open_plan(args) as (plan, docs):
        spec = plan.spec
        s, index = _parse_sample(plan.manifest, args.sample_id)
        n = plan.source_records[s]
        plan.spec.check_replicas(args.replicas)  # before dividing by it
        per = spec.lanes // args.replicas
        found = []
        for epoch in range(args.epochs):
            position = plan.order(s, epoch).position_of(index)  # inverse permutation, O(1)
            lane = position % spec.lanes
            found.append({
                "sample_id": args.sample_id,
                "source": plan.manifest.sources[s].name,
                "epoch": epoch,
                "position": position,
                "lane": lane,
                "ordinal": position // spec.lanes,
                "lane_share": lane_share(n, spec.lanes, lane),
                "replica": lane // per,
                "step": None,
            })
        # Steps: run each involved lane alone. A lane draws the sample once in
        # every epoch whose permutation puts it in that lane's share, in epoch
        # order; the epochs asked for are 0..N-1, so the k-th appearance (first
        # segment) in the lane is the k-th smallest of its epochs listed here.
        # (Epochs that placed the sample in other lanes do not count.)
        # (The total is unknown until the sample shows up: the bar counts steps.)
        with progress_bar(args, total=None, desc="whence", unit="step") as bar:
            loader = _WalkLoader(docs, bar.update)
            for lane in sorted({f["lane"] for f in found}):
                wanted = sorted((f for f in found if f["lane"] == lane), key=lambda f: f["epoch"])
                steps = first_steps(plan, docs, lane, s, args.sample_id, [(f["epoch"], f["ordinal"]) for f in wanted],
                                    args.max_steps, loader, loader.made)
                for f, step in zip(wanted, steps):
                    f["step"] = step
        for f in found:
            if args.json:
                print(json.dumps(f))
            else:
                step = "not within --max-steps / stream" if f["step"] is None else f"step {f['step']}"
                print(
                    f"{f['sample_id']}  source {terminal_safe(f['source'])}  epoch {f['epoch']}: position {f['position']}, "
                    f"lane {f['lane']} (document {f['ordinal']} of its {f['lane_share']}), replica {f['replica']} of "
                    f"{args.replicas}, {step}"
                )
    return 0


def first_steps(plan: Any, docs: Any, lane: int, source: int, sample_id: str, draws: list[tuple[int, int]],
                max_steps: int, loader: Any = None, progress: Callable[[int], None] | None = None
                ) -> list[int | None]:
    """The step in which lane `lane` serves the first segment of `sample_id` (of source `source`) for each of
    `draws`, the (epoch, ordinal in the lane's share) where the lane draws it, in epoch order; None where that
    is not before step `max_steps` or the stream's end. Only `lane` is run (a lane's steps do not depend on the
    others'). A lane draws the sample once in every epoch whose permutation puts it in that lane's share, in
    epoch order, so the k-th appearance (first segment) is the k-th draw listed.

    Where `loader`'s compiled kernel is loaded the lane goes on in calls of the fast path (`fast.fast_steps`,
    its states equal `Plan.step`'s) up to the step before the one whose cursor of `source` takes the next
    draw: no segment of a document is served before its draw. From there `Plan.step` makes the steps, one by
    one, until the segment is seen (in the drawing step with concat; a best-fit bin can hold it longer).
    `progress(k)` is told of every k steps made."""
    from sluice.loaderd.logical.fast import fast_steps
    from sluice.loaderd.physical.producer import steps_a_call

    found: list[int | None] = [None] * len(draws)
    state = plan.initial_state().subset([lane])
    # (one lane's rows a step: a call's set-up, ~30 us, is shared by more steps than the producer's calls)
    per_call = steps_a_call(3 * 4 * plan.spec.per_lane * plan.manifest.packing.seq_len, WHENCE_STEPS)
    seen = 0
    try:
        while seen < len(draws) and state.step + 1 < max_steps:
            draw = draws[seen]
            kernel = None if loader is None else loader.arriving()
            if kernel is not None and not docs.making and not _taken(state.lanes[lane].sources[source], *draw):
                got = fast_steps(plan, state, docs, [lane], min(per_call, max_steps - 1 - state.step), kernel)
                if not isinstance(got, str):
                    # the call's first step that takes the draw (a cursor only moves on: a bisection)
                    lo, hi = 0, len(got.state_dicts)
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if _taken(got.state(mid).lanes[lane].sources[source], *draw):
                            hi = mid
                        else:
                            lo = mid + 1
                    if lo:
                        state = got.state(lo - 1)
                        if progress is not None:
                            progress(lo)
                    if lo == len(got.state_dicts):
                        continue
            batch, state = plan.step(state, docs, lanes=[lane])
            if progress is not None:
                progress(1)
            for row in batch.rows[lane]:
                for sid, start, _ in row.segments:
                    if sid == sample_id and start == 0 and seen < len(draws):
                        found[seen] = batch.step
                        seen += 1
    except EndOfStream:
        pass
    return found


class _WalkLoader:
    """`sluice whence`'s kernel loader: the data path's, loaded at once where this machine holds the module
    compiled ahead of time, else started once the walk has made `START_AFTER_STEPS` steps (a walk's length is
    not known before the sample shows up; numba's compile pays back only for a long one). `made(k)` counts the
    steps made and tells `progress`."""

    def __init__(self, docs: Any, progress: Callable[[int], None]) -> None:
        from sluice.loaderd.physical.jitstart import START_AFTER_STEPS

        self.docs, self.progress, self.steps, self.after = docs, progress, 0, START_AFTER_STEPS
        self.loader = _kernel_loader(docs, 0, "sluice whence")

    def made(self, k: int) -> None:
        self.steps += k
        self.progress(k)

    def arriving(self) -> Any:
        if self.loader is None and self.steps >= self.after:
            self.after = 1 << 62  # (asked once)
            self.loader = _kernel_loader(self.docs, self.steps, "sluice whence: walked")
        return None if self.loader is None else self.loader.arriving()


def _taken(cursor: Any, epoch: int, ordinal: int) -> bool:
    """Whether a lane's cursor of a source has taken (drawn, or begun to draw) the document at `ordinal` of
    its share in `epoch`."""
    return cursor.epoch > epoch or (cursor.epoch == epoch and cursor.taken > ordinal)


def ledger_obj(plan: Any, state: Any, ended: str | None = None) -> dict[str, Any]:
    """The ledger after `state`'s step: per-source documents, tokens, loss tokens, rows, target and realized share."""
    m = plan.manifest
    unit = m.mixture.unit
    col = {"documents": "docs", "tokens": "tokens", "loss_tokens": "loss_tokens", "sequences": "rows"}[unit]
    rows = []
    for s, src in enumerate(m.sources):
        agg = {"docs": 0, "tokens": 0, "loss_tokens": 0, "rows": 0}
        for lane in state.lanes.values():
            c = lane.sources[s]
            agg["docs"] += c.docs
            agg["tokens"] += c.tokens
            agg["loss_tokens"] += c.loss_tokens
            agg["rows"] += c.rows
        rows.append({"source": src.name, **agg, "epochs": max(lane.sources[s].epoch for lane in state.lanes.values())})
    total_unit = sum(r[col] for r in rows) or 1
    total_w = sum(Decimal(src.weight) for src in m.sources)
    for r, src in zip(rows, m.sources):
        r["target_share"] = str(Decimal(src.weight) / total_w)
        r["realized_share"] = f"{r[col] / total_unit:.6f}"
    return {"until_step": state.step, "unit": unit, "policy": m.mixture.policy, "sources": rows, "ended": ended}


def _kernel_loader(docs: Any, steps: int, who: str = "sluice ledger") -> Any:
    """The data path's compiled-kernel loader (`jitload.KernelLoader`), its load started in the background, where
    it pays for `steps` steps: this machine holds the module compiled ahead of time (a millisecond to load), or
    the steps are at least the daemon's `START_AFTER_STEPS` (numba's compile, in a child, then pays back:
    physical/jitstart.py); else None (every step `Plan.step`'s). `who` starts the log line of the load."""
    from sluice.loaderd.physical.jitstart import START_AFTER_STEPS

    loader = getattr(docs, "jit", None)
    if loader is None or not (steps >= START_AFTER_STEPS or loader.ready()):
        return None
    loader.start(f"{who}, {steps} steps")
    return loader


def advance(plan: Any, docs: Any, state: Any, stop: int, loader: Any = None) -> Any:
    """The data state after step `stop` (> ``state.step``), from `state`: in calls of the fast path
    (`fast.fast_steps`, every lane at once, equal to `Plan.step` byte for byte, states included) once `loader`'s
    compiled kernel is loaded and no object's tokens are being made from text (as the daemon's producer), each
    call within the producer's `STEPS_AT_ONCE` and `CALL_BYTES`; else, and where the fast path stands aside (an
    end of stream among them), `Plan.step`, which raises where the stream ends (EndOfStream) or fails."""
    from sluice.loaderd.logical.fast import fast_steps
    from sluice.loaderd.physical.producer import steps_a_call

    lanes = list(range(plan.spec.lanes))
    # (a step's rows: tokens, labels and positions, int32, of every lane)
    per_call = steps_a_call(3 * 4 * plan.spec.global_batch * plan.manifest.packing.seq_len)
    while state.step < stop:
        kernel = None if loader is None else loader.arriving()
        got = None
        if kernel is not None and not docs.making:
            got = fast_steps(plan, state, docs, lanes, min(per_call, stop - state.step), kernel)
        if got is None or isinstance(got, str):
            _, state = plan.step(state, docs)
        else:
            state = got.state(len(got.state_dicts) - 1)
    return state


def _ledger(args: argparse.Namespace) -> int:
    with open_plan(args) as (plan, docs):
        state = _start_state(plan, args)
        ended = None
        loader = _kernel_loader(docs, args.until_step - state.step)
        every = args.every if args.json else 0
        try:
            with progress_bar(args, total=max(0, args.until_step - state.step), desc="ledger", unit="step") as bar:
                while state.step < args.until_step:
                    stop = args.until_step
                    if every:  # (the state after each `every`-th step is printed: a call ends there)
                        stop = min(stop, ((state.step + 1) // every + 1) * every - 1)
                    before = state.step
                    state = advance(plan, docs, state, stop, loader)
                    bar.update(state.step - before)
                    if every and (state.step + 1) % every == 0 and state.step < args.until_step:
                        print(json.dumps(ledger_obj(plan, state)), flush=True)
        except EndOfStream as exc:
            ended = str(exc)
        out = ledger_obj(plan, state, ended)
        rows, unit = out["sources"], out["unit"]
        if args.json:
            print(json.dumps(out))
        else:
            print(f"ledger up to step {state.step} (unit {unit}, policy {out['policy']})")
            print(f"{'source':<16}{'documents':>12}{'tokens':>14}{'loss tokens':>14}{'target':>10}{'realized':>10}")
            for r in rows:
                print(
                    f"{terminal_safe(r['source']):<16}{r['docs']:>12}{r['tokens']:>14}{r['loss_tokens']:>14}"
                    f"{float(Decimal(r['target_share'])):>10.4f}{float(r['realized_share']):>10.4f}"
                )
            if ended:
                print(f"stream ended early: {terminal_safe(ended)}")
    return 0
