"""`Client` takes a frozen `ClientConfig` (+ `StreamOptions`); the keyword form every caller used still works.

Making a Client connects nothing (the first batch does), so most checks need no
daemon; one streams from a real one both ways.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from loaderd_support import Daemon, build_corpus, stream_digests
from sluice.client import Client, ClientConfig, StreamOptions, Timeouts
from sluice.errors import SpecError

TOKEN = "t" * 32


def _seen(c: Client) -> tuple:
    return (c.endpoint, c.replica, c.replicas, c.run_id, c.dataset_id, c._token, c.curve, c.timeout_s, c.reconnect_s,
            c.connect_s, c.max_wait_s, c.credits, c.peers, c.samples, c.observe, c._start_step, c.end_step,
            c.as_numpy)


def test_the_config_and_the_keywords_make_the_same_client() -> None:
    config = ClientConfig(endpoint="ipc:///tmp/nowhere.sock", replica=1, replicas=2, run_id="r", dataset_id="d",
                          token=TOKEN, timeouts=Timeouts(timeout_s=3.0, reconnect_s=4.0, connect_s=1.0, max_wait_s=9.0))
    stream = StreamOptions(credits=2, peers=2, samples=True, observe=True, start_step=5, end_step=9, as_numpy=True)
    a = Client(config, stream=stream)
    b = Client("ipc:///tmp/nowhere.sock", 1, 2, run_id="r", dataset_id="d", token=TOKEN, timeout_s=3.0,
               reconnect_s=4.0, connect_s=1.0, max_wait_s=9.0, credits=2, peers=2, samples=True, observe=True,
               start_step=5, end_step=9, as_numpy=True)
    c = Client(config, credits=2, peers=2, samples=True, observe=True, start_step=5, end_step=9, as_numpy=True)
    d = Client(endpoint="ipc:///tmp/nowhere.sock", replica=1, replicas=2, run_id="r", dataset_id="d", token=TOKEN,
               timeout_s=3.0, reconnect_s=4.0, connect_s=1.0, max_wait_s=9.0, stream=stream)
    assert _seen(a) == _seen(b) == _seen(c) == _seen(d) == ("ipc:///tmp/nowhere.sock", 1, 2, "r", "d", TOKEN, None, 3.0, 4.0, 1.0,
                                                9.0, 2, 2, True, True, 5, 9, True)
    assert a.config == b.config and a.stream_options == b.stream_options
    assert TOKEN not in repr(config)  # the token is never printed
    for x in (a, b, c, d):
        x.close()


def test_defaults_are_those_of_before(monkeypatch) -> None:
    monkeypatch.delenv("SLUICE_TOKEN", raising=False)
    c = Client("ipc:///tmp/nowhere.sock")
    assert _seen(c) == ("ipc:///tmp/nowhere.sock", 0, 1, None, None, None, None, 10.0, 60.0, 5.0, 900.0, 16, 1, False,
                        False, None, None, False)
    c.close()
    monkeypatch.setenv("SLUICE_TOKEN", TOKEN)  # read when the Client is made, whichever form
    for c in (Client("ipc:///tmp/nowhere.sock"), Client(ClientConfig(endpoint="ipc:///tmp/nowhere.sock"))):
        assert c._token == TOKEN
        c.close()


def test_the_constructor_and_the_config_stay_small() -> None:
    params = [p for p in inspect.signature(Client.__init__).parameters if p != "self"]
    assert len(params) <= 8, params
    assert len(dataclasses.fields(ClientConfig)) <= 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientConfig(endpoint="ipc:///x").replica = 3  # type: ignore[misc]


def test_what_does_not_fit_is_refused_naming_it() -> None:
    config = ClientConfig(endpoint="ipc:///tmp/nowhere.sock")
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        Client("ipc:///tmp/nowhere.sock", timeout=3)
    with pytest.raises(TypeError, match="replica is the ClientConfig's"):
        Client(config, 1)
    with pytest.raises(TypeError, match="timeout_s is the ClientConfig's"):
        Client(config, timeout_s=3)
    with pytest.raises(TypeError, match="give stream= or credits=, not both"):
        Client(config, stream=StreamOptions(), credits=2)
    with pytest.raises(TypeError, match="expected a ClientConfig or an endpoint string, got int"):
        Client(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a ClientConfig or an endpoint string, got NoneType"):
        Client()
    with pytest.raises(TypeError, match="multiple values for argument 'endpoint'"):
        Client("ipc:///a.sock", endpoint="ipc:///b.sock")
    with pytest.raises(ValueError, match="credits must be >= 1, got 0"):
        Client("ipc:///tmp/nowhere.sock", credits=0)
    with pytest.raises(ValueError, match="max_wait_s must be > 0, got 0"):
        Timeouts(max_wait_s=0)
    with pytest.raises(SpecError, match="client token: a run token must be 16 to"):
        ClientConfig(endpoint="ipc:///x", token="short")


def test_a_config_made_client_streams_what_the_keyword_one_does(tmp_path, tokenizer_file) -> None:
    root = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=60, objects=1)
    with Daemon(root, cache=tmp_path / "cache") as d:
        by_keywords = d.client(0, 1, observe=True)
        config = ClientConfig(endpoint=d.endpoint, run_id=d.info["run_id"], dataset_id=d.info["dataset_id"],
                              token=d.token, timeouts=Timeouts(timeout_s=10.0))
        by_config = Client(config, stream=StreamOptions(observe=True, as_numpy=True))
        try:
            a = [next(by_keywords) for _ in range(8)]
            b = [next(by_config) for _ in range(8)]
        finally:
            by_keywords.close()
            by_config.close()
    assert stream_digests(a, 4) == stream_digests(b, 4) and len(stream_digests(a, 4)) == 2
