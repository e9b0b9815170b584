"""The producer's metrics: on /metrics, and summed in STATS's ``producer`` block.

Specification: every metric the daemon exports is either producer-side (in
STATS's ``producer`` block, summed over its labels, equal to /metrics) or
daemon-side; after reading fresh objects of a text corpus the decode,
tokenize and cache figures are non-zero.
"""

from __future__ import annotations

import time

import pytest
from loaderd_support import Daemon, build_corpus, scrape

from sluice.loaderd.upkeep import PRODUCER_METRICS

# Recorded by the producer side (StepMaker, DocSource, its NodeCache). A new producer metric that is not in
# STATS's producer block must be added here, and then fails below until it is.
PRODUCER_SIDE = {
    "sluice_steps_produced_total", "sluice_object_errors_total", "sluice_source_documents_total",
    "sluice_read_bytes_total", "sluice_decode_seconds_total", "sluice_tokenize_seconds_total",
    "sluice_decoded_documents_total", "sluice_tokenized_tokens_total",
    "sluice_cache_hits_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
    "sluice_cache_verify_failures_total", "sluice_decoded_cache_bytes", "sluice_decode_inflight_objects",
    "sluice_stale_fills_stopped_total", "sluice_demanded_documents_total", "sluice_demand_waited_documents_total",
    "sluice_fill_reused_documents_total", "sluice_fused_kernel_loaded", "sluice_fused_kernel_ahead_of_time",
    "sluice_damaged_objects_total",
    "sluice_tokens_not_kept_total", "sluice_out_of_order_stopped_total",
    "sluice_steps_by_path_total", "sluice_fast_path_fallbacks_total",
}
# Labelled by what happened (one series per damaged object): none until it happens (tests/test_verify_served.py).
PER_EVENT = {"sluice_damaged_objects_total"}
# Recorded by the daemon's IO thread and upkeep.
DAEMON_SIDE = {
    "sluice_time_to_batch_seconds", "sluice_client_input_wait_seconds", "sluice_queue_depth_steps",
    "sluice_queue_bytes", "sluice_queue_age_seconds", "sluice_prefetch_lead_steps", "sluice_pending_requests",
    "sluice_batches_served_total", "sluice_served_bytes_total", "sluice_served_tokens_total",
    "sluice_protocol_errors_total", "sluice_released_requests_total", "sluice_generation",
    "sluice_committed_step", "sluice_commit_lag_steps", "sluice_source_target_share",
    "sluice_source_realized_units", "sluice_source_quota_debt_units", "sluice_quota_debt_bound_units",
    "sluice_gc_pause_seconds", "sluice_gc_frozen_objects", "sluice_wire_resets_total", "sluice_gil_cpu",
    "sluice_gil_cpu_moves_total",
    "sluice_source_served_tokens_total",  # counted when sent, from counts the producer made with the step
    "sluice_tokenizer_threads",  # set where the daemon opens its data path (--tokenizer-threads)
}
# Non-zero after reading fresh objects of a text corpus.
NON_ZERO = {
    "sluice_steps_produced_total", "sluice_source_documents_total", "sluice_read_bytes_total",
    "sluice_decode_seconds_total", "sluice_tokenize_seconds_total", "sluice_decoded_documents_total",
    "sluice_tokenized_tokens_total", "sluice_cache_misses_total", "sluice_cache_fill_bytes_total",
}


def test_the_producer_side_list_is_the_stats_list():
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
        time.sleep(1.2)  # > two housekeeping periods
    else:
        pytest.fail(f"the producer metrics did not settle within 20 s: {last}")
    stats = c.stats()
    c.close()
    return now, stats


@pytest.mark.slow
def test_every_metric_is_classified_and_stats_sums_the_producer_side(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file)
    with Daemon(root, cache=tmp_path / "cache", extra=("--metrics-port", "0", "--lead-steps", "3")) as d:
        scraped, stats = settled(d, 5)
    names = {n.rsplit("_bucket", 1)[0].rsplit("_count", 1)[0].rsplit("_sum", 1)[0] for n in scraped}
    unclassified = names - PRODUCER_SIDE - DAEMON_SIDE
    assert not unclassified, f"metrics neither producer- nor daemon-side in this test: {sorted(unclassified)}"
    for name in PRODUCER_SIDE - PER_EVENT:
        assert name in scraped, f"{name} missing from /metrics"
    for name in NON_ZERO:
        assert all(v > 0 for v in scraped[name].values()), f"{name} is zero: {scraped[name]}"
    assert set(stats["producer"]) == PRODUCER_SIDE
    for name in ("sluice_steps_produced_total", "sluice_source_documents_total", "sluice_tokenized_tokens_total"):
        assert stats["producer"][name] == sum(scraped[name].values()), name
    assert stats["decoded_hits"] + stats["decoded_misses"] > 0, stats
