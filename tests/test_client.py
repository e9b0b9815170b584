"""The client: light import, torch tensors on the frames, Stateful state, embedded mode, `sluice peek`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice import wire
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
        assert list(mb) == [*wire.BATCH_ARRAYS, "step", "micro"]  # every declared array (sluice/batcharrays.py)
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


def test_a_new_client_of_the_running_embedded_daemon_restores_where_the_old_one_stopped(corpus, tmp_path):
    from sluice.client import embedded_client
    from sluice.errors import DaemonUnavailable

    ref = reference(corpus, 6, 1)
    first = embedded_client(corpus / "manifest.json", corpus / "run.toml", cache_dir=tmp_path / "cache",
                            as_numpy=True)
    daemon = first.daemon
    try:
        got = []
        for mb in first:
            got.append({k: np.asarray(v).copy() if k not in ("step", "micro") else v for k, v in mb.items()})
            if (mb["step"], mb["micro"]) == (3, 1):  # stop inside step 3: a restarted trainer resumes after step 2
                break
        state = first.state_dict_at(2)
        first.close(keep_daemon=True)
        assert daemon.proc.poll() is None  # kept running
        with daemon.client(as_numpy=True) as second:
            second.reset(state)
            for mb in second:
                got.append({k: np.asarray(v).copy() if k not in ("step", "micro") else v for k, v in mb.items()})
                if (mb["step"], mb["micro"]) == (5, 3):
                    break
    finally:
        code = daemon.close()
    # got: steps 0-2 and step 3's first two micro-batches from the first client, then steps 3-5 from the second
    assert [(g["step"], g["micro"]) for g in got[14:]] == [(s, m) for s in range(3, 6) for m in range(4)]
    assert stream_digests(got[:12] + got[14:], 4) == {s: ref[(s, 0)][0] for s in range(6)}
    assert code == 0
    with pytest.raises(DaemonUnavailable, match="exited"):
        daemon.client()


def test_peek_prints_what_plan_prints(corpus, tmp_path, sluice_main):
    plan = sluice_main("plan", corpus / "manifest.json", corpus / "run.toml", "--steps", "0:5", "--replicas", "2",
                      "--json", "--cache", tmp_path / "plan-cache")
    assert plan.returncode == 0, plan.stderr
    want = [json.loads(x) for x in plan.stdout.splitlines() if json.loads(x)["replica"] == 1]
    with Daemon(corpus, replicas=2, serve="1", cache=tmp_path / "cache") as d:
        peek = sluice_main("peek", d.endpoint, "--steps", "0:5", "--replica", "1", "--json")
        assert peek.returncode == 0, peek.stderr
        got = [json.loads(x) for x in peek.stdout.splitlines()]
        assert got == want
        text = sluice_main("peek", d.endpoint, "--steps", "5:6", "--replica", "1", "--observe")
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith("step      5 replica 1  ")
        bad = sluice_main("peek", d.endpoint, "--steps", "0:1", "--replica", "0")
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


def as_saved_by_two_ranks(folder, lanes_of_rank: dict[int, list[str]]) -> None:
    """Rewrite a one-rank checkpoint as two ranks wrote it: each rank's data shard holds its lanes."""
    import blake3

    from sluice.trainer_hooks.layout import MANIFEST_NAME

    man = json.loads((folder / MANIFEST_NAME).read_bytes())
    shards = [s for s in man["shards"] if s["key"] not in ("data", "rng")]
    for key in ("data", "rng"):
        entry = next(s for s in man["shards"] if s["key"] == key)
        state = json.loads((folder / entry["file"]).read_bytes())
        for rank, lanes in lanes_of_rank.items():
            part = {**state, "lanes": {k: state["lanes"][k] for k in lanes}} if key == "data" else state
            blob = json.dumps(part).encode()
            (folder / f"{key}-r{rank}.json").write_bytes(blob)
            shards.append({**entry, "file": f"{key}-r{rank}.json", "rank": rank, "bytes": len(blob),
                           "blake3": blake3.blake3(blob).hexdigest()})
    man["shards"] = shards
    man["extra"].update(world_size=len(lanes_of_rank), replicated=["model"])
    (folder / MANIFEST_NAME).write_text(json.dumps(man))


def test_resume_exact_refuses_a_resize_naming_both_sizes_and_exact_elastic_allows_it(corpus, tmp_path):
    """Under `resume = "exact"` (the default) a checkpoint saved by 2 data-parallel ranks does not
    restore on 1: the manager asks the client, which knows the run spec's contract from the daemon.
    The same checkpoint restores under `exact-elastic` (resume is not in the run-spec digest)."""
    import shutil

    import torch

    from sluice.errors import ResizeRefused
    from sluice.trainer_hooks.manager import CheckpointManager

    root = tmp_path / "corpus"
    shutil.copytree(corpus, root, ignore=shutil.ignore_patterns("cache", "loaderd-*.log"))
    ref = reference(root, 4, 1)
    with Daemon(root, cache=tmp_path / "cache") as d:
        c = d.client(0, 1)
        assert c.resume_contract == "exact"
        for _ in range(4 * 2):  # steps 0 and 1 (4 micro-batches each)
            next(c)
        mgr = CheckpointManager(tmp_path / "ck", {"model": torch.nn.Linear(2, 2), "data": c})
        mgr.save(1)
        folder = next((tmp_path / "ck" / "ckpt").iterdir())
        as_saved_by_two_ranks(folder, {0: ["0", "2"], 1: ["1", "3"]})
        model = torch.nn.Linear(2, 2)
        before = model.weight.detach().clone()
        c2 = d.client(0, 1)
        with pytest.raises(ResizeRefused, match=r"saved by 2 data-parallel ranks and this run has 1; "
                                                r"the run spec's resume = 'exact'.*set resume = \"exact-elastic\"") as err:
            CheckpointManager(tmp_path / "ck", {"model": model, "data": c2}).restore()
        assert (err.value.resume, err.value.saved_world_size, err.value.world_size) == ("exact", 2, 1)
        assert torch.equal(model.weight, before)  # nothing was applied
    run = root / "run.toml"
    run.write_text(run.read_text() + 'resume = "exact-elastic"\n')
    with Daemon(root, cache=tmp_path / "cache") as d:
        c3 = d.client(0, 1)
        assert c3.resume_contract == "exact-elastic"
        start = CheckpointManager(tmp_path / "ck", {"model": torch.nn.Linear(2, 2), "data": c3}).restore()
        assert start == 2
        assert stream_digests([next(c3) for _ in range(4)], 4) == {2: ref[(2, 0)][0]}
