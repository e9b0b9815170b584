"""Hostile inputs to the manifest layer: bounded memory, stated limits, exact or refused.

Issue 10 items 5 (compression bombs, line length), 8 (upper bounds, ids against
the vocabulary), 17 (verify counts), 18 (no traceback on any input), 19 (weights
exact) and 20 (truncated tars, unknown keys, loose digests, lineage, max_steps).
Each test fails on the code before its fix.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import resource
import signal
import tarfile
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from sluice.errors import ManifestError, SourceReadError, SpecError
from sluice.manifest import formats
from sluice.manifest.fields import normalize_weight
from sluice.manifest.model import Manifest, load_manifest
from sluice.runspec import RunSpec, load_runspec

GOLDEN = Path(__file__).resolve().parent / "golden" / "manifest_small.json"
RUN = dict(run_id="r", seed=1, lanes=4, global_batch=8, micro_batch=2)


def golden() -> dict:
    return json.loads(GOLDEN.read_bytes())


def bomb(compression: str, zeros: int, line: bytes = b"") -> bytes:
    """`zeros` decoded bytes (8 MiB members/frames of zeros, after `line`) in a few KB."""
    block = bytes(8 << 20)
    first = line + block[len(line):]
    enc = (lambda b: gzip.compress(b, 6)) if compression == "gzip" else zstandard.ZstdCompressor(level=3).compress
    return enc(first) + enc(block) * (zeros // len(block) - 1)


# -- item 5: compression bombs ------------------------------------------------------
@pytest.mark.parametrize("compression, suffix", [("zstd", ".zst"), ("gzip", ".gz")])
def test_bomb_fails_at_the_line_limit_with_bounded_memory(tmp_path, compression, suffix):
    """1 GiB of zeros in a few hundred KB: the scan stops at the line limit, never holding the gigabyte."""
    path = tmp_path / f"bomb.jsonl{suffix}"
    path.write_bytes(bomb(compression, 1 << 30))
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(SourceReadError, match=rf"bomb\.jsonl\{suffix}: line 1: longer than the limit of 1048576 bytes"):
            formats.scan_object(str(path), "jsonl", compression, "text", max_line=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak >> 20} MiB while decoding"


def test_bomb_of_valid_lines_is_decoded_in_bounded_pieces(tmp_path):
    """A bomb that is valid data (one record, then blank lines) decodes in bounded memory."""
    line = json.dumps({"text": "x"}).encode() + b"\n"
    block = line + b"\n" * ((8 << 20) - len(line))
    cctx = zstandard.ZstdCompressor(level=3)
    path = tmp_path / "blank.jsonl.zst"
    path.write_bytes(cctx.compress(block) + cctx.compress(b"\n" * (8 << 20)) * 15)  # 128 MiB decoded
    tracemalloc.start()
    try:
        res = formats.scan_object(str(path), "jsonl", "zstd", "text", check="count")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.records == 1
    assert peak < 64 << 20, f"peak {peak >> 20} MiB while decoding"


def test_webdataset_text_member_over_the_document_limit(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("s0.txt")
        info.size = 2 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    (tmp_path / "big.tar").write_bytes(buf.getvalue())
    with pytest.raises(SourceReadError, match=r"member 's0\.txt' is 2097152 bytes, longer than the document limit of 1048576"):
        formats.scan_object(str(tmp_path / "big.tar"), "webdataset", "none", "txt", max_line=1 << 20)


def test_gzip_stream_cut_after_the_tar_end_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("s0.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    data = gzip.compress(buf.getvalue())
    (tmp_path / "cut.tar.gz").write_bytes(data[:-6])  # the tar is whole; the gzip trailer is not
    with pytest.raises(SourceReadError, match=r"cut\.tar\.gz: truncated gzip stream"):
        formats.scan_object(str(tmp_path / "cut.tar.gz"), "webdataset", "gzip", "txt")


# -- item 19: weights exact or refused -------------------------------------------------
def test_weights_are_exact_beyond_28_digits():
    w = "0." + "1234567890" * 3 + "1"  # 31 significant digits; Decimal's context kept 28
    assert normalize_weight(w, "w") == w
    assert normalize_weight("00.7000", "w") == "0.7" and normalize_weight("100", "w") == "100"
    assert normalize_weight("5.", "w") == "5" and normalize_weight(".5", "w") == "0.5"
    with pytest.raises(ManifestError, match=r"w: weight 0\.1+\.\.\. has 66 characters, more than 64"):
        normalize_weight("0." + "1" * 64, "w")
    with pytest.raises(ManifestError, match="not a plain non-negative decimal"):
        normalize_weight(".", "w")


# -- item 20: what a manifest may hold -------------------------------------------------
def _load(obj: dict) -> Manifest:
    return Manifest.from_bytes(json.dumps(obj).encode(), where="manifest m.json")


def test_golden_still_loads():
    assert _load(golden()).dataset_id == load_manifest(GOLDEN).dataset_id


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["sources"][0]["objects"][0].update(colour="red"),
         r"sources\[0\]\(code\)\.objects\[0\]: unknown field\(s\) \['colour'\]"),
        (lambda m: m["sources"][0].update(extra=1), r"sources\[0\]\(code\): unknown field\(s\) \['extra'\]"),
        (lambda m: m["packing"].update(eos=1), r"packing: unknown field\(s\) \['eos'\]"),
        (lambda m: m["mixture"].update(seed=1), r"mixture: unknown field\(s\) \['seed'\]"),
        (lambda m: m["tokenizer"].update(engine="x"), r"tokenizer: unknown field\(s\) \['engine'\]"),
        (lambda m: m["tokenizer"].update(backend="x"), r"tokenizer\.backend: 'x' is not one of tiktoken"),
        (lambda m: m["sources"][0]["objects"][0].update(digest="b3: " + "0" * 63 + " "),
         r"objects\[0\]\.digest: 'b3: 0+ ' is not a digest"),
        (lambda m: m["sources"][0]["objects"][0].update(digest="b3:0x" + "0" * 62), r"is not a digest"),
        (lambda m: m["sources"][0]["objects"][0].update(digest="b3:" + "AB" * 32), r"is not a digest"),
        (lambda m: m["sources"][0]["objects"][0].update(digest="b3:" + "0_" * 32), r"is not a digest"),
        (lambda m: m["sources"][0]["objects"][0].update(lineage={"raw": "not-a-digest"}),
         r"objects\[0\]\.lineage\.raw: 'not-a-digest' is not a digest"),
        (lambda m: m["sources"][0]["objects"][0].update(lineage={"raw": "b3:" + "0" * 64, "mood": "x"}),
         r"lineage: unknown field\(s\) \['mood'\]"),
        (lambda m: m["sources"][0].update(paths=[1, 2]), r"sources\[0\]\(code\)\.paths\[0\]: expected a string, got 1"),
        (lambda m: m["sources"][0].update(filters="lang=en"), r"filters: expected list"),
        (lambda m: m["packing"].update(eos_id=1024), r"packing\.eos_id: 1024 is outside the tokenizer's vocabulary \(1024 ids: 0\.\.1023\)"),
        (lambda m: m["packing"].update(eos_id=2**40), r"packing\.eos_id: must be a token id in \[0, 2147483647\]"),
        (lambda m: m["packing"].update(seq_len=10**9), r"packing\.seq_len: must be an integer in \[2, 1048576\], got 1000000000"),
        (lambda m: m["packing"].update(seq_len=True), r"packing\.seq_len: expected integer, got boolean"),
        (lambda m: m["sources"][0]["objects"][0].update(size=2**60), r"objects\[0\]\.size: must be in \[0, 9007199254740992\]"),
        (lambda m: m["sources"][0].update(weight="0." + "3" * 70), r"weight 0\.3+\.\.\. has 72 characters"),
    ],
)
def test_manifest_fields_are_checked_at_load(mutate, message):
    m = golden()
    mutate(m)
    with pytest.raises(ManifestError, match=message) as info:
        _load(m)
    assert str(info.value).startswith("manifest m.json")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, r"manifest m\.json: JSON nested too deeply"),
        (b'{"schema": ' + b"9" * 5000 + b"}", r"manifest m\.json: not valid JSON: Exceeds the limit \(4300 digits\)"),
        (b'{"a": 1, "a": 2}', r"manifest m\.json: duplicate key 'a'"),
        (b"\xff\xfe", r"manifest m\.json: not UTF-8"),
    ],
)
def test_unparseable_manifests(data, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_bytes(data, where="manifest m.json")


def test_manifest_that_is_a_folder_or_a_device(tmp_path):
    with pytest.raises(ManifestError, match=r"manifest .*: is a folder, expected a file"):
        load_manifest(tmp_path)
    with pytest.raises(ManifestError, match=r"manifest /dev/zero: not a regular file"):
        load_manifest("/dev/zero")


# -- item 8 and 20: run spec bounds --------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        ({"lanes": 10**9, "global_batch": 10**9}, r"lanes must be an integer in \[1, 65536\], got 1000000000"),
        ({"global_batch": 2**21, "lanes": 1}, r"global_batch must be an integer in \[1, 1048576\]"),
        ({"micro_batch": 16}, r"micro_batch=16 is larger than global_batch=8"),
        ({"max_steps": True}, r"max_steps must be an integer in \[0, 2\*\*53\] \(0 = unbounded\), got True"),
        ({"max_steps": 2**60}, r"max_steps must be an integer"),
        ({"block_window": 2**40}, r"block_window must be an integer in \[1, 1048576\]"),
        ({"run_id": "x" * 200}, r"run_id 'x{40}'\.\.\. must be 1 to 128 ASCII"),
        ({"run_id": 5}, r"run_id must be a string, got 5"),
    ],
)
def test_run_spec_upper_bounds(change, message):
    with pytest.raises(SpecError, match=message):
        RunSpec.from_obj({**RUN, **change})


def test_tokens_per_step_bound():
    spec = RunSpec(**{**RUN, "global_batch": 1 << 16, "lanes": 1, "micro_batch": 1})
    spec.check_seq_len(4096)
    with pytest.raises(SpecError, match=r"global_batch=65536 x the manifest's seq_len=8192 = 536870912 tokens per step"):
        spec.check_seq_len(8192)


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda p: p.write_bytes(b'run_id = "\xff"\n'), r"run spec .*run\.toml: not UTF-8"),
        (lambda p: p.mkdir(), r"run spec .*run\.toml: is a folder, expected a file"),
        (lambda p: p.write_text("seed = " + "9" * 5000), r"run spec .*run\.toml: invalid TOML: Exceeds the limit"),
        (lambda p: p.write_text("x = " + "[" * 5000 + "]" * 5000), r"run spec .*run\.toml: invalid TOML"),
        (lambda p: p.write_text("lanes = 1\n[lanes]\n"), r"run spec .*run\.toml: invalid TOML"),
    ],
)
def test_run_spec_files_that_are_not_run_specs(tmp_path, write, message):
    path = tmp_path / "run.toml"
    write(path)
    with pytest.raises(SpecError, match=message):
        load_runspec(path)


# -- item 17: verify counts what it says ---------------------------------------------
def test_verify_counts_objects_not_the_tokenizer(tmp_path, tokenizer_file, sluice_main):
    import shutil

    shutil.copy(tokenizer_file, tmp_path / "tok.json")
    for i in range(3):
        (tmp_path / f"d{i}.jsonl").write_text(json.dumps({"text": f"doc {i}"}) + "\n")
    (tmp_path / "spec.toml").write_text(
        'name = "v"\ntokenizer = "tok.json"\n[packing]\nseq_len = 8\neos = "<|endoftext|>"\n'
        '[[sources]]\nname = "a"\npaths = ["d*.jsonl"]\nformat = "jsonl"\n'
    )
    r = sluice_main("manifest", "freeze", tmp_path / "spec.toml", "-o", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    r = sluice_main("manifest", "verify", tmp_path / "m.json")
    assert r.returncode == 0 and "checked 3 of 3 objects and the tokenizer: OK" in r.stdout, r.stdout
    r = sluice_main("manifest", "verify", tmp_path / "m.json", "--json")
    report = json.loads(r.stdout)
    assert (report["checked"], report["total"], report["tokenizer_checked"]) == (3, 3, True)


def test_verify_of_an_unreachable_store_reports_it(tmp_path, sluice_main, monkeypatch):
    m = golden()
    m["tokenizer"] = None
    m["packing"]["eos_id"] = 0
    (tmp_path / "m.json").write_bytes(Manifest.from_obj(m).canonical_bytes())
    # A closed port on loopback: nothing listens, the connection is refused at once.
    monkeypatch.setenv("SLUICE_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = sluice_main("manifest", "verify", tmp_path / "m.json", "--json", timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)
    report = json.loads(r.stdout)
    web = [p for p in report["problems"] if p["source"] == "web"]
    assert web and web[0]["kind"] == "unreadable" and "cannot reach the store" in web[0]["actual"], web


# -- item 18: freeze onto a full disk ------------------------------------------------
def test_freeze_onto_a_full_disk_names_the_output(tmp_path, sluice_main):
    """A write that fails (here: the file-size limit, EFBIG, as ENOSPC would) is a clear error, and nothing is left."""
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(50)))
    (tmp_path / "spec.toml").write_text(
        'name = "full"\n[packing]\nseq_len = 8\n[[sources]]\nname = "a"\npaths = ["d.jsonl"]\nformat = "jsonl"\n'
        'notes = "' + "n" * 4000 + '"\n'
    )
    out = tmp_path / "out"
    out.mkdir()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        r = sluice_main("manifest", "freeze", tmp_path / "spec.toml", "-o", out / "m.json")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("sluice: error: output ") and "cannot write the manifest (File too large)" in r.stderr
    assert list(out.iterdir()) == []



# -- hostile pre-tokenized shards ------------------------------------------------------
@pytest.mark.parametrize(
    "header, message",
    [
        (b"[1]", r"token shard header is a JSON list, expected an object"),
        (b"[" * 50_000 + b"]" * 50_000, r"token shard header is JSON nested too deeply"),
        (b'{"n": ' + b"9" * 5000 + b"}", r"token shard header is not usable JSON"),
        (b'{"format": "sluice-tokens/1", "dtype": []}', r"token shard dtype \[\] not in"),
        (b'{"format": "sluice-tokens/1", "dtype": "uint16", "n_docs": true, "n_tokens": 0}',
         r"token shard header field 'n_docs' invalid: True"),
    ],
)
def test_hostile_token_shard_headers(tmp_path, header, message):
    import struct

    from sluice.manifest import token_shard

    (tmp_path / "x.sltok").write_bytes(token_shard.MAGIC + struct.pack("<I", len(header)) + header)
    with pytest.raises(SourceReadError, match=message):
        formats.scan_object(str(tmp_path / "x.sltok"), "tokens", "none", "")


def test_pointer_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, sluice_main):
    import os

    os.mkfifo(tmp_path / "latest")
    (tmp_path / "spec.toml").write_text('name = "p"\n[packing]\nseq_len = 8\n'
                                        '[[sources]]\nname = "a"\npaths = ["latest"]\nformat = "jsonl"\n')
    r = sluice_main("manifest", "freeze", tmp_path / "spec.toml", "-o", tmp_path / "m.json", timeout=20)
    assert r.returncode == 2 and re.search(r"pointer file .*latest: not a regular file", r.stderr), r.stderr


@pytest.mark.parametrize("compression, suffix", [("zstd", ".zst"), ("none", "")])
def test_count_mode_enforces_the_line_limit_too(tmp_path, compression, suffix):
    """`--check count` parses no line, but a line over the limit still fails (it froze as 1 record before)."""
    path = tmp_path / f"long.jsonl{suffix}"
    data = b'{"text": "a"}\n' + bytes(3 << 20) + b"\n"
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if compression == "zstd" else data)
    with pytest.raises(SourceReadError, match=r"long\.jsonl.*: line 2: longer than the limit of 1048576 bytes"):
        formats.scan_object(str(path), "jsonl", compression, "text", check="count", max_line=1 << 20)
    assert formats.scan_object(str(path), "jsonl", compression, "text", check="count").records == 2


def test_show_and_diff_escape_terminal_control_characters(tmp_path, sluice_main):
    """A manifest's strings cannot drive the terminal (escape sequences) or reorder the text (bidi overrides)."""
    m = golden()
    m["name"] = "evil\x1b[2J\x1b]0;owned\x07"
    m["notes"]["x"] = "\u202eesrever"
    m["sources"][0]["objects"][0]["location"] = "a\rb.jsonl.zst"
    (tmp_path / "m.json").write_text(json.dumps(m))
    for argv in (["manifest", "show", tmp_path / "m.json"], ["manifest", "diff", GOLDEN, tmp_path / "m.json"]):
        r = sluice_main(*argv)
        assert r.returncode in (0, 1), r.stderr
        assert not re.search("[\x1b\x07\r\u202e]", r.stdout), repr(r.stdout)
        assert "\\x1b[2J" in r.stdout
