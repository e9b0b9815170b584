"""The run's record from recorded samples, daemon logs and checkpoints (fast: files written here; the
end-to-end proof against real daemons and trainers is tests/test_report_record.py).

Specification (docs/observe.md, "The run's record"): tokens served are each daemon's counters at its last
sample, a counter that starts again (a daemon restarted at the same metrics port) adding what it had
counted; the steps trained come from the checkpoints, else the daemons' commits; the down time is the
allocated time no daemon was up (first sample, or its start's log line, to last sample); ETTR counts down
time, input wait over the replicas and replayed tokens against the allocated time. Bad input is an error
naming the file and line; what the input names is escaped on the page, which allows no script or fetch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

URL = "http://127.0.0.1:9100/metrics"


def sample(wall: float, served: float, code: float, docs: float, wait_s: float, waits: float,
           url: str = URL, source_names: tuple[str, str] = ("code", "docs")) -> dict:
    series = [["sluice_served_tokens_total", {}, served], ["sluice_batches_served_total", {}, served / 100],
              ["sluice_client_input_wait_seconds_sum", {}, wait_s], ["sluice_client_input_wait_seconds_count", {}, waits],
              ["sluice_client_input_wait_seconds_bucket", {"le": "0.01"}, waits],
              ["sluice_client_input_wait_seconds_bucket", {"le": "+Inf"}, waits],
              ["sluice_time_to_batch_seconds_bucket", {"le": "0.001"}, served / 100],
              ["sluice_time_to_batch_seconds_bucket", {"le": "+Inf"}, served / 100],
              ["sluice_generation", {}, 1 if wall < START + 105 else 2]]
    for name, v in zip(source_names, (code, docs)):
        series.append(["sluice_source_served_tokens_total", {"replica": "0", "source": name}, v])
    return {"kind": "sluice.metrics-sample", "url": url, "wall": wall, "series": series}


def log(wall: float, msg: str, **kw) -> dict:
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(round(wall % 1 * 1000)):03d}Z"
    return {"ts": ts, "level": "info", "msg": msg, **kw}


START = 1_700_000_000.0


def write_run(tmp_path: Path, names: tuple[str, str] = ("code", "docs")) -> tuple[Path, Path]:
    """A daemon at one metrics port: started, 3 samples, restarted at the same port, 2 samples."""
    t = START
    samples = [sample(t + 100, 0, 0, 0, 0, 0, source_names=names),
               sample(t + 101, 1000, 700, 300, 0.5, 10, source_names=names),
               sample(t + 102, 2000, 1400, 600, 1.0, 20, source_names=names),
               sample(t + 110, 500, 350, 150, 0.25, 5, source_names=names),  # the counters started again
               sample(t + 111, 800, 560, 240, 0.5, 8, source_names=names)]
    started = dict(metrics_port=9100, tokens_per_step=100, replicas=1, runspec_digest="b3:rs", dataset_id="b3:ds",
                   run_id="r1")
    logs = [log(t + 99.5, "loaderd listening", generation=1, **started),
            log(t + 100.5, "committed", replica=0, step=5, generation=1),
            log(t + 109, "loaderd listening", generation=1, **started),
            log(t + 109.5, "restored", replica=0, step=5, generation=2),
            log(t + 110.5, "committed", replica=0, step=9, generation=2)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp_path / "loaderd.log").write_text("".join(json.dumps(x) + "\n" for x in logs))
    return tmp_path / "samples.jsonl", tmp_path / "loaderd.log"


def test_the_record_adds_up_restarted_counters_and_counts_ettr_from_its_parts(tmp_path, sluice_main):
    samples, logf = write_run(tmp_path)
    out = sluice_main("report", "--metrics-log", samples, "--metrics-log", logf, "-o", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["kind"] == "sluice.run-record/1"
    assert (rec["dataset_id"], rec["runspec_digest"], rec["run_id"]) == ("b3:ds", "b3:rs", "r1")
    assert rec["served"]["tokens"] == 2800  # 2000 before the restart + 800 after
    assert rec["served"]["per_source"] == {"code": 1960, "docs": 840} and rec["served"]["padding_tokens"] == 0
    assert rec["served"]["per_replica"] == {"0": 2800}
    assert rec["trained"] == {"steps": 10, "steps_from": "daemon logs (committed)", "tokens_per_step": 100,
                              "tokens": 1000, "effective_tokens_per_s": pytest.approx(1000 / 11.5),
                              "committed_per_replica": {"0": 9}}
    assert rec["restarts"] == 1 and rec["restores"] == 1 and rec["fencing"]["generation_changes"] == 1
    assert rec["duration_s"] == pytest.approx(11.5)  # the first log line to the last sample
    assert rec["input_wait"]["seconds"] == pytest.approx(1.5) and rec["input_wait"]["micro_batches"] == 28
    e = rec["ettr"]
    # up: 99.5 (its start's log line) .. 102, and 109 (the restart's) .. 111: 4.5 s of 11.5
    assert e["down_s"] == pytest.approx(7.0) and e["stall_s"] == pytest.approx(1.5)
    assert e["replayed_tokens"] == 1800 and e["replay_s"] == pytest.approx(3.0 * 1800 / 2800)
    assert e["value"] == pytest.approx((11.5 - 7.0 - 1.5 - 3.0 * 1800 / 2800) / 11.5)


def test_checkpoints_are_the_steps_trained_and_are_listed(tmp_path, sluice_main):
    from sluice.trainer_hooks.layout import CheckpointManifest, ckpt_name

    samples, logf = write_run(tmp_path)
    for step, gen in ((4, 1), (11, 2)):
        folder = tmp_path / "ck" / "ckpt" / ckpt_name(step, gen)
        folder.mkdir(parents=True)
        data = {"key": "data", "step": step, "dataset_id": "b3:ds", "runspec_digest": "b3:rs"}
        (folder / "manifest.json").write_bytes(CheckpointManifest(
            step=step, generation=gen, format="torch", keys=(), shards=(), created_unix_ns=0, run_id="r1",
            data=data).to_bytes())
    out = sluice_main("report", "--metrics-log", samples, "--metrics-log", logf, "--checkpoints", tmp_path / "ck",
                      "-o", tmp_path / "r.html", "--json", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["trained"]["steps"] == 12 and rec["trained"]["steps_from"] == "checkpoints"
    assert [(c["step"], c["generation"], c["data_step"]) for c in rec["checkpoints"]] == [(4, 1, 4), (11, 2, 11)]
    assert rec["dataset_id"] == "b3:ds"  # the daemons and the checkpoints agree
    page = (tmp_path / "r.html").read_text()
    assert '<div data-figure="trained-steps"><dt>steps trained</dt><dd>12</dd>' in page
    assert "s000000000011-g000002" in page
    bad = sluice_main("report", "--metrics-log", samples, "--checkpoints", tmp_path / "nothing", "-o",
                      tmp_path / "r.json")
    assert bad.returncode == 2 and "--checkpoints" in bad.stderr and "not a folder" in bad.stderr


def test_the_page_escapes_source_names_and_allows_no_script_or_fetch(tmp_path, sluice_main):
    samples, logf = write_run(tmp_path, names=("<script>alert(1)</script>", "a\x1b[2Jb"))
    out = sluice_main("report", "--metrics-log", samples, "--metrics-log", logf, "-o", tmp_path / "r.html")
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "\x1b" not in page and "a\\x1b[2Jb" in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert '<div data-figure="served-tokens"><dt>tokens served</dt><dd>2,800</dd>' in page


@pytest.mark.parametrize("line,named", [
    (log(START, "committed", replica=0, step="nine"), "a commit of replica 0 at step 'nine'"),
    (log(START, "loaderd listening", tokens_per_step=-1), "tokens_per_step is -1"),
    ({**sample(START, 1, 1, 0, 0, 0), "series": [["sluice_source_served_tokens_total", {"source": "a"}, "NaN"]]},
     "sluice_source_served_tokens_total is 'NaN'"),
])
def test_bad_lines_are_refused_naming_the_file_line_and_field(tmp_path, sluice_main, line, named):
    f = tmp_path / "log.jsonl"
    f.write_text(json.dumps(log(START, "loaderd listening")) + "\n" + json.dumps(line) + "\n")
    out = sluice_main("report", "--metrics-log", f, "-o", tmp_path / "r.json")
    assert out.returncode == 2 and f"{f}, line 2" in out.stderr and named in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r.json").exists()


def test_a_report_needs_some_input(tmp_path, sluice_main):
    out = sluice_main("report", "-o", tmp_path / "r.json")
    assert out.returncode == 2 and "give a ledger or run folder, --metrics-log FILE, or both" in out.stderr


def test_a_long_series_is_decimated_and_its_rates_stay_means_over_time():
    from sluice.observe.totals import MAX_POINTS, Daemon, add_sample, rates

    d, keys = Daemon(), [0]
    n = 3 * MAX_POINTS
    for i in range(n):  # 10 tokens a second, a wait of 2 ms per micro-batch, one a second
        s = sample(START + i, 10.0 * i, 7.0 * i, 3.0 * i, 0.002 * i, float(i))
        add_sample(d, s["wall"], [tuple(x) for x in s["series"]], "here", keys)
    assert len(d.points) <= 2 * MAX_POINTS and d.points[-1][0] == START + n - 1
    got = rates(d.points)
    assert all(r == pytest.approx(10.0) and w == pytest.approx(0.002) for _, r, w in got)
    assert d.total("sluice_served_tokens_total") == 10.0 * (n - 1)


def test_the_token_bars_of_a_source_lie_side_by_side_with_their_values():
    """Served and drawn bars of one source never overlap (on the old page the loss-token bar was drawn over
    the token bar), and each bar is labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sluice.observe import charts

    rows = [{"source": "code", "served": 10058, "tokens": 8783}, {"source": "docs", "served": 4278, "tokens": 3765},
            {"source": "padding", "served": 12, "padding": True}]
    fig = charts.tokens(rows, 11)
    ax = fig.axes[0]
    bars = [(p.get_y(), p.get_y() + p.get_height(), p.get_width()) for p in ax.patches]
    labels = {t.get_text() for t in ax.texts}
    plt.close(fig)
    assert len(bars) == 6  # (padding has no drawn bar: a bar of 0)
    spans = sorted((lo, hi) for lo, hi, _ in bars)
    assert all(a_hi <= b_lo for (_, a_hi), (b_lo, _) in zip(spans, spans[1:]))  # disjoint
    assert {"10,058", "8,783", "4,278", "3,765", "12"} <= labels
