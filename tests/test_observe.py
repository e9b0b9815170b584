"""Live views against a real daemon: the Grafana dashboard and alert rules query
only metrics the daemon exports, and `sluice top --once` shows its replicas and
numbers; a missing daemon is an error within seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaderd_support import Daemon, build_corpus
from sluice.cli import main as sluice_main

REPO = Path(__file__).resolve().parent.parent

# Words of PromQL that are not metric names: functions, aggregations, keywords.
_PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "deriv", "abs", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "label_values", "topk", "bottomk", "clamp_min", "clamp_max", "delta", "idelta", "vector", "scalar",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers left after removing label
    matchers, grouping clauses, ranges, strings, numbers, Grafana variables and
    PromQL's own words."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables ($run_id, ${datasource}, $__rate_interval)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # grouping label lists
    e = re.sub(r"label_values\(([^,()]*),\s*\w+\s*\)", r"\1", e)  # Grafana: label_values(metric, label)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e))
    return {w for w in words if w not in _PROMQL_WORDS and not re.fullmatch(r"e\d*|inf|nan", w, re.IGNORECASE)}


def test_promql_metric_names_reads_what_a_query_selects():
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le, run_id) (rate(sluice_a_bucket{run_id=~"$run_id"}[5m]))) > 0.25'
    ) == {"sluice_a_bucket"}
    assert promql_metric_names(
        "abs(sluice_debt) > ignoring(source) group_left sluice_bound and deriv(sluice_lag[15m]) > 0"
    ) == {"sluice_debt", "sluice_bound", "sluice_lag"}
    assert promql_metric_names("label_values(sluice_generation, run_id)") == {"sluice_generation"}


def exported_names(text: str) -> set[str]:
    """Every series name a Prometheus text exposition declares or carries (histograms: _bucket/_sum/_count)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def dashboard_and_rule_queries() -> list[tuple[str, str]]:
    import yaml

    dash = json.loads((REPO / "deploy/grafana/sluice.json").read_text())
    out = [(f"dashboard panel {p['title']!r}", t["expr"]) for p in dash["panels"] for t in p["targets"]]
    out += [(f"dashboard variable {v['name']!r}", v["query"]["query"]) for v in dash["templating"]["list"]
            if isinstance(v.get("query"), dict)]
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory, tokenizer_file):
    """A real daemon (two replicas, metrics on) that has served and committed a few steps."""
    root = build_corpus(tmp_path_factory.mktemp("observe"), "sltok", tokenizer_file)
    # --metrics-ids: `top` names the run from the labels (without it they say "hidden": test_wire_bounds.py)
    d = Daemon(root, replicas=2, extra=("--metrics-port", "0", "--metrics-ids")).start()
    try:
        for r in (0, 1):
            c = d.client(r, 2)
            try:
                for mb in c:
                    if mb["step"] == 2 and mb["micro"] == int(c.info["micro_per_step"]) - 1:
                        c.commit(1)
                        break
            finally:
                c.close()
        time.sleep(1.2)  # one housekeeping pass exports the queue gauges and cache counters
        yield d
    finally:
        d.stop()


def test_every_metric_the_dashboard_and_alerts_query_is_exported_by_a_live_daemon(live):
    text = urllib.request.urlopen(f"http://127.0.0.1:{live.info['metrics_port']}/metrics", timeout=10).read().decode()
    exported = exported_names(text)
    queries = dashboard_and_rule_queries()
    assert len(queries) >= 17
    wanted = {"tokens": "sluice_served_tokens_total", "time to batch": "sluice_time_to_batch_seconds_bucket",
              "input wait": "sluice_client_input_wait_seconds_bucket", "queue": "sluice_queue_depth_steps",
              "age": "sluice_queue_age_seconds", "hits": "sluice_cache_hits_total",
              "fill": "sluice_cache_fill_bytes_total", "verify": "sluice_cache_verify_failures_total",
              "realized": "sluice_source_realized_units", "target": "sluice_source_target_share",
              "generation": "sluice_generation", "commit lag": "sluice_commit_lag_steps",
              "debt": "sluice_source_quota_debt_units"}
    queried: set[str] = set()
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{where} queries {sorted(missing)}, which the daemon does not export"
        queried |= names
    assert set(wanted.values()) <= queried
    # the state-derived gauges carry real values: both replicas, shares of the one source
    assert 'sluice_source_realized_units{dataset_id=' in text and 'replica="1"' in text
    bound = [line for line in text.splitlines() if line.startswith("sluice_quota_debt_bound_units{")]
    assert len(bound) == 2 and all(float(line.split()[-1]) == 2.0 for line in bound)  # 4 lanes / 2 replicas


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = sluice_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_top_once_shows_each_replica_with_numbers(live, tmp_path):
    record = tmp_path / "samples.jsonl"
    rc, out, err = run_cli("top", live.endpoint, "--once", "--interval", "0.3", "--width", "200",
                           "--record", str(record))
    assert rc == 0, err
    assert "tokens/s" in out and "replicas" in out
    rows = {m.group(1): m.group(0) for m in re.finditer(r"r([01])\s.*", out)}
    assert set(rows) == {"0", "1"}, out
    assert "code" in out and "100.0%" in out  # the one source: realized and target share
    assert re.search(r"\bt\b.*127\.0\.0\.1:\d+/metrics", out)  # the run and where its numbers come from
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert len(lines) == 2 and all(x["kind"] == "sluice.metrics-sample" for x in lines)


def test_top_accepts_the_metrics_url_itself(live):
    url = f"http://127.0.0.1:{live.info['metrics_port']}"
    rc, out, err = run_cli("top", url, "--once", "--interval", "0.1", "--width", "200")
    assert rc == 0, err
    assert f"127.0.0.1:{live.info['metrics_port']}/metrics" in out


def test_top_without_a_daemon_is_a_clear_error_within_seconds(tmp_path):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    t0 = time.monotonic()
    rc, out, err = run_cli("top", endpoint, "--once", "--timeout", "30")
    assert rc == 2 and time.monotonic() - t0 < 5  # nothing listens: no need to wait out the timeout
    assert err.startswith("sluice: error:") and endpoint in err and "Traceback" not in err
    rc, _, err = run_cli("top", "http://127.0.0.1:9/metrics", "--once", "--timeout", "1")
    assert rc == 2 and "http://127.0.0.1:9/metrics" in err


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=st.lists(st.integers(1, 9), min_size=2, max_size=4), replicas=st.sampled_from([1, 2, 4]),
       steps=st.integers(1, 10))
def test_exported_quota_debt_stays_within_the_exported_bound(weights, replicas, steps):
    """The premise of the SluiceQuotaDebtBeyondBound alert: under `quota` over documents
    the debt the daemon exports from each served state never exceeds the bound it exports."""
    from logical_helpers import fake_docs, make_manifest, make_spec

    from sluice.loaderd.logical import Plan
    from sluice.loaderd.metrics import Metrics

    sources = [(f"s{i}", [200, 57], str(w), "repeat") for i, w in enumerate(weights)]
    manifest = make_manifest(sources)
    plan = Plan(manifest, make_spec())
    metrics = Metrics("r1", manifest.dataset_id, [s[0] for s in sources], [float(w) for w in weights])
    docs, state = fake_docs(), plan.initial_state()
    per = plan.spec.lanes // replicas
    for _ in range(steps):
        _, state = plan.step(state, docs)
        for r in range(replicas):
            metrics.observe_state(r, state.subset(range(r * per, (r + 1) * per)).state_dict())
            labels = {"run_id": "r1", "dataset_id": manifest.dataset_id, "replica": str(r)}
            bound = metrics.registry.get_sample_value("sluice_quota_debt_bound_units", labels)
            assert bound == per
            debts = [metrics.registry.get_sample_value("sluice_source_quota_debt_units", {**labels, "source": s[0]})
                     for s in sources]
            assert all(abs(d) < bound for d in debts), (debts, bound)
            assert abs(sum(debts)) < 1e-6  # debts are shares of one total
