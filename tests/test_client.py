"""The client: light import, torch tensors on the frames, Stateful state, embedded mode, `sluice peek`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.errors import StateError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("client"), "jsonl.zst", tokenizer_file, docs=160)


def test_import_is_light():
    code = ("import sys, sluice.client; "
            "print(json.dumps(sorted(m for m in ('torch', 'pyarrow', 'tokenizers', 'lmdb', 'sluice.loaderd') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_tensors_state_dict_and_restore(corpus, tmp_path):
    import torch

    ref = reference(corpus, 8, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        c = d.client(0, 1, as_numpy=False)
        mb = next(c)
        assert set(mb) == {"input_ids", "labels", "position_ids", "cu_seqlens", "step", "micro"}
        assert isinstance(mb["input_ids"], torch.Tensor) and mb["input_ids"].dtype == torch.int32
        assert mb["input_ids"].shape == (2, 64)
        assert (mb["step"], mb["micro"]) == (0, 0)
        with pytest.raises(StateError, match="no step completed yet"):
            c.state_dict()
        rest = [next(c) for _ in range(4 * 3 - 1)]  # through the end of step 2
        sd = c.state_dict()  # the data state itself: what the checkpoint stores
        assert sd["kind"] == "sluice.data-state" and sd["step"] == 2 and json.loads(json.dumps(sd)) == sd
        # torch.save / load round trip of a Stateful's dict
        path = tmp_path / "sd.pt"
        torch.save(sd, path)
        loaded = torch.load(path, weights_only=True)
        c2 = d.client(0, 1)
        c2.load_state_dict(loaded)
        assert c2.generation == 1  # without a fence: the generation after the daemon's
        after = [next(c2) for _ in range(8)]
        assert after[0]["step"] == 3
        got = stream_digests(after, 4)
        assert got == {3: ref[(3, 0)][0], 4: ref[(4, 0)][0]}
        assert c2.total_wait_s >= 0 and c2.batches == 8
        with pytest.raises(StateError, match="differs from this run's"):
            c2.reset({**sd, "dataset_id": "b3:" + "2" * 64})
        with pytest.raises(StateError, match="differs from this run's"):
            c2.reset({**sd, "runspec_digest": "b3:" + "2" * 64})
        with pytest.raises(StateError, match="not a sluice data state"):
            c2.reset({**sd, "kind": "other"})
        with pytest.raises(StateError):
            c2.commit(99)
        del rest
        c.close()
        c2.close()


def test_embedded_client_gives_the_plan_stream(corpus, tmp_path):
    from sluice.client import embedded_client

    ref = reference(corpus, 6, 1)
    with embedded_client(corpus / "manifest.json", corpus / "run.toml", cache_dir=tmp_path / "cache",
                         as_numpy=True) as client:
        got = []
        for mb in client:
            got.append({k: np.asarray(v).copy() if k not in ("step", "micro") else v for k, v in mb.items()})
            if mb["step"] == 5 and mb["micro"] == 3:
                break
        proc = client.daemon.proc
    assert stream_digests(got, 4) == {s: ref[(s, 0)][0] for s in range(6)}
    assert proc.returncode == 0  # SIGTERM drained it cleanly


def test_peek_prints_what_plan_prints(corpus, tmp_path, sluice_cli):
    plan = sluice_cli("plan", corpus / "manifest.json", corpus / "run.toml", "--steps", "0:5", "--replicas", "2",
                      "--json", "--cache", tmp_path / "plan-cache")
    assert plan.returncode == 0, plan.stderr
    want = [json.loads(x) for x in plan.stdout.splitlines() if json.loads(x)["replica"] == 1]
    with Daemon(corpus, replicas=2, serve="1", cache=tmp_path / "cache") as d:
        peek = sluice_cli("peek", d.endpoint, "--steps", "0:5", "--replica", "1", "--json")
        assert peek.returncode == 0, peek.stderr
        got = [json.loads(x) for x in peek.stdout.splitlines()]
        assert got == want
        text = sluice_cli("peek", d.endpoint, "--steps", "5:6", "--replica", "1", "--observe")
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith("step      5 replica 1  ")
        bad = sluice_cli("peek", d.endpoint, "--steps", "0:1", "--replica", "0")
        assert bad.returncode == 2 and "serves replicas [1]" in bad.stderr


def test_steps_yields_whole_global_steps_and_checks_where_the_trainer_resumes(corpus, tmp_path):
    ref = reference(corpus, 4, 1)
    with Daemon(corpus, cache=tmp_path / "cache") as d:
        # identity read from the daemon: no run ID or dataset ID given
        from sluice.client import Client

        client = Client(d.endpoint, replica=0, replicas=1, timeout_s=10.0, end_step=4)
        client.fence(3)
        client.reset()  # start over at step 0 under the writer's generation 3
        assert client.generation == 3
        assert (client.run_id, client.dataset_id) == (d.info["run_id"], d.info["dataset_id"])
        with pytest.raises(StateError, match="older than this client's 3"):
            client.fence(2)  # a fencing token never goes down
        with pytest.raises(StateError, match="the trainer resumes at step 2"):
            next(client.steps(2))
        got = list(client.steps(0))
        assert [s for s, _ in got] == [0, 1, 2, 3]
        assert all(len(m) == 4 and {mb["step"] for mb in m} == {s} for s, m in got)
        assert stream_digests([mb for _, m in got for mb in m], 4) == {s: ref[(s, 0)][0] for s in range(4)}
        assert client.commit(3) == 3
        client.close()
