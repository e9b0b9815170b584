"""Prometheus metrics of one daemon (DESIGN.md section 8), in its own registry.

Every metric carries the labels ``run_id`` and ``dataset_id`` (their values are
`METRICS_HIDDEN` unless the daemon runs with ``--metrics-ids``); names carry their
unit (``_seconds``, ``_bytes``, ``_total``, ``_steps``). Children are bound once
at start (`Metrics.__init__`), so the hot path only does a locked add, or a
plain one for what the IO thread alone counts per GET (`SentCounts`). They are
plain values (metricvalues.py): prometheus_client is imported only when the
registry is first asked for (`Metrics.registry`: the HTTP exporter, `start_http`,
or a test), so a daemon without a metrics port never imports it. The exporter
serves this registry only, never the process-global one.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from operator import attrgetter
from typing import Any, NamedTuple

from sluice.loaderd.logical.fast import REASONS
from sluice.loaderd.metricvalues import Family, collect


# The value of the run_id and dataset_id labels unless the daemon runs with --metrics-ids: the loopback
# metrics port is readable by every local user, and the IDs name the run and its dataset.
METRICS_HIDDEN = "hidden"


class ReplicaGauges(NamedTuple):
    """The gauges of one replica (labelled children, made once and kept: `Metrics.replica`)."""

    queue_steps: Any
    queue_bytes: Any
    queue_age: Any
    lead: Any
    pending: Any
    committed: Any
    commit_lag: Any

# How the producer computed its steps (physical/producer.py `StepMaker`): the fast path in the compiled
# kernel or without it (`fast.fast_steps`), or one step by `Plan.step`.
STEP_PATHS = ("fused-kernel", "plan")
# Why the fast path did not serve steps: its own reasons (`fast.REASONS`), and the producer's: objects still
# filling (one step a call), a call that raised (logged; made again by `Plan.step`).
FILLING, ERROR = "filling", "error"
FALLBACK_REASONS = (*REASONS, FILLING, ERROR)

_NBYTES = attrgetter("nbytes")
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Pre-bound Prometheus children for one (run, dataset)."""

    def __init__(self, run_id: str, dataset_id: str, source_names: list[str], source_weights: list[float],
                 unit: str = "documents", policy: str = "quota", piece_tokens: int | None = None) -> None:
        self._families: list[Family] = []  # in the order the exporter lists them
        self._registry: Any = None
        self._registry_lock = threading.Lock()
        base = ["run_id", "dataset_id"]
        lv = (run_id, dataset_id)

        def family(kind: str, name: str, doc: str, extra: tuple[str, ...] = (), buckets: tuple = (),
                   one_writer: bool = False) -> Family:
            self._families.append(Family(kind, name, doc, base + list(extra), buckets, one_writer))
            return self._families[-1]

        def counter(name: str, doc: str, extra: tuple[str, ...] = (), one_writer: bool = False) -> Any:
            return family("counter", name, doc, extra, one_writer=one_writer)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return family("gauge", name, doc, extra)

        # What the IO thread counts per GET has one writer, the IO thread: plain children without a lock
        # (metricvalues.Tally), added to by `SentCounts.batch` (`observe`/`inc` on them work as on any other).
        self.time_to_batch = family(
            "histogram", "sluice_time_to_batch_seconds", "GET arrival to BATCH sent", buckets=_LATENCY_BUCKETS,
            one_writer=True).labels(*lv)
        self.input_wait = family(
            "histogram", "sluice_client_input_wait_seconds",
            "time a client waited for its next micro-batch (client-reported)", buckets=_LATENCY_BUCKETS,
            one_writer=True).labels(*lv)
        self._queue_steps = gauge("sluice_queue_depth_steps", "assembled steps waiting per replica", ("replica",))
        self._queue_bytes = gauge("sluice_queue_bytes", "bytes of assembled micro-batches per replica", ("replica",))
        self._queue_age = gauge("sluice_queue_age_seconds", "age of the oldest assembled step per replica", ("replica",))
        self._lead = gauge("sluice_prefetch_lead_steps", "steps produced ahead of the oldest requested one", ("replica",))
        self._pending = gauge("sluice_pending_requests", "GETs waiting for their step per replica", ("replica",))
        self.docs_cache_bytes = gauge("sluice_decoded_cache_bytes", "bytes of decoded/tokenized objects held").labels(*lv)
        self.jit_loaded = gauge("sluice_fused_kernel_loaded",
                                "1 once the fused path's compiled kernel (compiled ahead of time, or numba's) is "
                                "loaded (whether it serves the steps: sluice_steps_by_path_total)").labels(*lv)
        self.jit_ahead = gauge("sluice_fused_kernel_ahead_of_time",
                               "1 once the loaded kernel is the module compiled ahead of time (0: numba's, or none; "
                               "docs/logical.md, 'Compiled kernel')").labels(*lv)
        self.jit_status: dict[str, Any] = {"state": "off", "cause": None}  # (STATS only: set by KernelLoader)
        self.docs_inflight = gauge("sluice_decode_inflight_objects", "objects being read/decoded/tokenized").labels(*lv)
        self.read_bytes = counter("sluice_read_bytes_total", "object bytes read from the node cache").labels(*lv)
        self.decode_seconds = counter("sluice_decode_seconds_total", "worker seconds spent decoding").labels(*lv)
        self.tokenize_seconds = counter("sluice_tokenize_seconds_total", "worker seconds spent tokenizing").labels(*lv)
        self.decoded_docs = counter("sluice_decoded_documents_total", "documents decoded").labels(*lv)
        self.tokens = counter("sluice_tokenized_tokens_total", "tokens produced by workers").labels(*lv)
        self.cache_hits = counter("sluice_cache_hits_total", "node cache hits").labels(*lv)
        self.cache_misses = counter("sluice_cache_misses_total", "node cache misses (fills)").labels(*lv)
        self.cache_fill_bytes = counter("sluice_cache_fill_bytes_total", "bytes published by cache fills").labels(*lv)
        self.cache_verify_failures = counter(
            "sluice_cache_verify_failures_total", "cache objects or fills whose bytes did not match their digest"
        ).labels(*lv)
        self.demanded_docs = counter(
            "sluice_demanded_documents_total", "documents tokenized out of order, before their object's in-order "
            "fill reached them").labels(*lv)
        self.demand_waited_docs = counter(
            "sluice_demand_waited_documents_total", "documents a packer waited for on the out-of-order path "
            "(neither written by the in-order fill nor made ahead from a prefetch announcement)").labels(*lv)
        self.fill_reused_docs = counter(
            "sluice_fill_reused_documents_total", "documents an in-order fill wrote from the out-of-order path "
            "instead of tokenizing them again").labels(*lv)
        self.stale_fills_stopped = counter(
            "sluice_stale_fills_stopped_total", "in-order token fills stopped because a RESTORE left their object "
            "outside every prefetch window").labels(*lv)
        self.object_errors = counter("sluice_object_errors_total", "objects that failed (corrupt/missing)").labels(*lv)
        # One series per damaged object (bounded by the manifest's objects; only damaged ones appear).
        self._damaged = counter("sluice_damaged_objects_total", "cached objects whose bytes changed after they were "
                                "verified, found before a step left the producer (quarantined, filled again)",
                                ("source", "object"))
        not_kept = counter("sluice_tokens_not_kept_total", "token fills the node cache did not keep, served from "
                           "where the tokens are held: memory (its disk refused the file: ENOSPC, EDQUOT, EIO) or "
                           "spool (the fill's unlinked file: budget or index refused it)", ("held",))
        self.tokens_not_kept = {held: not_kept.labels(*lv, held) for held in ("memory", "spool")}
        self.out_of_order_stopped = counter(
            "sluice_out_of_order_stopped_total", "objects whose out-of-order reading stopped because the node "
            "cache's disk refused its spool (their records wait for the in-order fill)").labels(*lv)
        self.batches = counter("sluice_batches_served_total", "BATCH messages sent", one_writer=True).labels(*lv)
        self.served_bytes = counter("sluice_served_bytes_total", "array bytes sent in BATCH messages",
                                    one_writer=True).labels(*lv)
        self.served_tokens = counter("sluice_served_tokens_total", "tokens sent in BATCH messages",
                                     one_writer=True).labels(*lv)
        # Per replica and source: what the trainers were sent, so `sluice report` counts tokens served, not
        # documents drawn (a drawn document's tokens past its row are never sent). Padding is no source's:
        # sluice_served_tokens_total minus their sum.
        self._src_served = counter("sluice_source_served_tokens_total", "tokens of each source sent in BATCH "
                                   "messages, per replica (padding is the total's rest)", ("replica", "source"),
                                   one_writer=True)
        self.steps = counter("sluice_steps_produced_total", "steps assembled by the packers").labels(*lv)
        by_path = counter("sluice_steps_by_path_total", "steps produced, by the path that computed them: fused-kernel "
                          "(the compiled kernel), plan (Plan.step)", ("path",))
        self.steps_by_path = {p: by_path.labels(*lv, p) for p in STEP_PATHS}
        fallbacks = self.fallback_family = counter("sluice_fast_path_fallbacks_total", "steps the fused path did not "
                                                   "compute, by reason (docs/logical.md)", ("reason",))
        self.fallbacks = {r: fallbacks.labels(*lv, r) for r in FALLBACK_REASONS}
        self._errors = counter("sluice_protocol_errors_total", "ERROR replies sent, by code", ("code",))
        self.released_credits = counter(
            "sluice_released_requests_total", "pending GETs dropped because their client went away"
        ).labels(*lv)
        self.generation = gauge("sluice_generation", "current fencing generation").labels(*lv)
        self.wire_resets = counter("sluice_wire_resets_total", "times every connection was dropped because the "
                                   "daemon's memory passed --memory-limit (what libzmq buffered for peers)").labels(*lv)
        self._tok_fallback = gauge("sluice_tokenizer_backend_fallback", "1: the manifest's tokenizer backend "
                                   "(recorded) is not installed here, so `tokenizers` (serving) encodes: the same "
                                   "ids, proven at freeze", ("recorded", "serving"))
        self._tok_threads = gauge("sluice_tokenizer_threads", "threads the daemon's tokenizer encodes with "
                                  "(--tokenizer-threads; its worker processes share them out), by serving backend",
                                  ("backend",))
        # The collector's pauses hold the GIL, so they stop the IO thread too (gcpause.py).
        gc_pause = family("histogram", "sluice_gc_pause_seconds", "cyclic garbage collector runs in the daemon's "
                          "process, by generation", ("generation",), buckets=_LATENCY_BUCKETS)
        self.gc_pause = [gc_pause.labels(*lv, str(g)) for g in range(3)]
        self.gc_frozen = gauge("sluice_gc_frozen_objects", "objects frozen out of the collector's reach after "
                               "the daemon's start-up and the compiled kernel's load").labels(*lv)
        self.gil_cpu = gauge("sluice_gil_cpu", "the CPU the daemon's IO loop and producers share (--gil-cpu); -1: "
                             "not pinned").labels(*lv)
        self.gil_cpu_moves = counter("sluice_gil_cpu_moves_total", "moves of those threads off a CPU other work "
                                     "kept busy").labels(*lv)
        self._committed = gauge("sluice_committed_step", "last committed step per replica", ("replica",))
        self._commit_lag = gauge("sluice_commit_lag_steps", "served step minus committed step", ("replica",))
        self._src_docs = counter("sluice_source_documents_total", "documents packed per source", ("source",))
        self._src_target = gauge("sluice_source_target_share", "declared mixture weight per source", ("source",))
        # Realized mixture from the data state of the last served step (so it
        # survives restarts and restores, unlike a counter), in the manifest's unit.
        self._src_realized = gauge("sluice_source_realized_units", "realized mixture units per source over the "
                                   "replica's lanes, since step 0", ("replica", "source"))
        self._src_debt = gauge("sluice_source_quota_debt_units", "target minus realized units per source over "
                               "the replica's lanes (positive = under-served)", ("replica", "source"))
        self._debt_bound = gauge("sluice_quota_debt_bound_units", "bound on |quota debt| per source of the "
                                 "replica (lanes x 1 unit for quota over counted units; lanes x B x max(k-1, 1) "
                                 "for quota over token units with piece draws of B tokens and k weighted "
                                 "sources; +Inf for token units of whole documents and categorical mixtures)",
                                 ("replica",))
        self._unit_col = {"documents": 3, "tokens": 4, "loss_tokens": 5, "sequences": 6}.get(unit, 3)
        # Per lane, quota over counted units stays within 1 unit; over token units with piece draws of
        # B tokens within B (1 - p_s) ahead and B (k - 2 + p_s) behind (docs/logical.md), so < B max(k-1, 1).
        # Whole documents have no bound independent of document lengths.
        k = sum(1 for w in source_weights if w > 0)
        self._lane_bound = float("inf")
        if policy == "quota" and unit in ("documents", "sequences"):
            self._lane_bound = 1.0
        elif policy == "quota" and unit in ("tokens", "loss_tokens") and piece_tokens is not None:
            self._lane_bound = float(piece_tokens * max(k - 1, 1))
        self._weights = list(source_weights)
        self._sources = list(source_names)
        self.sent = SentCounts(self, lv)
        self._cache_seen = (0, 0, 0, 0)
        self._states: dict[int, dict[str, Any]] = {}  # replica -> last served state (noted on the hot path)
        self._published: dict[int, dict[str, Any]] = {}
        self._lv = lv
        self._per_replica: dict[int, ReplicaGauges] = {}
        self._err_children: dict[str, Any] = {}
        self.source_docs = [self._src_docs.labels(*lv, n) for n in source_names]
        total = sum(source_weights) or 1.0
        for n, w in zip(source_names, source_weights, strict=True):
            self._src_target.labels(*lv, n).set(w / total)

    def served_sources(self, replica: int, counts: tuple[tuple[int, int], ...]) -> None:
        """Count one sent micro-batch's tokens per source, `counts` its (source index, tokens) (IO thread)."""
        self.sent.sources(replica, counts)

    def tokenizer_fallback(self, recorded: str, serving: str) -> None:
        """Say that `serving` encodes in place of the manifest's `recorded` backend (set once at start)."""
        self._tok_fallback.labels(*self._lv, recorded, serving).set(1)

    def tokenizer_threads(self, backend: str, threads: int) -> None:
        """The encoder threads of this process's tokenizer (set once at start)."""
        self._tok_threads.labels(*self._lv, backend).set(threads)

    def damaged(self, source: str, digest: str) -> None:
        """Count a damaged cached object of `source` (its manifest digest, or the derived key of its tokens)."""
        self._damaged.labels(*self._lv, source, digest).inc()

    @property
    def registry(self) -> Any:
        """A prometheus_client `CollectorRegistry` of these metrics only (made, and the package imported, once)."""
        with self._registry_lock:
            if self._registry is None:
                from prometheus_client import CollectorRegistry

                families = self._families

                class _Collector:  # the registry calls collect() on every scrape
                    def collect(self) -> Any:
                        return collect(families)

                self._registry = CollectorRegistry(auto_describe=True)
                self._registry.register(_Collector())
            return self._registry

    def families(self) -> list[Family]:
        """Every metric family, in exposition order."""
        return list(self._families)

    @property
    def label_values(self) -> tuple[str, str]:
        """(run_id, dataset_id): the labels every child carries first."""
        return self._lv

    def replica(self, replica: int) -> ReplicaGauges:
        """The gauges of one replica (queue steps, bytes and age, lead, pending, committed, commit lag)."""
        out = self._per_replica.get(replica)
        if out is None:
            r = str(replica)
            out = ReplicaGauges(*(g.labels(*self._lv, r) for g in (
                self._queue_steps, self._queue_bytes, self._queue_age, self._lead, self._pending,
                self._committed, self._commit_lag)))
            self._per_replica[replica] = out
        return out

    def note_state(self, replica: int, state: Any) -> None:
        """Hot path: remember the data state just served (a dict, or a not yet decoded state with `value()`:
        `StepEntry.state_later`); `publish_states` turns it into gauges later."""
        if state is not None:
            self._states[replica] = state

    def publish_states(self) -> None:
        """Off the hot path (housekeeping): gauges of every replica whose served state changed."""
        for replica, state in self._states.items():
            if self._published.get(replica) is not state:
                self.observe_state(replica, state if isinstance(state, dict) else state.value())
                self._published[replica] = state

    def observe_state(self, replica: int, state: dict[str, Any] | None) -> None:
        """Set realized units and quota debt per source from a served data state (`DataState.state_dict()`).

        Debt of source s = weight_s / sum(weights) x total - realized_s over the
        replica's lanes; each lane keeps it within one unit for counted units and
        within B max(k-1, 1) tokens under piece draws of B.
        """
        if not state or not isinstance(state.get("lanes"), dict):
            return
        totals = [0] * len(self._sources)
        lanes = state["lanes"]
        for lane in lanes.values():
            for i, cursor in enumerate(lane.get("sources", ())[: len(totals)]):
                totals[i] += int(cursor[self._unit_col])
        grand = sum(totals)
        wsum = sum(self._weights) or 1.0
        r = str(replica)
        for name, w, got in zip(self._sources, self._weights, totals, strict=True):
            self._src_realized.labels(*self._lv, r, name).set(got)
            self._src_debt.labels(*self._lv, r, name).set(w / wsum * grand - got)
        bound = self._lane_bound if self._lane_bound == float("inf") else len(lanes) * self._lane_bound
        self._debt_bound.labels(*self._lv, r).set(bound)

    def observe_cache(self, stats: Any) -> None:
        """Advance the cache counters to a `CacheStats` snapshot (the index counts; we export deltas)."""
        now = (stats.hits, stats.misses, stats.fill_bytes, stats.verify_failures)
        children = (self.cache_hits, self.cache_misses, self.cache_fill_bytes, self.cache_verify_failures)
        for child, new, old in zip(children, now, self._cache_seen, strict=True):
            child.inc(max(0, new - old))
        self._cache_seen = now

    def fast_path(self) -> dict[str, Any]:
        """STATS's ``fast_path`` block: steps per path (`STEP_PATHS`), fall-backs per reason (the reasons
        counted so far), whether the compiled kernel is loaded and is the module compiled ahead of time, and its
        loader's state (``off``, ``idle``, ``loading``, ``active``, ``failed``) with a failure's cause."""
        return {"steps_by_path": {p: int(c.get()) for p, c in self.steps_by_path.items()},
                "fallbacks": {r: int(c.get()) for r, c in self.fallbacks.items() if c.get()},
                "kernel_loaded": int(self.jit_loaded.get()), "kernel_ahead_of_time": int(self.jit_ahead.get()),
                "kernel": dict(self.jit_status)}

    def error(self, code: str) -> None:
        child = self._err_children.get(code)
        if child is None:
            child = self._err_children[code] = self._errors.labels(*self._lv, code)
        child.inc()

    def error_counts(self) -> dict[str, int]:
        return {code: int(c.get()) for code, c in self._err_children.items()}

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on addr:port (0 = any free port); returns the bound port.

        StartError names the address when it cannot be bound (port in use, no permission).
        """
        from prometheus_client import start_http_server

        from sluice.errors import StartError

        try:
            result = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise StartError(f"loaderd: cannot serve metrics on {addr}:{port} (--metrics-port): "
                             f"{exc.strerror or exc}; give another port, or 0 for any free one") from exc
        server = result[0] if isinstance(result, tuple) else None
        self._http = server
        return int(server.server_port) if server is not None else port

    def stop_http(self) -> None:
        """Stop serving /metrics and release its port (a no-op without `start_http`); for a short-lived
        exporter such as `sluice preflight`'s check, where the daemon's lives as long as its process."""
        server, self._http = getattr(self, "_http", None), None
        if server is not None:
            server.shutdown()
            server.server_close()


class SentCounts:
    """What the IO thread counts per BATCH it sends, in `Metrics`' one-writer children (no lock: the IO
    thread alone writes them, metricvalues.Tally): `batch` is the hot path, one call a BATCH."""

    def __init__(self, m: Metrics, lv: tuple[str, str]) -> None:
        self._ttb, self._batches = m.time_to_batch, m.batches
        self._bytes, self._tokens = m.served_bytes, m.served_tokens
        self._per_source, self._lv, self._sources = m._src_served, lv, m._sources
        self._children: dict[int, list[Any]] = {}  # replica -> its per-source children, made at its first BATCH

    def sources(self, replica: int, counts: tuple[tuple[int, int], ...]) -> None:
        """Count one sent micro-batch's tokens per source, `counts` its (source index, tokens)."""
        children = self._children.get(replica)
        if children is None:
            r = str(replica)
            children = self._children[replica] = [self._per_source.labels(*self._lv, r, n) for n in self._sources]
        for s, n in counts:
            children[s].inc(n)

    def batch(self, replica: int, arrays: dict[str, Any], sources: tuple[tuple[int, int], ...] | None,
              waited_s: float) -> None:
        """One BATCH sent: micro-batch `arrays`, its tokens per source `sources` ((source index, tokens); None:
        not counted), `waited_s` after its GET arrived. What ``time_to_batch.observe``, ``batches.inc``,
        ``served_bytes.inc``, ``served_tokens.inc`` and `sources` count, without a call per value."""
        ttb = self._ttb
        ttb.counts[bisect_left(ttb.bounds, waited_s)] += 1
        ttb.sum += waited_s
        self._batches.value += 1
        self._bytes.value += sum(map(_NBYTES, arrays.values()))
        self._tokens.value += arrays["input_ids"].size
        if sources is not None:  # (an empty count still makes the replica's series, as before)
            self.sources(replica, sources)
