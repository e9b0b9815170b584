"""Which path computed the served steps is counted, and a fast path that stands aside says why.

Specification: a daemon counts every step it produced under the path that
computed it (`sluice_steps_by_path_total{path}`: fused-kernel, plan) and
every step the fast path did not compute under the reason it gave
(`sluice_fast_path_fallbacks_total{reason}`); STATS's ``fast_path`` block
carries the same counts as /metrics. On
pre-tokenized specs (documents or token units, concat or best-fit) the fast
path serves the steps; a failure inside it is logged and counted (``error``),
never swallowed. The kernel's gauge says it is loaded, never that it serves
(`sluice_fused_kernel_loaded`).
"""

from __future__ import annotations

import time

import pytest
from loaderd_support import Daemon, build_corpus, scrape

from sluice.loaderd.metrics import FALLBACK_REASONS, STEP_PATHS, Metrics
from sluice.loaderd.physical.producer import StepMaker

STEPS = 40  # max_steps of the run: the producer ends there, so its counts stop moving


def read_all(d: Daemon) -> tuple[dict, int]:
    """Read the whole run (to its end); then STATS once the producer's counts cover every step (a producer
    process snapshots them at most every 0.5 s: bounded wait for the last one)."""
    c = d.client(0, 1)
    served = 0
    for mb in c:  # (ends at max_steps)
        served += mb["micro"] + 1 == c.info["micro_per_step"]
    deadline = time.monotonic() + 20
    while True:
        stats = c.stats()
        if stats["producer"]["sluice_steps_produced_total"] >= STEPS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    c.close()
    return stats, served


def agree(stats: dict, port: int) -> dict[str, int]:
    """STATS's fast_path block equals /metrics' families; returns the steps by path."""
    scraped = scrape(port)
    by_path = {dict(k)["path"]: int(v) for k, v in scraped["sluice_steps_by_path_total"].items()}
    fallbacks = {dict(k)["reason"]: int(v) for k, v in scraped["sluice_fast_path_fallbacks_total"].items() if v}
    fp = stats["fast_path"]
    assert set(by_path) == set(STEP_PATHS)  # every path listed from the start, zeros included
    assert fp["steps_by_path"] == by_path and fp["fallbacks"] == fallbacks, (fp, by_path, fallbacks)
    assert set(fallbacks) <= set(FALLBACK_REASONS)
    assert sum(by_path.values()) == stats["producer"]["sluice_steps_produced_total"] == STEPS
    assert "sluice_fused_kernel_active" not in scraped and "sluice_fused_kernel_loaded" in scraped
    return by_path


def served_by_the_kernel(stats: dict, by_path: dict[str, int]) -> None:
    """The kernel (its module compiled ahead of time, on disk: loaded after the run's first call) served all
    but the first steps; those are `Plan.step`'s, each counted under ``kernel`` (not loaded yet)."""
    fb = stats["fast_path"]["fallbacks"]
    assert set(fb) <= {"kernel"} and fb.get("kernel", 0) == by_path["plan"], stats["fast_path"]
    assert by_path["fused-kernel"] >= STEPS - 8 and stats["fast_path"]["kernel_loaded"] == 1, stats["fast_path"]


@pytest.mark.slow
def test_the_fused_path_serves_a_single_source_documents_spec(tmp_path, tokenizer_file, aot_kernel):
    """A single source by documents: the kernel serves every step once loaded. The fast path waits for the
    token shards it reads to be fetched and mapped, as Plan.step would (before, the first calls found them not
    mapped: 35 of 40 fused)."""
    root = build_corpus(tmp_path / "c", "sltok", tokenizer_file, max_steps=STEPS, lanes=4, global_batch=4,
                        micro_batch=4)
    with Daemon(root, extra=("--metrics-port", "0")) as d:
        stats, served = read_all(d)
        by_path = agree(stats, d.info["metrics_port"])
    assert served == STEPS
    served_by_the_kernel(stats, by_path)


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["tokens", "sequences"])
def test_piece_draws_and_per_source_packers_take_the_fused_path_too(tmp_path, tokenizer_file, aot_kernel, unit):
    """Token units draw pieces by default (the bench's own spec): the kernel's walk (fusedmix) serves them; unit
    `sequences` (a packer per source) is the kernel's too (fusedseqs); every step it does not is counted under
    its reason."""
    root = build_corpus(tmp_path / "c", "sltok", tokenizer_file, max_steps=STEPS, lanes=4, global_batch=4,
                        micro_batch=4, unit=unit)
    with Daemon(root, extra=("--metrics-port", "0",)) as d:
        stats, served = read_all(d)
        by_path = agree(stats, d.info["metrics_port"])
    assert served == STEPS
    served_by_the_kernel(stats, by_path)


@pytest.mark.parametrize("algorithm,unit,path,fallbacks", [
    ("bestfit", "documents", "fused-kernel", {}), ("bestfit", "tokens", "fused-kernel", {}),
    ("concat", "sequences", "fused-kernel", {}), ("bestfit", "sequences", "fused-kernel", {})])
def test_the_kernel_serves_best_fit_and_per_source_packers(tmp_path, algorithm, unit, path, fallbacks):
    """In-process (the same StepMaker the daemon runs; its kernel here the source run uncompiled): best-fit
    packing (`fusedbins`) and one packer per source (unit `sequences`: `fusedseqs` for concat, `fusedbins` for
    best-fit) are served by the kernel, counted under its path, with no fall-back. Each entry equals
    `produce_step`'s (`Plan.step`)."""
    from logical_helpers import MappedDocs, make_manifest, make_spec

    from sluice.loaderd.logical import Plan

    manifest = make_manifest([("a", [50, 40, 60], "1", "repeat"), ("b", [30], "2", "repeat")], seq_len=16,
                             algorithm=algorithm, unit=unit, piece_tokens=5 if unit == "tokens" else None)
    plan = Plan(manifest, make_spec(lanes=2, global_batch=2, micro_batch=1))
    m = Metrics("r", "d", ["a", "b"], [1.0, 2.0])
    maker = StepMaker(plan, MappedDocs(plan, 40), replica=0, replicas=1, metrics=m)
    single = StepMaker(plan, MappedDocs(plan, 40), replica=0, replicas=1)
    state, steps = plan.initial_state(), 0
    for _ in range(3):
        made = maker.produce_steps(state, 4)
        for entry, after in made:
            want, _ = single.produce_step(state)
            assert [{k: v.tobytes() for k, v in mb.items()} for mb in entry.micros] == \
                [{k: v.tobytes() for k, v in mb.items()} for mb in want.micros]
            assert (entry.samples, entry.state_json) == (want.samples, want.state_json)
            state = after
            steps += 1
    assert m.fast_path() == {"steps_by_path": {"fused-kernel": 0, "plan": 0, path: steps},
                             "fallbacks": fallbacks, "kernel_loaded": 0, "kernel_ahead_of_time": 0,
                             "kernel": {"state": "off", "cause": None}}  # (no loader made: none is running)


@pytest.mark.slow
def test_on_the_fly_every_step_not_fused_is_counted_once_under_a_reason(tmp_path, tokenizer_file):
    """Text decoded and tokenized while served: the steps made while objects fill are `Plan.step`'s, under
    ``filling``; a step made again because a cached file changed while it was read counts once."""
    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file, max_steps=STEPS, lanes=4, global_batch=4,
                        micro_batch=4)
    with Daemon(root, extra=("--metrics-port", "0",)) as d:
        stats, served = read_all(d)
        by_path = agree(stats, d.info["metrics_port"])
    fb = stats["fast_path"]["fallbacks"]
    assert served == STEPS and sum(fb.values()) == by_path["plan"], (by_path, fb)
    assert fb.get("filling", 0) > 0, fb


def test_a_failure_inside_the_fast_path_is_logged_and_counted_and_the_step_made_by_plan_step(monkeypatch, caplog):
    """A bug in the fast path (here: it raises) is never swallowed: one log line with its traceback, the step
    made by `Plan.step` (the same entry), counted under reason ``error``."""
    import logging

    import sluice.loaderd.logical.fusedmix as mix_mod
    from logical_helpers import MappedDocs, make_manifest, make_spec

    from sluice.loaderd.logical import Plan

    def broken(*a, **k):
        raise RuntimeError("a bug in the walk")

    plan = Plan(make_manifest([("a", [50, 40], "1", "repeat")], seq_len=16), make_spec(lanes=2, global_batch=2,
                                                                                     micro_batch=1))
    m = Metrics("r", "d", ["a"], [1.0])
    maker = StepMaker(plan, MappedDocs(plan, 40), replica=0, replicas=1, metrics=m)
    want, _ = StepMaker(plan, MappedDocs(plan, 40), replica=0, replicas=1).produce_step(plan.initial_state())
    monkeypatch.setattr(mix_mod, "mixed_steps", broken)
    with caplog.at_level(logging.ERROR, logger="sluice.loaderd"):
        made = maker.produce_steps(plan.initial_state(), 4)
    assert len(made) == 1 and made[0][0].state_json == want.state_json and made[0][0].error is None
    logged = [r for r in caplog.records if "fast path failed at step 0" in r.getMessage()]
    assert len(logged) == 1 and "a bug in the walk" in logged[0].exc_text
    assert m.fast_path()["fallbacks"] == {"error": 1} and m.fast_path()["steps_by_path"]["plan"] == 1
