"""Bad input to `sluice manifest freeze`: a clear error, exit code 2, no partial file.

Every case runs the CLI's `main(argv)` in this process (`sluice_main`) and
checks the exit code, that the message names the file/line/field at fault, and
that the output folder holds nothing afterwards (no manifest, no temp file).
Cases about the process itself (signals, file permissions as a non-root user)
run the real CLI in a subprocess.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

HEAD = 'name = "bad"\n[packing]\nseq_len = 16\n'


def source(paths: str | list[str], fmt: str = "jsonl", extra: str = "", name: str = "s") -> str:
    return f'[[sources]]\nname = "{name}"\npaths = {json.dumps(paths)}\nformat = "{fmt}"\n{extra}'


def good(root: Path, name: str = "ok.jsonl", n: int = 3) -> str:
    (root / name).write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(n)))
    return name


def _missing_path(root):
    return HEAD + source("nope/none.jsonl"), r"nope/none\.jsonl.*(no such file|missing)|no such file.*none\.jsonl"


def _glob_nothing(root):
    return HEAD + source("shards/*.jsonl"), r"paths 'shards/\*\.jsonl'.*glob matches nothing"


def _dangling_symlink(root):
    os.symlink(root / "gone.jsonl", root / "link.jsonl")
    return HEAD + source("link.jsonl"), r"dangling symlink .*link\.jsonl -> .*gone\.jsonl"


def _dangling_pointer(root):
    (root / "latest").write_text("v9/\n")
    return HEAD + source("latest"), r"dangling pointer .*latest -> .*v9"


def _truncated_gzip(root):
    data = gzip.compress(b"".join(json.dumps({"text": "x" * 50}).encode() + b"\n" for _ in range(200)))
    (root / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    return HEAD + source("t.jsonl.gz"), r"t\.jsonl\.gz: truncated gzip stream"


def _truncated_zstd(root):
    data = zstandard.ZstdCompressor().compress(b"".join(json.dumps({"text": f"{i}" * 40}).encode() + b"\n" for i in range(300)))
    (root / "t.jsonl.zst").write_bytes(data[: len(data) // 2])
    return HEAD + source("t.jsonl.zst"), r"t\.jsonl\.zst: truncated zstd stream"


def _corrupt_parquet(root):
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), buf)
    data = bytearray(buf.getvalue())
    data[-12:-8] = b"\xff\xff\xff\x7f"  # footer length points outside the file
    (root / "c.parquet").write_bytes(bytes(data))
    return HEAD + source("c.parquet", "parquet"), r"c\.parquet: not a readable parquet file"


def _tar_traversal(root):
    with tarfile.open(root / "evil.tar", "w") as tar:
        for name in ("s0.txt", "../../etc/s1.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    return HEAD + source("evil.tar", "webdataset"), r"evil\.tar: tar member 1 '\.\./\.\./etc/s1\.txt': path traversal"


def _tar_absolute(root):
    with tarfile.open(root / "abs.tar", "w") as tar:
        info = tarfile.TarInfo("/etc/s0.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    return HEAD + source("abs.tar", "webdataset"), r"abs\.tar: tar member 0 '/etc/s0\.txt': absolute path refused"


def _not_json(root):
    (root / "b.jsonl").write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n')
    return HEAD + source("b.jsonl"), r"b\.jsonl: line 4: not JSON"


def _lacks_text(root):
    (root / "b.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    return HEAD + source("b.jsonl"), r"b\.jsonl: line 2: text field 'text' missing"


def _text_not_string(root):
    (root / "b.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": 3}\n')
    return HEAD + source("b.jsonl"), r"b\.jsonl: line 3: text field 'text' not a string"


def _unknown_format(root):
    return HEAD + source(good(root), "csv"), r"sources\[0\]\(s\)\.format: unknown format 'csv'"


def _negative_weight(root):
    return HEAD + source(good(root), extra='weight = "-0.5"\n'), r"sources\[0\]\(s\)\.weight: weight '-0\.5' is not a plain non-negative"


def _float_weight(root):
    return HEAD + source(good(root), extra="weight = 0.5\n"), r"sources\[0\]\(s\)\.weight: weight must be a decimal string"


def _word_weight(root):
    return HEAD + source(good(root), extra='weight = "lots"\n'), r"sources\[0\]\(s\)\.weight: weight 'lots'"


def _zero_weights(root):
    spec = HEAD + source(good(root), extra='weight = "0"\n') + source(good(root, "b.jsonl"), extra='weight = "0.0"\n', name="t")
    return spec, r"all weights are zero"


def _duplicate_object(root):
    good(root)
    return HEAD + source(["ok.jsonl", "./*.jsonl"]), r"duplicate object .*ok\.jsonl"


def _duplicate_across_sources(root):
    good(root)
    return HEAD + source("ok.jsonl") + source(".", name="t"), r"duplicate object .*ok\.jsonl: listed by source 's'"


def _not_a_tokenizer(root):
    (root / "tokenizer.json").write_text('{"model": {"type": "Nope"}, "version": "1.0"}')
    return 'name = "bad"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 16\n' + source(good(root)), \
        r"tokenizer .*tokenizer\.json.*not a tokenizer|tokenizers library refuses it"


def _tokenizer_not_json(root):
    (root / "tokenizer.json").write_bytes(b"\x00\x01binary")
    return 'name = "bad"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 16\n' + source(good(root)), \
        r"tokenizer .*tokenizer\.json.*not a tokenizer\.json"


def _unknown_key(root):
    return HEAD + source(good(root), extra='wieght = "1"\n'), r"sources\[0\]\(s\): unknown key\(s\) \['wieght'\]"


def _bad_toml(root):
    return "name = \n", r"invalid TOML"


def _seq_len_missing(root):
    return 'name = "bad"\n[packing]\nalgorithm = "concat"\n' + source(good(root)), r"packing\.seq_len: missing"


def _bad_algorithm(root):
    return 'name = "bad"\n[packing]\nseq_len = 8\nalgorithm = "zigzag"\n' + source(good(root)), r"packing\.algorithm: 'zigzag' is not one of"


def _token_string_without_tokenizer(root):
    return 'name = "bad"\n[packing]\nseq_len = 8\neos = "</s>"\n' + source(good(root)), r"packing: special tokens given as strings need a `tokenizer`"


def _s3_prefix_nothing(root):
    return HEAD + source("s3://err-bucket/nothing-here/"), r"s3 prefix s3://err-bucket/nothing-here/ matches no jsonl objects"


# -- compression bombs and hostile records (issue 10 items 5, 18, 20) --------
def bomb_bytes(compression: str, zeros: int) -> bytes:
    """`zeros` zero bytes (no newline) as concatenated 8 MiB gzip members / zstd frames: KB on disk."""
    block = bytes(8 << 20)
    member = gzip.compress(block, 6) if compression == "gzip" else zstandard.ZstdCompressor(level=3).compress(block)
    return member * (zeros // len(block))


def _zstd_bomb(root):
    (root / "bomb.jsonl.zst").write_bytes(bomb_bytes("zstd", 80 << 20))
    return HEAD + source("bomb.jsonl.zst"), r"bomb\.jsonl\.zst: line 1: longer than the limit of 67108864 bytes"


def _gzip_bomb(root):
    (root / "bomb.jsonl.gz").write_bytes(bomb_bytes("gzip", 80 << 20))
    return HEAD + source("bomb.jsonl.gz"), r"bomb\.jsonl\.gz: line 1: longer than the limit of 67108864 bytes"


def _deep_json_line(root):
    (root / "d.jsonl").write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    return HEAD + source("d.jsonl"), r"d\.jsonl: line 2: JSON nested too deeply"


def _huge_int_line(root):
    (root / "d.jsonl").write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")
    return HEAD + source("d.jsonl"), r"d\.jsonl: line 1: not usable JSON \(Exceeds the limit"


def _lone_surrogate(root):
    (root / "d.jsonl").write_text('{"text": "pair \\ud83d\\ude00 ok"}\n{"text": "a\\ud800b"}\n')
    return HEAD + source("d.jsonl"), r"d\.jsonl: line 2: text field 'text' holds an unpaired surrogate escape"


def _tar_bytes(n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
    return buf.getvalue()


def _tar_cut_at_member(root):
    # Two members of 512 + 512 bytes each: cutting at 2048 keeps both whole and drops the end blocks.
    (root / "cut.tar").write_bytes(_tar_bytes(3)[:2048])
    return HEAD + source("cut.tar", "webdataset"), r"cut\.tar: truncated or damaged tar archive: ends at byte 2048"


def _tar_cut_in_header(root):
    (root / "cut.tar").write_bytes(_tar_bytes(3)[:2048 + 100])
    return HEAD + source("cut.tar", "webdataset"), r"cut\.tar: truncated or damaged tar archive: ends inside the member header"


def _tar_garbled_header(root):
    data = bytearray(_tar_bytes(3))
    data[1024:1024 + 512] = b"x" * 512
    (root / "bad.tar").write_bytes(bytes(data))
    return HEAD + source("bad.tar", "webdataset"), r"bad\.tar: truncated or damaged tar archive: garbled member header at byte 1024"


def _eos_outside_vocabulary(root):
    shutil.copy(root.parent / "tok.json", root / "tok.json")
    return ('name = "bad"\ntokenizer = "tok.json"\n[packing]\nseq_len = 16\neos_id = 100000\n' + source(good(root)),
            r"packing\.eos_id: 100000 is outside the tokenizer's vocabulary \(1024 ids: 0\.\.1023\)")


def _long_weight(root):
    return HEAD + source(good(root), extra='weight = "0.' + "1" * 80 + '"\n'), r"sources\[0\]\(s\)\.weight: weight 0\.1+\.\.\. has 82 characters"


def _spec_not_utf8(root):
    return b'name = "\xff\xfe"\n', r"not UTF-8 \(invalid start byte at byte 8\)"


def _spec_huge_int(root):
    return HEAD + source(good(root), extra="weight = " + "9" * 5000 + "\n"), r"invalid TOML: Exceeds the limit"


CASES = {
    "missing path": _missing_path,
    "glob matches nothing": _glob_nothing,
    "dangling symlink": _dangling_symlink,
    "dangling pointer": _dangling_pointer,
    "truncated gzip": _truncated_gzip,
    "truncated zstd": _truncated_zstd,
    "corrupt parquet": _corrupt_parquet,
    "tar path traversal": _tar_traversal,
    "tar absolute member": _tar_absolute,
    "jsonl line not JSON": _not_json,
    "jsonl line lacks text field": _lacks_text,
    "jsonl text not a string": _text_not_string,
    "unknown format": _unknown_format,
    "negative weight": _negative_weight,
    "float weight": _float_weight,
    "non-decimal weight": _word_weight,
    "all weights zero": _zero_weights,
    "duplicate object in a source": _duplicate_object,
    "duplicate object across sources": _duplicate_across_sources,
    "tokenizer is not a tokenizer": _not_a_tokenizer,
    "tokenizer is not JSON": _tokenizer_not_json,
    "misspelled key": _unknown_key,
    "invalid TOML": _bad_toml,
    "seq_len missing": _seq_len_missing,
    "unknown packing algorithm": _bad_algorithm,
    "token string without tokenizer": _token_string_without_tokenizer,
    "s3 prefix matches nothing": _s3_prefix_nothing,
    "zstd bomb": _zstd_bomb,
    "gzip bomb": _gzip_bomb,
    "jsonl line nested 100k deep": _deep_json_line,
    "jsonl line with a 5000-digit integer": _huge_int_line,
    "jsonl text with an unpaired surrogate": _lone_surrogate,
    "tar cut at a member boundary": _tar_cut_at_member,
    "tar cut inside a header": _tar_cut_in_header,
    "tar with a garbled header": _tar_garbled_header,
    "eos_id outside the vocabulary": _eos_outside_vocabulary,
    "weight longer than the limit": _long_weight,
    "spec not UTF-8": _spec_not_utf8,
    "spec with a 5000-digit integer": _spec_huge_int,
}


def assert_nothing_written(out_dir: Path) -> None:
    assert sorted(p.name for p in out_dir.iterdir()) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_naming_the_place(case, tmp_path, sluice_main, request, tokenizer_file):
    if case.startswith("s3"):
        request.getfixturevalue("s3_server")  # sets the endpoint in os.environ for in-process calls
        request.getfixturevalue("s3_bucket_factory")("err-bucket", {"other/x.jsonl": b'{"text":"a"}\n'})
    shutil.copy(tokenizer_file, tmp_path / "tok.json")
    root = tmp_path / "in"
    root.mkdir()
    spec_text, pattern = CASES[case](root)
    spec = root / "spec.toml"
    (spec.write_bytes if isinstance(spec_text, bytes) else spec.write_text)(spec_text)
    out = tmp_path / "out"
    out.mkdir()
    r = sluice_main("manifest", "freeze", spec, "-o", out / "m.json")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("sluice: error: "), r.stderr
    assert "Traceback" not in r.stderr
    import re

    assert re.search(pattern, r.stderr), r.stderr
    assert str(spec) in r.stderr or root.name in r.stderr  # the file at fault is named
    assert_nothing_written(out)


def test_output_in_missing_folder(tmp_path, sluice_main):
    (tmp_path / "spec.toml").write_text(HEAD + source(good(tmp_path)))
    r = sluice_main("manifest", "freeze", tmp_path / "spec.toml", "-o", tmp_path / "no" / "such" / "m.json")
    assert r.returncode == 2
    assert "folder" in r.stderr and "no/such" in r.stderr and "does not exist" in r.stderr
    assert not (tmp_path / "no").exists()


def test_missing_spec_file(tmp_path, sluice_main):
    r = sluice_main("manifest", "freeze", tmp_path / "absent.toml", "-o", tmp_path / "m.json")
    assert r.returncode == 2 and "absent.toml: no such file" in r.stderr
    assert not (tmp_path / "m.json").exists()


def test_unreadable_file(tmp_path):
    """A file the user may not read. As root, the CLI runs without the DAC override capabilities."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and util-linux `setpriv` is absent: root reads any file")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    good(tmp_path)
    good(tmp_path, "secret.jsonl")
    os.chmod(tmp_path / "secret.jsonl", 0)
    (tmp_path / "spec.toml").write_text(HEAD + source(["ok.jsonl", "secret.jsonl"]))
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([*prefix, sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(tmp_path / "spec.toml"),
                        "-o", str(out / "m.json")], capture_output=True, text=True, timeout=120)
    os.chmod(tmp_path / "secret.jsonl", 0o600)
    assert r.returncode == 2, r.stderr
    assert re_search(r"secret\.jsonl.*(not readable|permission denied)", r.stderr), r.stderr
    assert_nothing_written(out)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_sigint_mid_freeze_leaves_nothing(tmp_path):
    """SIGINT while objects are being hashed: exit 130, no manifest, no temp file."""
    root = tmp_path / "big"
    root.mkdir()
    line = (json.dumps({"text": "lorem ipsum " * 40}) + "\n").encode()
    block = line * (4 * 1024 * 1024 // len(line))
    # 128 x 4 MiB: since the block-wise line check (0.6 GB/s or more) the 224 MiB left after the
    # 32 MiB mark below took ~0.35 s, short enough for a descheduled test to miss under load.
    for i in range(128):
        (root / f"part-{i:03d}.jsonl").write_bytes(block)
    (tmp_path / "spec.toml").write_text(HEAD + source("big"))
    from support import foreground_sigint

    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "manifest", "freeze", str(tmp_path / "spec.toml"), "-o", str(out / "m.json"),
         "--threads", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=foreground_sigint,
    )
    try:
        import psutil

        ps = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        # Interrupt once it has read 32 MiB of shard bytes (imports are mmapped, not read). Each look is
        # taken with the freeze stopped (SIGSTOP), and the SIGINT is sent before it continues: a test
        # descheduled under load can no longer see the freeze finish between its look and its signal.
        while True:
            os.kill(proc.pid, signal.SIGSTOP)
            assert proc.poll() is None, proc.communicate()
            if ps.io_counters().read_chars >= 32 * 1024 * 1024 or time.monotonic() > deadline:
                break
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_nothing_written(out)
