"""The torch.utils.data forms: a DataLoader over the client resumes exactly from its state_dict."""

from __future__ import annotations

import json

import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from sluice.errors import StateError

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'sluice[torch]')")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("integ-torch"), "jsonl.zst", tokenizer_file, docs=120)


@pytest.fixture(scope="module")
def daemon(corpus, tmp_path_factory):
    with Daemon(corpus, cache=tmp_path_factory.mktemp("integ-torch-cache")) as d:
        yield d


def _plain(mb):
    return {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}


def test_dataloader_stream_checkpoint_and_exact_resume(corpus, daemon):
    from torch.utils.data import DataLoader

    from sluice.integrations.torch_data import SluiceIterable, stack_rows

    ref = reference(corpus, 6, 1)
    client = daemon.client(0, 1, as_numpy=False, end_step=6)
    client.reset()  # a fresh start: step 0
    data = SluiceIterable(client)
    loader = DataLoader(data, batch_size=None, num_workers=0)
    it = iter(loader)
    first = [_plain(next(it)) for _ in range(4 * 2 + 1)]  # steps 0, 1 and micro 0 of step 2
    assert not data.at_step_boundary
    with pytest.raises(StateError, match="inside step 2"):
        data.state_dict()
    first += [_plain(next(it)) for _ in range(3)]  # the rest of step 2
    saved = json.loads(json.dumps(data.state_dict()))  # JSON, as a checkpoint stores it
    assert saved["sluice_data"]["step"] == 2
    client.close()

    # a new process's client: restore the saved state and go on to the end
    client2 = daemon.client(0, 1, as_numpy=False, end_step=6)
    data2 = SluiceIterable(client2, keys=("input_ids", "labels", "position_ids", "cu_seqlens", "step"))
    data2.load_state_dict(saved)
    rest = [_plain(mb) for mb in DataLoader(data2, batch_size=None, num_workers=0)]
    assert [mb["step"] for mb in rest] == [s for s in range(3, 6) for _ in range(4)]
    got = stream_digests(first + rest, 4)
    assert got == {s: ref[(s, 0)][0] for s in range(6)}  # exactly the plan's stream, no gap, no repeat
    with pytest.raises(StateError, match="expected a dict with key 'sluice_data'"):
        data2.load_state_dict(saved["sluice_data"])

    # rows: the same stream one row per item; stack_rows rebuilds the micro-batch
    client2.reset(saved["sluice_data"])
    rows = SluiceIterable(client2, keys=("input_ids", "labels", "position_ids"), rows=True)
    batched = DataLoader(rows, batch_size=2, num_workers=0, collate_fn=stack_rows)
    mb = next(iter(batched))
    assert mb["input_ids"].dtype == torch.int64 and mb["input_ids"].shape == (2, 64)
    assert (mb["input_ids"].numpy() == rest[0]["input_ids"]).all()
    client2.close()



def test_stateful_dataloader_carries_the_data_state(corpus, daemon):
    tdl = pytest.importorskip("torchdata.stateful_dataloader",
                              reason="torchdata is not installed (pip install 'sluice[torchdata]')")
    from sluice.integrations.torch_data import SluiceIterable

    ref = reference(corpus, 5, 1)
    client = daemon.client(0, 1, as_numpy=False, end_step=5)
    client.reset()
    loader = tdl.StatefulDataLoader(SluiceIterable(client), batch_size=None, num_workers=0)
    it = iter(loader)
    first = [_plain(next(it)) for _ in range(4 * 2)]  # steps 0 and 1
    saved = loader.state_dict()  # torchdata's own dict, holding ours under its dataset key
    client.close()

    client2 = daemon.client(0, 1, as_numpy=False, end_step=5)
    loader2 = tdl.StatefulDataLoader(SluiceIterable(client2), batch_size=None, num_workers=0)
    loader2.load_state_dict(saved)  # RESTOREs the daemon (no fast-forward: the dataset is Stateful)
    rest = [_plain(mb) for mb in loader2]
    assert [mb["step"] for mb in rest] == [s for s in range(2, 5) for _ in range(4)]
    assert stream_digests(first + rest, 4) == {s: ref[(s, 0)][0] for s in range(5)}
    client2.close()


@pytest.mark.slow  # a worker process, and DataLoader's 5 s worker shutdown after its error
def test_a_dataloader_worker_is_refused(daemon):
    from torch.utils.data import DataLoader

    from sluice.integrations.torch_data import SluiceIterable

    # a worker would hold a second copy of the client's position and split the stream
    with daemon.client(0, 1, as_numpy=False) as client:
        with pytest.raises(Exception, match="num_workers=0"):
            next(iter(DataLoader(SluiceIterable(client), batch_size=None, num_workers=1)))
