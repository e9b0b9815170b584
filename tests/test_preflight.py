"""`sluice preflight` on a real frozen corpus (jsonl, real tokenizer), real node caches, a real loaderd (canary).

The rate tests measure: the verdict comes from steps this node made, and the
required rates sit at least 100x away from the measured one on either side,
so the load of a shared machine cannot flip them.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from loaderd_support import chunks

FAST = ("--seconds", "5", "--max-steps", "12")  # 12 steps end a phase: the seconds only bound a slow machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file) -> Path:
    """Three jsonl objects of real text (166 kB), frozen; a run spec of 8 sequences of 64 tokens a step."""
    from sluice.manifest.freeze import freeze

    root = tmp_path_factory.mktemp("preflight") / "c"
    (root / "shards").mkdir(parents=True)
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    texts = chunks(240)
    for i in range(3):
        (root / "shards" / f"c-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                              for t in texts[i * 80:(i + 1) * 80]))
    (root / "dataset.toml").write_text(
        'name = "preflight"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 64\nalgorithm = "concat"\n'
        'eos = "<|endoftext|>"\npad = "<|pad|>"\n[[sources]]\nname = "code"\npaths = ["shards/c-*.jsonl"]\n'
        'format = "jsonl"\nweight = "1"\nexhaustion = "repeat"\n')
    (root / "run.toml").write_text('run_id = "pf"\nseed = 7\nlanes = 4\nglobal_batch = 8\nmicro_batch = 2\n')
    freeze(root / "dataset.toml", root / "manifest.json", progress=False)
    return root


@pytest.fixture
def copy(corpus, tmp_path) -> Path:
    """A copy of the corpus this test may damage."""
    return Path(shutil.copytree(corpus, tmp_path / "c", ignore=shutil.ignore_patterns("cache", "*.log")))


def _preflight(run, root: Path, *extra: str, n: int = 512, s: float = 1.0):
    proc = run("preflight", root / "manifest.json", root / "run.toml", "--tokens-per-step", str(n),
               "--step-seconds", str(s), "--json", *extra)
    assert proc.stdout, proc.stderr
    return proc, json.loads(proc.stdout)


def _check(obj: dict, name: str) -> dict:
    return next(c for c in obj["checks"] if c["name"] == name)


def test_keeps_up_far_below_and_not_far_above_what_it_measured(corpus, sluice_main):
    proc, low = _preflight(sluice_main, corpus, *FAST, n=1, s=1000)  # 0.001 tokens/s
    assert proc.returncode == 0, proc.stdout
    measured = low["verdict"]["tokens_per_s"]
    assert low["rates"]["on_the_fly"]["steps"] >= 2 and low["rates"]["from_tokens"]["steps"] >= 2
    assert measured >= 100 * low["required_tokens_per_s"]
    assert low["verdict"]["keeps_up"] and low["verdict"]["path"] == "on the fly" and low["ok"]
    assert {c["name"]: c["status"] for c in low["checks"]} == {"objects": "ok", "cache": "skip", "tokenizer": "ok",
                                                                "metrics": "ok"}

    required = 10**13  # tokens/s: measured again below, and at least 100x what the first run measured
    assert measured * 100 <= required
    proc = sluice_main("preflight", corpus / "manifest.json", corpus / "run.toml", "--tokens-per-step", str(required),
                       "--step-seconds", "1", *FAST)
    assert proc.returncode == 4, proc.stdout  # distinct from a failed check (1) and bad input (2)
    out = proc.stdout
    assert "DOES NOT KEEP UP: on the fly this node makes" in out and "the run needs (short by" in out
    assert "on the fly" in out and "from tokens" in out and "required (N / S)" in out
    assert "note: the run spec serves 512 tokens a step" in out  # N differs from global_batch x seq_len
    assert "give the tokenizer more threads" in out and "data nodes" in out


def test_missing_object_and_wrong_size_named(copy, sluice_main):
    (copy / "shards" / "c-0.jsonl").unlink()
    with open(copy / "shards" / "c-2.jsonl", "ab") as f:
        f.write(b"\n")
    proc, obj = _preflight(sluice_main, copy, *FAST)
    assert proc.returncode == 1
    problems = _check(obj, "objects")["problems"]
    assert any("missing object" in p and "shards/c-0.jsonl" in p for p in problems), problems
    assert any("size changed" in p and "shards/c-2.jsonl" in p for p in problems), problems
    assert obj["verdict"] is None and "objects check failed" in obj["not_measured"]


def test_other_tokenizer_named(copy, sluice_main):
    data = json.loads((copy / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<|end|>"
    (copy / "tokenizer.json").write_text(json.dumps(data))
    proc, obj = _preflight(sluice_main, copy, *FAST)
    assert proc.returncode == 1
    tok = _check(obj, "tokenizer")
    assert tok["status"] == "fail"
    assert "tokenizer.json: digest" in tok["problems"][0] and "differs from the manifest's" in tok["problems"][0]


@pytest.mark.slow
def test_damaged_cache_object_named(copy, sluice_main):
    proc = sluice_main("cache", "warm", copy / "manifest.json", copy / "cache", "--budget", "1G", "--tokens",
                       "--no-progress")
    assert proc.returncode == 0, proc.stderr
    victim = next(p for p in sorted((copy / "cache" / "objects").rglob("*")) if p.is_file())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    proc, obj = _preflight(sluice_main, copy, "--cache", str(copy / "cache"), *FAST)
    assert proc.returncode == 1
    cache = _check(obj, "cache")
    assert cache["status"] == "fail" and cache["damaged"] == 1
    assert f"damaged cache object b3:{victim.name}" in cache["problems"][0]
    # once quarantined, the same cache passes; its tokens are there, so the run's path is "from tokens"
    proc, again = _preflight(sluice_main, copy, "--cache", str(copy / "cache"), *FAST)
    assert proc.returncode == 0, proc.stdout
    assert _check(again, "cache")["status"] == "ok" and again["verdict"]["path"] == "from tokens"


def test_metrics_port_in_use_named(corpus):
    from sluice.preflight.checks import check_metrics

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        check = check_metrics(port)
    assert check.failed and f"127.0.0.1:{port}" in check.problems[0] and "--metrics-port" in check.problems[0]
    assert check_metrics(0).status == "ok"


@pytest.mark.parametrize("args, named", [
    (("--tokens-per-step", "0", "--step-seconds", "1"), "--tokens-per-step '0'"),
    (("--tokens-per-step", "8", "--step-seconds", "nan"), "--step-seconds 'nan'"),
    (("--tokens-per-step", "8"), "--step-seconds"),
])
def test_bad_input_exit_2(corpus, sluice_main, args, named):
    proc = sluice_main("preflight", corpus / "manifest.json", corpus / "run.toml", *args)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_missing_files_exit_2(corpus, sluice_main, tmp_path):
    proc = sluice_main("preflight", tmp_path / "nope.json", corpus / "run.toml", "--tokens-per-step", "8",
                       "--step-seconds", "1")
    assert proc.returncode == 2 and "nope.json" in proc.stderr
    proc = sluice_main("preflight", corpus / "manifest.json", corpus / "run.toml", "--tokens-per-step", "8",
                       "--step-seconds", "1", "--cache", str(tmp_path))
    assert proc.returncode == 2 and "not a node cache" in proc.stderr


@pytest.mark.slow
def test_canary_passes_on_a_good_setup(corpus, sluice_cli):
    proc = sluice_cli("preflight", corpus / "manifest.json", corpus / "run.toml", "--tokens-per-step", "1",
                      "--step-seconds", "1000", "--canary", "--json", *FAST, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    canary = _check(json.loads(proc.stdout), "canary")
    assert canary["status"] == "ok" and canary["steps"] == 6 and canary["killed_exit"] == -9, canary
    assert not _daemons_of(corpus / "manifest.json")  # both loaderds are gone with the command


def _daemons_of(manifest: Path) -> list[int]:
    """pids of live loaderd processes started on `manifest`."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(manifest).encode() in argv and any(b"loaderd" in a for a in argv) and state != "Z":
            found.append(int(pid))
    return found


def test_object_check_reads_no_byte(copy):
    """Same size, other bytes: the object check (stat only) passes where `manifest verify` (re-hash) fails."""
    from sluice.manifest.model import load_manifest
    from sluice.manifest.verify import verify
    from sluice.preflight.checks import check_objects

    path = copy / "shards" / "c-1.jsonl"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    manifest = load_manifest(copy / "manifest.json")
    assert check_objects(manifest, None, 60).status == "ok"
    assert [p.kind for p in verify(manifest).problems] == ["digest"]


@pytest.mark.slow
def test_object_check_is_bounded_when_the_store_hangs(copy, monkeypatch):
    """An s3 endpoint that accepts connections and never answers: named within the deadline, not after the
    store's own timeouts (about 10 s of HEAD retries here)."""
    import dataclasses
    import time

    from sluice.manifest.model import load_manifest
    from sluice.preflight.checks import check_objects

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        for key, value in {"SLUICE_S3_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
                           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                           "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(key, value)
        manifest = load_manifest(copy / "manifest.json")
        src = manifest.sources[0]
        objs = (dataclasses.replace(src.objects[0], location="s3://bucket/c-0.jsonl"), *src.objects[1:])
        manifest = dataclasses.replace(manifest, sources=(dataclasses.replace(src, objects=objs),))
        t0 = time.monotonic()
        check = check_objects(manifest, ["s3://bucket/", str(copy)], timeout_s=1.0)
        took = time.monotonic() - t0
    assert took < 5.0, took
    assert check.failed and len(check.problems) == 1
    assert "s3://bucket/c-0.jsonl" in check.problems[0] and "no answer within 1 s" in check.problems[0]


def test_a_fast_backend_is_compared_with_tokenizers_here(tmp_path, tokenizer_file):
    """A manifest recording tiktoken: this node's tiktoken must give tokenizers' ids on a sample of documents."""
    from sluice.manifest.model import load_manifest
    from sluice.preflight.checks import check_tokenizer

    from support import stdlib_texts, text_manifest

    manifest = load_manifest(text_manifest(tmp_path, tokenizer_file, stdlib_texts(30), backend="tiktoken"))
    check = check_tokenizer(manifest)
    assert check.status == "ok", check
    assert check.details["backend"] == "tiktoken" and "same ids as tokenizers on 30 sampled documents" in check.summary


@pytest.mark.slow
def test_a_phase_ends_at_its_deadline(tmp_path, tokenizer_file, sluice_main):
    """Objects of megabytes tokenized cold: the first phase runs out of time, ends, and is quoted as such."""
    import time

    from support import text_objects_manifest

    text_objects_manifest(tmp_path, tokenizer_file, objects=2, size=3_000_000)
    (tmp_path / "run.toml").write_text('run_id = "pf"\nseed = 7\nlanes = 4\nglobal_batch = 64\nmicro_batch = 16\n')
    t0 = time.monotonic()
    proc, obj = _preflight(sluice_main, tmp_path, "--seconds", "0.3", n=1, s=1000)
    took = time.monotonic() - t0
    fly = obj["rates"]["on_the_fly"]
    assert fly["stopped"] == "time" and fly["steps"] < 2000, fly
    assert proc.returncode in (0, 4) and took < 60, (proc.returncode, took)
    assert (obj["verdict"]["keeps_up"]) == (fly["tokens_per_s"] >= obj["required_tokens_per_s"])
