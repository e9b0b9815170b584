"""`sluice.stream(...)` and `sluice run`: a folder of files to a resumable stream in one call.

The data is what a user has, not what the quickstart made: jsonl whose text
field is `body`, a `.jsonl.gz` in a subfolder, a parquet file, and a README the
walk must skip. The slow test trains a tiny torch model from the stream with
`CheckpointManager`, kills the trainer with SIGKILL, resumes in a new process
and compares every step's batch and the final parameters with an uninterrupted
run. The others check reuse (no data file opened by a second call), the files
left for audit, `import sluice` staying light, the errors, and the CLI.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import stdlib_texts

from sluice.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
FIELD = "body"


def make_folder(root: Path) -> Path:
    """data/ with a.jsonl and sub/b.jsonl.gz (field `body`), c.parquet (column `body`) and a README."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = stdlib_texts(45)
    data = root / "data"
    (data / "sub").mkdir(parents=True)
    with open(data / "a.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({FIELD: t}) + "\n" for t in texts[0::3])
    with gzip.open(data / "sub" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({FIELD: t}) + "\n" for t in texts[1::3])
    pq.write_table(pa.table({FIELD: texts[2::3]}), data / "c.parquet")
    (data / "README.md").write_text("not data: the walk skips it\n")
    return data


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


ARGS = {"seq_len": 64, "micro_batch": 2, "global_batch": 4, "text_field": FIELD}


def test_a_folder_of_three_formats_becomes_an_auditable_manifest(tmp_path, tokenizer_file):
    from sluice.manifest.freeze import freeze
    from sluice.manifest.model import load_manifest
    from sluice.runprep import prepare

    data = make_folder(tmp_path)
    p = prepare(data, tokenizer=tokenizer_file, **ARGS)
    assert p.workdir == data / ".sluice" and not p.reused
    m = load_manifest(p.manifest)
    assert m.dataset_id == p.dataset_id
    assert [(s.name, s.format, s.text_field) for s in m.sources] == [
        ("data.jsonl", "jsonl", FIELD), ("data.parquet", "parquet", FIELD)]
    locations = [o.location for s in m.sources for o in s.objects]
    assert locations == ["../a.jsonl", "../sub/b.jsonl.gz", "../c.parquet"]  # README.md skipped, .gz read
    assert [o.compression for o in m.sources[0].objects] == ["none", "gzip"]
    # the split weights follow the record counts (15 + 15 jsonl documents, 15 parquet)
    assert [s.weight for s in m.sources] == ["0.666666667", "0.333333333"]
    # dataset.toml, frozen by hand as the quickstart does, gives the same dataset ID
    again = freeze(p.dataset_spec, p.workdir / "by-hand.json", progress=False)
    assert again.dataset_id == p.dataset_id
    run = (p.workdir / "run.toml").read_text()
    assert "global_batch = 4" in run and "micro_batch = 2" in run and "lanes = 4" in run


_PROBE = textwrap.dedent("""
    import json, sys
    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args else None)
    from sluice.runprep import prepare
    p = prepare(sys.argv[1], tokenizer=sys.argv[2], seq_len=64, micro_batch=2, global_batch=4, text_field="body")
    data = [o for o in opened if o.startswith(sys.argv[1]) and not o.startswith(str(p.workdir))]
    print(json.dumps({"reused": p.reused, "dataset_id": p.dataset_id, "data_opened": sorted(set(data))}))
""")


def _probe(data: Path, tokenizer: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(data), str(tokenizer)], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_second_call_reuses_the_manifest_without_opening_a_data_file(tmp_path, tokenizer_file):
    data = make_folder(tmp_path)
    first = _probe(data, tokenizer_file)
    assert not first["reused"] and str(data / "a.jsonl") in first["data_opened"]  # the probe sees the hashing
    second = _probe(data, tokenizer_file)
    assert second == {"reused": True, "dataset_id": first["dataset_id"], "data_opened": []}
    os.utime(data / "a.jsonl")  # touched, same bytes: hashed again, same dataset ID
    third = _probe(data, tokenizer_file)
    assert (third["reused"], third["dataset_id"]) == (False, first["dataset_id"])
    with open(data / "a.jsonl", "a", encoding="utf-8") as f:  # other content: another dataset
        f.write(json.dumps({FIELD: "one more document"}) + "\n")
    fourth = _probe(data, tokenizer_file)
    assert not fourth["reused"] and fourth["dataset_id"] != first["dataset_id"]


def test_a_mixture_names_its_sources_and_keeps_the_weights(tmp_path, tokenizer_file):
    from sluice.manifest.model import load_manifest
    from sluice.runprep import prepare

    data = make_folder(tmp_path)
    p = prepare(mixture={"prose": (data / "sub", 0.25), "code": ([data / "a.jsonl", data / "c.parquet"], "0.75")},
                tokenizer=tokenizer_file, workdir=tmp_path / "work", **ARGS)
    m = load_manifest(p.manifest)
    assert [(s.name, s.weight) for s in m.sources] == [
        ("prose", "0.25"), ("code.jsonl", "0.375"), ("code.parquet", "0.375")]
    assert p.workdir == tmp_path / "work" and p.roots == (str(data.resolve()),)
    glob = prepare(str(data / "*.jsonl"), tokenizer=tokenizer_file, **ARGS)  # one format: the glob is the alias
    assert glob.workdir == data / ".sluice" and glob.sources == ("data",)
    assert 'paths = ["../*.jsonl"]' in glob.dataset_spec.read_text()


@pytest.mark.parametrize("kwargs, match", [
    ({"seq_len": 0}, r"seq_len=0: expected a positive integer"),
    ({"micro_batch": 3}, r"global_batch=4: must be a multiple of micro_batch x replicas = 3 x 1"),
    ({"global_batch": "8"}, r"global_batch='8': expected a positive integer"),
    ({"text_field": ""}, r"text_field='': expected the non-empty name"),
    ({"unit": "words"}, r"unit='words': expected one of documents, tokens"),
    ({"tokenizer": "missing.json"}, r"tokenizer='missing.json': no such file"),
    ({"tokenizer": 7}, r"tokenizer=7: expected a tokenizer.json path, or 'train'"),
    ({"eos": "<|nope|>"}, r"packing.eos: token '<\|nope\|>' is not in the tokenizer's vocabulary"),
    ({"paths": "nowhere"}, r"paths='.*nowhere': no such file or folder"),
    ({"paths": "data/*.csv"}, r"paths='.*data/\*.csv': the glob matches no file"),
    ({"paths": "data/README.md"}, r"paths='.*README.md': not a data file"),
    ({"paths": "data/*"}, r"the glob matches .*README.md, which is none of"),
    ({"mixture": {"a": ("data", "0.5")}}, r"paths='.*data': give either paths or mixture"),
    ({"paths": None, "mixture": {"a": ("data", -1)}}, r"mixture\['a'\] weight=-1: expected a non-negative number"),
    ({"paths": None, "mixture": {"a": "data"}}, r"mixture\['a'\]='data': expected a pair"),
    ({"paths": None, "mixture": {"a.b": ("data", 1)}}, r"mixture='a.b': source names must be"),
    ({"paths": None, "mixture": {"a": ("data", 0)}}, r"all weights are zero"),
    ({"order": "random"}, r"order 'random' is not one of global, block, none"),
])
def test_bad_input_names_the_argument_and_its_value(tmp_path, tokenizer_file, monkeypatch, kwargs, match):
    from sluice.runprep import prepare

    make_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = {"paths": "data", "tokenizer": tokenizer_file, **ARGS, **kwargs}
    with pytest.raises(SpecError, match=match):
        prepare(args.pop("paths"), **args)


def test_the_wrong_text_field_names_the_field_the_file_and_the_line(tmp_path, tokenizer_file):
    from sluice.errors import SourceReadError
    from sluice.runprep import prepare

    data = make_folder(tmp_path)
    # the scans run in parallel: whichever object fails first is named
    with pytest.raises(SourceReadError, match=r"object .*/data/\S+: .*'text'"):
        prepare(data, tokenizer=tokenizer_file, **{**ARGS, "text_field": "text"})
    assert not (data / ".sluice" / "manifest.json").exists()  # nothing half-made is left to reuse


def test_import_sluice_stays_light_with_stream_exported():
    code = ("import sys, sluice; f = sluice.stream; "
            "print(sorted(m for m in ('torch', 'pyarrow', 'tokenizers', 'zmq', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


def test_sluice_run_help_and_prepare_only(tmp_path, tokenizer_file, sluice_cli):
    help_ = sluice_cli("run", "--help")
    assert help_.returncode == 0 and "--tokenizer" in help_.stdout and "--prepare-only" in help_.stdout
    data = make_folder(tmp_path)
    args = ("run", str(data), "--tokenizer", str(tokenizer_file), "--seq-len", "64", "--micro-batch", "2",
            "--global-batch", "4", "--text-field", FIELD, "--prepare-only", "--json")
    first = sluice_cli(*args, env=_env())
    assert first.returncode == 0, first.stderr
    obj = json.loads(first.stdout)
    assert obj["sources"] == ["data.jsonl", "data.parquet"] and Path(obj["manifest"]).is_file()
    again = json.loads(sluice_cli(*args, env=_env()).stdout)
    assert (again["reused"], again["dataset_id"]) == (True, obj["dataset_id"])
    bad = sluice_cli("run", str(data), "--tokenizer", str(tokenizer_file), "--seq-len", "64", "--micro-batch", "3",
                     "--global-batch", "4", env=_env())
    assert bad.returncode == 2 and "global_batch=4" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_sluice_run_serves_the_stream_a_client_reads(tmp_path, tokenizer_file):
    import sluice
    from sluice.client.owning import EmbeddedClient
    from sluice.errors import SluiceError

    data = make_folder(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "run", str(data), "--tokenizer", str(tokenizer_file), "--seq-len", "64",
         "--micro-batch", "2", "--global-batch", "4", "--text-field", FIELD, "--max-steps", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        from sluice.client.embedded import first_line

        line = first_line(proc, 60)
        assert line is not None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        info = json.loads(line)
        # a trainer's call with the same files and run attaches to it (no daemon of its own)
        with sluice.stream(data, tokenizer=tokenizer_file, max_steps=3, endpoint=info["endpoint"], **ARGS) as client:
            assert client.prepared.reused and not isinstance(client, EmbeddedClient)
            steps = [(mb["step"], mb["micro"], tuple(mb["input_ids"].shape)) for mb in client]
        assert steps == [(s, m, (2, 64)) for s in range(3) for m in range(2)]  # ends at max_steps
        # another dataset (the same files packed into other lengths) is refused by the daemon, naming both IDs
        other = sluice.stream(data, tokenizer=tokenizer_file, max_steps=3, endpoint=info["endpoint"],
                              workdir=tmp_path / "other", **{**ARGS, "seq_len": 32})
        with pytest.raises(SluiceError, match=r"dataset ID 'b3:\w+' differs from this daemon's"), other:
            next(iter(other))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TRAIN = textwrap.dedent("""
    import hashlib, json, os, signal, sys
    import torch
    import sluice
    from sluice.trainer_hooks import CheckpointManager

    data, tok, ckpt, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    client = sluice.stream(data, tokenizer=tok, seq_len=64, micro_batch=2, global_batch=4, text_field="body",
                           max_steps=8)
    vocab = 1024
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(ckpt, {"model": model, "optim": opt, "data": client}, every=2)
    start = mgr.restore()
    print(json.dumps({"start": start, "reused": client.prepared.reused, "dataset_id": client.prepared.dataset_id}),
          flush=True)
    for step, micros in client.steps(start):
        digest = hashlib.blake2b(b"".join(mb["input_ids"].numpy().tobytes() for mb in micros)).hexdigest()
        for mb in micros:
            logits = model(mb["input_ids"].long())
            loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), mb["labels"].long().view(-1),
                                                     ignore_index=-100)
            (loss / len(micros)).backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(step)
        print(json.dumps({"step": step, "digest": digest, "loss": loss.item().hex()}), flush=True)
        if step == kill_after:
            signal.pause()  # the test kills this process here, with SIGKILL
    params = hashlib.blake2b(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(json.dumps({"params": params}), flush=True)
    mgr.close()
    client.close()
""")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _trainer(script: Path, data: Path, tok: Path, ckpt: Path, kill_after: int) -> list[dict]:
    """Run the trainer; with kill_after >= 0, SIGKILL it once it reports that step (its daemon stopped after)."""
    proc = subprocess.Popen([sys.executable, str(script), str(data), str(tok), str(ckpt), str(kill_after)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    lines: list[dict] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(json.loads(raw))
            if lines[-1].get("step") == kill_after:
                daemons = _children(proc.pid)
                proc.kill()
                proc.wait(10)
                for pid in daemons:  # the embedded daemon, unless it already left with its trainer
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + 10
                while any(Path(f"/proc/{pid}").exists() for pid in daemons) and time.monotonic() < deadline:
                    time.sleep(0.05)
                return lines
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        return lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_folder_to_a_training_loop_that_resumes_exactly_after_kill_9(tmp_path, tokenizer_file):
    data = make_folder(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ref = _trainer(script, data, tokenizer_file, tmp_path / "ckpt-ref", -1)
    assert ref[0]["start"] == 0 and not ref[0]["reused"]
    ref_steps = {r["step"]: r for r in ref if "step" in r}
    assert sorted(ref_steps) == list(range(8))  # max_steps ends the loop

    killed = _trainer(script, data, tokenizer_file, tmp_path / "ckpt", 5)
    assert killed[0] == {"start": 0, "reused": True, "dataset_id": ref[0]["dataset_id"]}
    assert [r["step"] for r in killed[1:]] == [0, 1, 2, 3, 4, 5]
    resumed = _trainer(script, data, tokenizer_file, tmp_path / "ckpt", -1)
    # saved after step 4 (every=2), killed after step 5: step 5 is trained again, on the same batch
    assert resumed[0] == {"start": 5, "reused": True, "dataset_id": ref[0]["dataset_id"]}
    for r in killed[1:] + resumed[1:-1]:
        assert r == ref_steps[r["step"]], f"step {r['step']} differs from the uninterrupted run"
    assert [r["step"] for r in resumed[1:-1]] == [5, 6, 7]
    assert resumed[-1] == ref[-1]  # the same parameters, bit for bit


def test_tokenizer_train_trains_offline_into_the_work_folder_once(tmp_path):
    from sluice.manifest.model import load_manifest
    from sluice.runprep import prepare

    data = make_folder(tmp_path)
    first = prepare(data, tokenizer="train", vocab_size=400, **ARGS)
    assert first.tokenizer == first.workdir / "tokenizer.json"
    ref = load_manifest(first.manifest).tokenizer
    assert ref is not None and ref.vocab_size == 400 and ref.location == "tokenizer.json"
    mtime = first.tokenizer.stat().st_mtime_ns
    second = prepare(data, tokenizer="train", vocab_size=400, **ARGS)
    assert (second.reused, second.dataset_id, second.tokenizer.stat().st_mtime_ns) == (
        True, first.dataset_id, mtime)  # neither trained nor hashed again
