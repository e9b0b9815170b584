"""Progress and fast failures: long commands show progress on stderr (never under
--json or with --no-progress), a client with no daemon fails within seconds
naming the endpoint, and a daemon restart's expected refusals log once at info.
"""

from __future__ import annotations

import json
import time

import pytest

from loaderd_support import Daemon, build_corpus, dealer

from sluice.wire import decoding, encoding, protocol


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("progress"), "sltok", tokenizer_file)


@pytest.mark.slow  # eight CLI processes
def test_plan_ledger_freeze_warm_show_progress_on_stderr_only_when_asked(corpus, sluice_cli, tmp_path):
    m, r = corpus / "manifest.json", corpus / "run.toml"
    shown = sluice_cli("plan", m, r, "--steps", "0:3", "--progress")
    assert shown.returncode == 0, shown.stderr
    assert "plan" in shown.stderr and "step" in shown.stderr  # tqdm's bar: "plan: ... 3/3 [..., step/s]"
    assert len(shown.stdout.splitlines()) == 3 and "plan:" not in shown.stdout
    for quiet in (("--json",), ("--no-progress",), ()):  # stderr is a pipe here, not a terminal
        out = sluice_cli("plan", m, r, "--steps", "0:3", *quiet)
        assert out.returncode == 0 and out.stderr == "", (quiet, out.stderr)
    frz = sluice_cli("manifest", "freeze", corpus / "dataset.toml", "-o", tmp_path / "m.json", "--progress")
    assert frz.returncode == 0 and "freeze" in frz.stderr and "objects" in frz.stderr, frz.stderr
    # the manifest lies outside the corpus folder: its objects' folder must be allowed explicitly
    roots = ("--allow-root", corpus)
    warm = sluice_cli("cache", "warm", tmp_path / "m.json", tmp_path / "cache", "--budget", "1G", "--progress", *roots)
    assert warm.returncode == 0 and "warm cache" in warm.stderr, warm.stderr
    forced = sluice_cli("cache", "warm", tmp_path / "m.json", tmp_path / "cache", "--json", "--progress",
                        *roots)  # explicit wins
    assert forced.returncode == 0 and "warm cache" in forced.stderr
    led = sluice_cli("ledger", m, r, "--until-step", "5", "--every", "2", "--json")
    assert led.returncode == 0 and led.stderr == ""
    lines = [json.loads(x) for x in led.stdout.splitlines()]
    assert [x["until_step"] for x in lines] == [1, 3, 5]  # a series: after steps 1 and 3, then the final one
    assert lines[-1]["sources"][0]["source"] == "code"


def test_a_client_with_no_daemon_fails_within_seconds_naming_the_endpoint(tmp_path):
    from sluice.client import Client, DaemonUnavailable

    endpoint = f"ipc://{tmp_path}/no-daemon.sock"
    assert Client(endpoint, 0, 1, run_id="r", dataset_id="b3:" + "0" * 64).connect_s <= 5  # the default
    c = Client(endpoint, 0, 1, run_id="r", dataset_id="b3:" + "0" * 64, as_numpy=True, connect_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable) as info:
        next(iter(c))
    assert time.monotonic() - t0 < 5  # not the 60 s a restarting daemon gets
    assert endpoint in str(info.value)
    c.close()


def test_a_first_connection_waits_for_something_listening_but_slow(tmp_path):
    """A socket that accepts but never answers is a slow daemon, not a missing one:
    the client waits reconnect_s, not connect_s."""
    import socket

    from sluice.client import Client, DaemonUnavailable

    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(8)
        c = Client(f"ipc://{path}", 0, 1, run_id="r", dataset_id="b3:" + "0" * 64, as_numpy=True,
                   connect_s=0.3, reconnect_s=1.5, timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            next(iter(c))
        assert 1.4 < time.monotonic() - t0 < 6
        c.close()


@pytest.mark.slow
def test_a_daemon_restart_logs_its_expected_refusals_once_at_info(corpus, tmp_path):
    endpoint = f"ipc://{tmp_path}/ld.sock"
    extra = ("--log-level", "info")
    d = Daemon(corpus, endpoint=endpoint, cache=tmp_path / "cache", extra=extra).start()
    c = d.client(0, 1, timeout_s=1.0, reconnect_s=60.0, credits=8)
    logs = []
    old = None
    try:
        for n, mb in enumerate(c):
            if n == 3:
                old = c.instance
                d.kill9()
                logs.append(d.log)
                d = Daemon(corpus, endpoint=endpoint, cache=tmp_path / "cache", extra=extra).start()
            if mb["step"] == 6:
                break
        assert c.reconnects >= 1
        # A GET the client queued for the killed daemon reaches the new one only if the client sent one between
        # the kill and its reconnect (timing): this one always does, so the log below always holds a refusal.
        stale = dealer(d)
        try:
            stale.send_multipart(encoding.encode(protocol.Header(
                kind=protocol.GET, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"], replica=0, step=7,
                micro=0, request_id=1, instance=old)))
            assert stale.poll(10_000), "no answer to a GET of the killed daemon's instance"
            assert decoding.decode(stale.recv_multipart(), protocol.Limits.for_client()).kind == protocol.ERROR
        finally:
            stale.close(0)
    finally:
        c.close()
        d.stop()
    logs.append(d.log)
    records = [json.loads(x) for p in logs for x in p.read_text().splitlines() if x.startswith("{")]
    codes = ("SHUTTING_DOWN", "WRONG_INSTANCE", "FENCED")
    expected = [x for x in records if x.get("code") in codes]
    assert expected and all(x["level"] == "info" for x in expected), expected
    for code in codes:
        assert sum(1 for x in expected if x["code"] == code) <= 1
    assert not [x for x in records if x["level"] == "warning"], "a restart is not a warning"


@pytest.mark.parametrize(("flags", "tty", "shown"), [
    ({}, True, True), ({}, False, False), ({"json": True}, True, False), ({"progress": False}, True, False),
    ({"progress": True}, False, True), ({"progress": True, "json": True}, True, True),
])
def test_progress_rule(flags, tty, shown, monkeypatch):
    """Default: on a terminal, not under --json; an explicit --progress/--no-progress decides."""
    import argparse
    import io

    from sluice.progress import progress_wanted

    class Err(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr("sys.stderr", Err())
    args = argparse.Namespace(**{"progress": None, "json": False, **flags})
    assert progress_wanted(args) is shown
