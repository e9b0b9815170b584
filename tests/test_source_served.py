"""Tokens served per source: what each micro-batch holds of each source, counted where it is made.

Specification: every entry a producer makes carries, per micro-batch, the
tokens of each source in it (`StepEntry.source_tokens`, padding left out),
on every path that computes steps (the kernel, here its source run
uncompiled, concat's full rows and best-fit's with their padding, and
`Plan.step`); they equal the tokens of the
micro-batch's segments, attributed by sample ID, as `Plan.step` makes them,
and with the padding they add up to the micro-batch's size. The daemon adds
them up for each micro-batch it sends (`sluice_source_served_tokens_total`).
"""

from __future__ import annotations

from collections import Counter

import pytest
from logical_helpers import MappedDocs as Docs
from logical_helpers import make_manifest, make_spec

from sluice.loaderd.logical import Plan
from sluice.loaderd.metrics import Metrics
from sluice.loaderd.physical.producer import StepMaker

TWO = [("a", [50, 40], "3", "repeat"), ("b", [30, 70], "1", "repeat")]
CASES = {  # (sources, unit, piece tokens, order, packing, the path that must have made steps)
    "one source": ([("a", [50, 40, 60], "1", "repeat")], "documents", None, "block", "concat", "fused-kernel"),
    "two sources, documents": (TWO, "documents", None, "global", "concat", "fused-kernel"),
    "two sources, piece draws": (TWO, "tokens", 8, "global", "concat", "fused-kernel"),
    "two sources, best fit (padding)": (TWO, "documents", None, "global", "bestfit", "fused-kernel"),
    "two sources, a packer each": (TWO, "sequences", None, "global", "concat", "fused-kernel"),
    "two sources, a best-fit packer each": (TWO, "sequences", None, "global", "bestfit", "fused-kernel"),
}


def reference_counts(plan: Plan, steps: int) -> list[list[tuple[tuple[int, int], ...]]]:
    """Per step, per micro-batch: (source, tokens) of `Plan.step`'s segments, the source found from the manifest."""
    of = {o.sample_key: s for s, src in enumerate(plan.manifest.sources) for o in src.objects}
    docs, state, out = Docs(plan, 40), plan.initial_state(), []
    for _ in range(steps):
        batch, state = plan.step(state, docs)
        step = []
        for mb in plan.replica_micro_batches(batch, 1, 0):
            got = Counter()
            for row in mb.segments:
                for sid, start, end in row:
                    got[of[sid.rpartition(":")[0]]] += end - start
            step.append(tuple(sorted((s, n) for s, n in got.items() if n)))
        out.append(step)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_path_counts_each_micro_batchs_tokens_per_source(case):
    sources, unit, pieces, order, algorithm, path = CASES[case]
    manifest = make_manifest(sources, seq_len=16, unit=unit, piece_tokens=pieces, algorithm=algorithm)
    plan = Plan(manifest, make_spec(lanes=4, global_batch=8, micro_batch=2, order=order))
    want = reference_counts(Plan(manifest, plan.spec), 24)
    m = Metrics("r", "d", [n for n, *_ in sources], [float(w) for _, _, w, _ in sources])
    maker = StepMaker(plan, Docs(plan, 40), replica=0, replicas=1, metrics=m)
    got, state, padded = [], plan.initial_state(), 0
    while len(got) < 24:
        for entry, state in maker.produce_steps(state, 4):
            assert entry.source_tokens is not None and len(entry.source_tokens) == len(entry.micros)
            for counts, micro in zip(entry.source_tokens, entry.micros):
                assert 0 < sum(n for _, n in counts) <= micro["input_ids"].size
                padded += sum(n for _, n in counts) < micro["input_ids"].size
            got.append(list(entry.source_tokens))
    assert got[:24] == want
    assert m.fast_path()["steps_by_path"][path] > 0
    assert (padded > 0) == (algorithm == "bestfit")  # concat fills every row; best fit pads
    if len(sources) > 1:  # both sources were served
        assert {s for step in want for micro in step for s, _ in micro} == {0, 1}


def test_the_daemons_counter_adds_up_what_was_sent_per_replica_and_source():
    m = Metrics("r", "d", ["a", "b"], [1.0, 1.0])
    m.served_sources(0, ((0, 5), (1, 7)))
    m.served_sources(0, ((1, 3),))
    m.served_sources(1, ((0, 2),))
    from sluice.loaderd.metricvalues import collect

    got = {}
    for fam in collect(m.families()):
        if fam.name == "sluice_source_served_tokens":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    got[(s.labels["replica"], s.labels["source"])] = s.value
    assert got == {("0", "a"): 5, ("0", "b"): 10, ("1", "a"): 2, ("1", "b"): 0}


@pytest.mark.slow
def test_a_daemon_counts_every_token_it_sent_under_its_source(tmp_path, tokenizer_file):
    """A real daemon (one source, concat: no padding), read to the end by two replicas: the per-source counter
    adds up to sluice_served_tokens_total and to what the clients received, per replica."""
    from loaderd_support import Daemon, build_corpus, scrape

    root = build_corpus(tmp_path / "c", "sltok", tokenizer_file, max_steps=20)
    got = [0, 0]
    with Daemon(root, replicas=2, extra=("--metrics-port", "0")) as d:
        for r in (0, 1):
            c = d.client(r, 2)
            try:
                got[r] = sum(int(mb["input_ids"].size) for mb in c)  # (ends at max_steps)
            finally:
                c.close()
        m = scrape(d.info["metrics_port"])
    per = {dict(k)["replica"]: int(v) for k, v in m["sluice_source_served_tokens_total"].items()}
    assert sum(m["sluice_served_tokens_total"].values()) == sum(got) > 0
    assert per == {"0": got[0], "1": got[1]}
