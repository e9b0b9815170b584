"""The producer's metrics are exported wherever it runs (thread or `--producer process`).

Specification: after the same steps, a daemon with producer processes shows on
/metrics and in STATS every producer-side metric a thread-producer daemon
shows: the same steps produced and documents per source, and non-zero
decode/tokenize/cache figures. Counters folded from a child's cumulative
snapshots never go down, also when a child restarts.
"""

from __future__ import annotations

import time

import pytest
from loaderd_support import Daemon, build_corpus, scrape

from sluice.loaderd.metrics import Metrics
from sluice.loaderd.physical.producermetrics import PRODUCER_METRICS, ProducerFold

# Recorded by the producer side (StepMaker, DocSource, its NodeCache). A new producer metric that is not
# forwarded from producer processes must be added here, and then fails below until it is.
PRODUCER_SIDE = {
    "sluice_steps_produced_total", "sluice_object_errors_total", "sluice_source_documents_total",
    "sluice_read_bytes_total", "sluice_decode_seconds_total", "sluice_tokenize_seconds_total",
    "sluice_decoded_documents_total", "sluice_tokenized_tokens_total",
    "sluice_cache_hits_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
    "sluice_cache_verify_failures_total", "sluice_decoded_cache_bytes", "sluice_decode_inflight_objects",
    "sluice_stale_fills_stopped_total", "sluice_demanded_documents_total", "sluice_demand_waited_documents_total",
    "sluice_fill_reused_documents_total", "sluice_fused_kernel_loaded", "sluice_damaged_objects_total",
    "sluice_tokens_not_kept_total", "sluice_out_of_order_stopped_total",
    "sluice_steps_by_path_total", "sluice_fast_path_fallbacks_total",
}
# Labelled by what happened (one series per damaged object): none until it happens. Their forwarding from a
# producer process is tested where it happens (tests/test_verify_served.py, --producer process).
PER_EVENT = {"sluice_damaged_objects_total"}
# Recorded by the daemon's IO thread and upkeep whatever the producer kind.
DAEMON_SIDE = {
    "sluice_time_to_batch_seconds", "sluice_client_input_wait_seconds", "sluice_queue_depth_steps",
    "sluice_queue_bytes", "sluice_queue_age_seconds", "sluice_prefetch_lead_steps", "sluice_pending_requests",
    "sluice_batches_served_total", "sluice_served_bytes_total", "sluice_served_tokens_total",
    "sluice_protocol_errors_total", "sluice_released_requests_total", "sluice_generation",
    "sluice_committed_step", "sluice_commit_lag_steps", "sluice_source_target_share",
    "sluice_source_realized_units", "sluice_source_quota_debt_units", "sluice_quota_debt_bound_units",
    "sluice_gc_pause_seconds", "sluice_gc_frozen_objects", "sluice_wire_resets_total",
    "sluice_source_served_tokens_total",  # counted when sent, from counts the producer made with the step
    "sluice_tokenizer_threads",  # set where the daemon opens its data path (--tokenizer-threads), either kind
}
# Non-zero after reading fresh objects of a text corpus, whichever the producer kind.
NON_ZERO = {
    "sluice_steps_produced_total", "sluice_source_documents_total", "sluice_read_bytes_total",
    "sluice_decode_seconds_total", "sluice_tokenize_seconds_total", "sluice_decoded_documents_total",
    "sluice_tokenized_tokens_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
}


def test_the_producer_side_list_is_the_forwarded_list():
    assert set(PRODUCER_METRICS) == PRODUCER_SIDE


def settled(d: Daemon, steps: int) -> tuple[dict, dict]:
    """Read `steps` steps, then wait until the producer is at its lead bound and its metrics stopped changing."""
    c = d.client(0, 1)
    for mb in c:
        if mb["step"] == steps - 1 and mb["micro"] + 1 == c.info["micro_per_step"]:
            break
    port = d.info["metrics_port"]
    deadline = time.monotonic() + 20
    last = None
    while time.monotonic() < deadline:
        now = scrape(port)
        cur = {k: now.get(k) for k in PRODUCER_SIDE - {"sluice_decode_inflight_objects"}}
        if cur == last and now.get("sluice_steps_produced_total"):
            break
        last = cur
        time.sleep(1.2)  # > two snapshot periods of a producer process
    else:
        pytest.fail(f"the producer metrics did not settle within 20 s: {last}")
    stats = c.stats()
    c.close()
    return now, stats


@pytest.mark.slow
def test_process_producer_exports_what_the_thread_producer_does(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file)
    got = {}
    for kind in ("thread", "process"):
        with Daemon(root, cache=tmp_path / f"cache-{kind}",
                    extra=("--producer", kind, "--metrics-port", "0", "--lead-steps", "3")) as d:
            got[kind] = settled(d, 5)
    (thread, t_stats), (proc, p_stats) = got["thread"], got["process"]
    names = {n.rsplit("_bucket", 1)[0].rsplit("_count", 1)[0].rsplit("_sum", 1)[0] for n in thread}
    unclassified = names - PRODUCER_SIDE - DAEMON_SIDE
    assert not unclassified, f"metrics neither producer- nor daemon-side in this test: {sorted(unclassified)}"
    for name in PRODUCER_SIDE - PER_EVENT:
        assert name in proc, f"{name} missing from /metrics with --producer process"
    for name in NON_ZERO:
        assert all(v > 0 for v in thread[name].values()), f"{name} is zero with the thread producer: {thread[name]}"
        assert all(v > 0 for v in proc[name].values()), f"{name} is zero with --producer process: {proc[name]}"
    # the same steps from the same plan: the same steps produced and documents packed per source
    for name in ("sluice_steps_produced_total", "sluice_source_documents_total", "sluice_object_errors_total",
                 "sluice_cache_verify_failures_total"):
        assert proc[name] == thread[name], f"{name}: process {proc[name]} != thread {thread[name]}"
    # STATS carries them too, whichever the kind
    for stats, scraped in ((t_stats, thread), (p_stats, proc)):
        assert set(stats["producer"]) == PRODUCER_SIDE
        assert stats["producer"]["sluice_steps_produced_total"] == sum(scraped["sluice_steps_produced_total"].values())
        assert stats["decoded_hits"] + stats["decoded_misses"] > 0, stats


def test_folded_counters_never_go_down_and_bad_snapshots_are_dropped(caplog):
    m = Metrics("r", "b3:x", ["web", "code"], [1.0, 1.0])
    fold = ProducerFold(m)

    def snap(pid: int, steps: float, web: float, nbytes: float = 0.0) -> dict:
        return {"pid": pid, "families": {"sluice_steps_produced": [[steps]],
                                         "sluice_source_documents": [["web", web]],
                                         "sluice_decoded_cache_bytes": [[nbytes]]},
                "stats": {"decoded_bytes": nbytes, "decoded_hits": 1, "decoded_misses": 2}}

    fold.fold(0, snap(10, 3, 7, 100))
    fold.fold(0, snap(10, 5, 9, 50))  # cumulative: +2 steps, +2 documents
    fold.fold(1, snap(11, 4, 1, 25))  # another replica's child
    assert m.steps.get() == 9 and m.source_docs[0].get() == 10
    fold.fold(0, snap(12, 1, 1))  # replica 0's child restarted: counts from 0 again, never subtracted
    assert m.steps.get() == 10 and m.source_docs[0].get() == 11
    assert fold.gauge_sum("sluice_decoded_cache_bytes") == 25
    assert fold.stats_sum() == {"decoded_bytes": 25, "decoded_hits": 2, "decoded_misses": 4}
    for bad in (None, {"pid": 1}, snap(13, -1, 0), {**snap(13, 1, 1), "families": {"sluice_generation": [[1]]}},
                {**snap(13, 1, 1), "families": {"sluice_source_documents": [[2.0]]}}):
        fold.fold(0, bad)
    assert m.steps.get() == 10 and m.source_docs[0].get() == 11
    assert sum("bad metrics snapshot" in r.getMessage() for r in caplog.records) == 5
