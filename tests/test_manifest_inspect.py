"""`sluice manifest verify / show / diff` through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.errors import ManifestError
from sluice.manifest.freeze import freeze
from sluice.manifest.model import load_manifest
from sluice.manifest.verify import verify

SPEC = """
name = "inspect"
[notes]
why = "tests"
[packing]
seq_len = 32
eos_id = 0
[[sources]]
name = "a"
paths = ["a"]
format = "jsonl"
weight = "{wa}"
[[sources]]
name = "b"
paths = ["b/*.jsonl"]
format = "jsonl"
weight = "1"
exhaustion = "repeat"
"""


def shard(path: Path, n: int, tag: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{tag} {i} " * 20}) + "\n" for i in range(n)))


@pytest.fixture
def frozen(tmp_path) -> Path:
    for i in range(4):
        shard(tmp_path / "a" / f"a{i}.jsonl", 3 + i, f"a{i}")
    for i in range(2):
        shard(tmp_path / "b" / f"b{i}.jsonl", 2, f"b{i}")
    (tmp_path / "spec.toml").write_text(SPEC.format(wa="3"))
    freeze(tmp_path / "spec.toml", tmp_path / "m.json", progress=False)
    return tmp_path / "m.json"


def test_verify_clean_manifest_passes(frozen, sluice_main):
    r = sluice_main("manifest", "verify", frozen)
    assert r.returncode == 0, r.stderr
    assert "checked 6 of 6 objects: OK" in r.stdout
    r = sluice_main("manifest", "verify", frozen, "--json")
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["checked"] == 6 and report["problems"] == []


def test_verify_names_changed_byte_missing_object_and_size_change(frozen, sluice_main):
    root = frozen.parent
    a0 = root / "a" / "a0.jsonl"
    data = bytearray(a0.read_bytes())
    data[20] = ord("Z") if data[20] != ord("Z") else ord("Y")  # same size, one byte differs
    a0.write_bytes(bytes(data))
    (root / "a" / "a2.jsonl").unlink()
    with open(root / "b" / "b1.jsonl", "a") as f:
        f.write('{"text": "appended"}\n')
    r = sluice_main("manifest", "verify", frozen)
    assert r.returncode == 1
    out = r.stdout
    assert "digest mismatch: source 'a' object a/a0.jsonl" in out
    assert "missing object: source 'a' object a/a2.jsonl" in out
    assert "size changed: source 'b' object b/b1.jsonl" in out
    assert "a/a1.jsonl" not in out and "3 problem(s)" in out
    r = sluice_main("manifest", "verify", frozen, "--json")
    kinds = sorted((p["kind"], p["location"]) for p in json.loads(r.stdout)["problems"])
    assert kinds == [("digest", "a/a0.jsonl"), ("missing", "a/a2.jsonl"), ("size", "b/b1.jsonl")]


def test_verify_sample_is_a_deterministic_subset(frozen):
    m = load_manifest(frozen)
    (frozen.parent / "a" / "a3.jsonl").unlink()
    reports = [verify(m, sample=0.5, seed=s) for s in range(12)]
    assert all(r.checked == 3 for r in reports)  # ceil(0.5 * 6)
    assert [r.ok for r in reports] == [verify(m, sample=0.5, seed=s).ok for s in range(12)]
    assert {r.ok for r in reports} == {True, False}  # some samples miss the broken object, some hit it
    with pytest.raises(ManifestError, match="--sample"):
        verify(m, sample=0.0)


def test_verify_checks_the_tokenizer_too(tmp_path, tokenizer_file):
    import shutil

    shutil.copy(tokenizer_file, tmp_path / "tokenizer.json")
    shard(tmp_path / "a" / "x.jsonl", 2, "x")
    (tmp_path / "spec.toml").write_text('name = "t"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 8\n'
                                        'eos = "<|endoftext|>"\n[[sources]]\nname = "a"\npaths = "a"\nformat = "jsonl"\n')
    m = freeze(tmp_path / "spec.toml", tmp_path / "m.json", progress=False)
    assert verify(m).ok
    with open(tmp_path / "tokenizer.json", "a") as f:
        f.write(" ")
    problems = verify(load_manifest(tmp_path / "m.json")).problems
    assert [(p.kind, p.source, p.location) for p in problems] == [("digest", "<tokenizer>", "tokenizer.json")]


def test_show_human_and_json(frozen, sluice_main):
    m = load_manifest(frozen)
    r = sluice_main("manifest", "show", frozen)
    assert r.returncode == 0
    assert m.dataset_id in r.stdout and "22 records, 6 objects" in r.stdout
    assert "0.7500" in r.stdout and "0.2500" in r.stdout  # shares of weights 3 and 1
    info = json.loads(sluice_main("manifest", "show", frozen, "--json").stdout)
    assert info["dataset_id"] == m.dataset_id
    assert [(s["name"], s["records"], s["objects"], s["weight"], s["share"]) for s in info["sources"]] == [
        ("a", 18, 4, "3", "0.7500"), ("b", 4, 2, "1", "0.2500")]
    assert info["packing"]["eos_id"] == 0 and info["notes"] == {"why": "tests"}


def test_show_refuses_a_tampered_manifest(frozen, sluice_main):
    obj = json.loads(frozen.read_text())
    obj["sources"][0]["objects"][1]["start"] = 99
    frozen.write_text(json.dumps(obj))
    r = sluice_main("manifest", "show", frozen)
    assert r.returncode == 2 and "objects[1].start: expected 3, got 99" in r.stderr


def test_diff_identical_and_changed(frozen, sluice_main):
    root = frozen.parent
    r = sluice_main("manifest", "diff", frozen, frozen)
    assert r.returncode == 0 and r.stdout.startswith("identical: b3:")
    shard(root / "b" / "b2.jsonl", 1, "new")
    shard(root / "a" / "a1.jsonl", 5, "rewritten")
    (root / "a" / "a3.jsonl").unlink()
    (root / "spec.toml").write_text(SPEC.format(wa="2").replace("seq_len = 32", "seq_len = 64"))
    freeze(root / "spec.toml", root / "m2.json", progress=False)
    r = sluice_main("manifest", "diff", frozen, root / "m2.json")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert "~ packing.seq_len: 32 -> 64" in lines
    assert "~ source a.weight: '3' -> '2'" in lines
    assert any(ln.startswith("+ source b object b/b2.jsonl b3:") for ln in lines)
    assert any(ln.startswith("- source a object a/a3.jsonl b3:") for ln in lines)
    assert any(ln.startswith("~ source a object a/a1.jsonl: b3:") for ln in lines)
    assert not any("a/a0.jsonl" in ln for ln in lines)
    d = json.loads(sluice_main("manifest", "diff", frozen, root / "m2.json", "--json").stdout)
    assert d["identical"] is False
    assert d["fields"]["packing"] == {"seq_len": {"a": 32, "b": 64}}
    assert [x["location"] for x in d["sources_changed"]["a"]["removed"]] == ["a/a3.jsonl"]
    assert [x["location"] for x in d["sources_changed"]["a"]["changed"]] == ["a/a1.jsonl"]
    assert [x["location"] for x in d["sources_changed"]["b"]["added"]] == ["b/b2.jsonl"]


def test_freeze_json_summary_and_progress_bar_on_a_terminal(tmp_path):
    import os
    import pty
    import subprocess
    import sys

    for i in range(3):
        shard(tmp_path / "a" / f"a{i}.jsonl", 2, f"a{i}")
        shard(tmp_path / "b" / f"b{i}.jsonl", 2, f"b{i}")
    (tmp_path / "spec.toml").write_text(SPEC.format(wa="1"))
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    try:
        r = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(tmp_path / "spec.toml"),
                            "-o", str(tmp_path / "m.json"), "--json", "--progress"],  # --json alone: no bar
                           stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120)
        os.close(slave)
        slave = -1
        bar = b""
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            bar += data
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert r.returncode == 0
    summary = json.loads(r.stdout)
    assert summary["dataset_id"] == load_manifest(tmp_path / "m.json").dataset_id
    assert (summary["objects"], summary["records"], summary["sources"]) == (6, 12, 2)
    # stderr was a terminal: tqdm drew the bar with bytes and objects
    assert b"freeze" in bar and b"6/6 objects" in bar
    # not a terminal: nothing on stderr; --check count gives the same manifest for valid data
    r = subprocess.run([sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(tmp_path / "spec.toml"),
                        "-o", str(tmp_path / "m2.json"), "--check", "count"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.strip() == summary["dataset_id"]
