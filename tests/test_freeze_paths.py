"""Freeze's fast paths give exactly the answers of its plain paths.

Specification in brief:
* the block line check (msgspec + numpy, `sluice/manifest/jsonl.py`) accepts,
  counts, collects and refuses exactly what the line-by-line `json.loads`
  path does, with the same error naming the same line, wherever the read
  chunks and the blocks are cut;
* the zstd frame walker (`decode.ZstdFrames`) cuts the stored bytes so that
  one decompress call yields at most `ZSTD_BLOCKS` blocks (a bomb stays
  bounded), and refuses a stream cut anywhere before the end of its last
  frame;
* a process pool gives the same manifest bytes as the thread pool, and the
  same error for a bad line.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec  # noqa: F401 - the block path needs it; the test extra installs it
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from support import examples

from sluice.errors import SourceReadError
from sluice.manifest import decode, formats, jsonl
from sluice.manifest.decode import Decoder
from sluice.manifest.freeze import freeze

GOOD = [b'{"text":"a"}', b'{"text":"bb","id":1}\r', b'{"id":[1,{"x":null}],"text":"\\u00e9\\ud83d\\ude00"}',
        '{"text":"é wörds"}'.encode(), b'{"text":"x","text":"y"}', b'{"text":1,"text":"last wins"}',
        b'{"text":"a","n":NaN}', b'{"text":"a","n":1e999}', b'{"text":"a","big":18446744073709551616}',
        b'  {"text":"lead"}', b'{"text":"trail"}  ', b"", b"\r",
        b'{"text":"a","x":' + b"9" * 4300 + b"}", b'{"text":"a","x":1.' + b"5" * 5000 + b"}",
        b'{"text":"' + b"7" * 5000 + b'"}', b'{"text":"a","x":"\xc3\xa9\\ud83d\\ude00"}',
        b'{"text":"a","x":"\\ud800"}']
BAD = [b'{"text":1}', b'{"txt":"a"}', b'["text"]', b'"text"', b'{"text":"a"} {"text":"b"}', b'{"text":',
       b'"a"}', b'{"text":"a","x":"\xff"}', b'{"text":"\\ud800"}', b'{"text":"a",}', b'{"text":"a"}x', b"  ",
       b'{"text":"a","x":' + b"1" * 5000 + b"}", b'\xef\xbb\xbf{"text":"bom"}', b'{"text":"a\x01"}',
       ]
# Malformed values besides the text: a decode that skipped them (a Struct of the text field alone)
# would check their syntax but not their UTF-8 nor Python's limit on integer digits.
SKIPPED_BAD = [b'{"text":"a","\xff":1}', b'{"text":"\xc3"}', b'{"text":"a","x":{"y":[' + b"9" * 4301 + b"]}}",
               b'{"text":"a","x":' + b"1" * 5000 + b"}", b'{"text":"a","x":"\xed\xa0\x80"}',
               b'{"text":"a","x":[1,]}', b'{"text":"a","x":01}', b'{"text":"a","x":"\\q"}',
               b'{"text":"a","x":tru}', b'{"text":null}', b'{"text":"a","x":{"k" 1}}', b'{"text":"a","x":"\t"}']
BAD += SKIPPED_BAD


def _scan(data: bytes, cuts: list[int], *, block_path: bool, collect: bool, max_line: int = 1 << 20):
    scanner = jsonl.JsonlScanner("obj", "text", "full", collect, max_line, block_path=block_path)
    pos = 0
    try:
        for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
            if cut > pos:
                scanner.feed(data[pos:cut])
                pos = cut
        scanner.finish()
    except SourceReadError as exc:
        return ("error", str(exc))
    return ("ok", scanner.records, scanner.lines, scanner.texts)


@settings(max_examples=examples(250), deadline=None)
@given(lines=st.lists(st.sampled_from(GOOD + BAD) | st.sampled_from(GOOD), max_size=24),
       cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
       long_lines=st.booleans(), collect=st.booleans(), block=st.sampled_from([16, 64, 1 << 20]),
       newline_at_end=st.booleans())
def test_block_path_answers_exactly_like_the_line_path(lines, cuts, long_lines, collect, block, newline_at_end):
    """Same records, line count, texts and error (message and line) for any lines and any chunking."""
    data = b"\n".join(lines) + (b"\n" if newline_at_end else b"")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jsonl, "LONG_LINE", 0 if long_lines else 1 << 30)  # memchr walk or numpy
        mp.setattr(jsonl, "BLOCK", block)
        fast = _scan(data, cuts, block_path=True, collect=collect)
    plain = _scan(data, cuts, block_path=False, collect=collect)
    assert fast == plain


@pytest.mark.parametrize("bad", SKIPPED_BAD)
def test_a_malformed_skipped_value_fails_like_on_the_line_path(bad):
    """A bad line amid good ones in one block: the block path refuses the block, and the line path
    names the line, exactly as without msgspec."""
    data = b'{"text":"before","n":[1,2]}\n' * 40 + bad + b"\n" + b'{"text":"after"}\n' * 40
    fast = _scan(data, [], block_path=True, collect=False)
    assert fast == _scan(data, [], block_path=False, collect=False)
    assert fast[0] == "error" and "obj: line 41: " in fast[1]


def _lines(n: int, bad_at: int | None = None) -> bytes:
    """n jsonl lines; line `bad_at` has an int text field and the same length as the good line it replaces."""
    out = []
    for i in range(1, n + 1):
        good = json.dumps({"id": i, "text": f"document {i} " + "w" * (i % 50)})
        if i == bad_at:
            pad = len(good) - len(json.dumps({"id": i, "text": 7, "pad": ""}))
            good = json.dumps({"id": i, "text": 7, "pad": "x" * pad})
        out.append(good.encode())
    return b"\n".join(out) + b"\n"


@pytest.mark.parametrize("where", ["middle of a block", "across a read chunk", "last line, no newline"])
def test_a_bad_line_is_named_wherever_it_falls(tmp_path, monkeypatch, where):
    monkeypatch.setattr(formats, "CHUNK", 1 << 16)  # small reads so that lines straddle them
    monkeypatch.setattr(jsonl, "BLOCK", 1 << 12)
    data = _lines(3000)
    lines = data.split(b"\n")
    if where == "middle of a block":
        number = 1500
    elif where == "across a read chunk":
        starts = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
        number = next(i for i, s in enumerate(starts) if s > (1 << 16))  # the line holding byte 65536
    else:
        number = 3000
    data = _lines(3000, bad_at=number)
    if where == "last line, no newline":
        data = data[:-1]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    with pytest.raises(SourceReadError, match=rf"bad\.jsonl: line {number}: text field 'text' not a string \(int\)"):
        formats.scan_object(str(path), "jsonl", "none", "text")
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(data))
    with pytest.raises(SourceReadError, match=rf"line {number}: text field 'text' not a string"):
        formats.scan_object(str(path), "jsonl", "zstd", "text")


def test_read_texts_and_counts_agree_across_paths_on_a_big_object(tmp_path, monkeypatch):
    """Several read chunks and blocks of real-looking documents, NaN lines (line path) among them."""
    rows = [json.dumps({"id": i, "text": "é wörds\n" * (i % 40), "score": 0.5}).encode() for i in range(20000)]
    rows[777] = b'{"text":"nan here","score":NaN}'
    rows[15000] = b""
    data = b"\n".join(rows) + b"\n"
    path = tmp_path / "big.jsonl"
    path.write_bytes(data)
    expected = [json.loads(r)["text"] for r in rows if r]
    assert formats.read_texts(str(path), "jsonl", "none", "text", "big") == expected
    assert formats.count_records(str(path), "jsonl", "none", "text", "big") == len(expected)
    monkeypatch.setattr(jsonl, "_DECODER", None)  # the line path only
    assert formats.read_texts(str(path), "jsonl", "none", "text", "big") == expected


# -- zstd frames ---------------------------------------------------------------------
def _frames() -> tuple[bytes, bytes]:
    """Three frames (with and without checksum and content size) and a skippable frame between them."""
    data = _lines(4000)
    third = len(data) // 3
    with_sum = zstandard.ZstdCompressor(level=3, write_checksum=True)
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False)
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"hello"
    stored = (with_sum.compress(data[:third]) + skippable + no_size.compress(data[third : 2 * third])
              + zstandard.ZstdCompressor(level=19).compress(data[2 * third :]))
    return data, stored


def _decode_all(stored: bytes, piece: int) -> bytes:
    dec = Decoder("zstd", "z")
    out = []
    for i in range(0, len(stored), piece):
        out.extend(dec.feed(stored[i : i + piece]))
    dec.finish()
    return b"".join(out)


@pytest.mark.parametrize("piece", [1, 3, 7, 4096, 1 << 20])
def test_frames_decode_whatever_the_read_size(piece):
    data, stored = _frames()
    if piece == 1:  # byte by byte: every header field split across calls; the first 16 KiB are enough
        dec = Decoder("zstd", "z")
        out = b"".join(part for i in range(1 << 14) for part in dec.feed(stored[i : i + 1]))
        assert len(out) > 0 and out == data[: len(out)]
        return
    assert _decode_all(stored, piece) == data


def test_a_stream_cut_anywhere_is_truncated():
    data, stored = _frames()
    sizes = len(stored)
    cuts = sorted({1, 3, 4, 5, 6, 9, 12, sizes // 5, sizes // 2, sizes - 9, sizes - 5, sizes - 4, sizes - 1})
    for cut in cuts:
        with pytest.raises(SourceReadError, match=r"z: (truncated zstd stream|corrupt zstd stream)"):
            _decode_all(stored[:cut], 1 << 16)
    with pytest.raises(SourceReadError, match="truncated zstd stream"):
        _decode_all(b"", 1 << 16)
    with pytest.raises(SourceReadError, match="truncated zstd stream"):
        _decode_all(stored[:-1], 1 << 16)
    with pytest.raises(SourceReadError, match=r"corrupt zstd stream \(no frame magic .*got 6a756e6b"):
        _decode_all(stored + b"junk", 1 << 16)


def test_a_bomb_is_decoded_at_most_zstd_blocks_at_a_time(tmp_path):
    """256 MiB of zeros in a few KB: no decompress call yields more than ZSTD_BLOCKS blocks."""
    stored = zstandard.ZstdCompressor(level=19).compress(b"\0" * (256 << 20))
    assert len(stored) < 64 << 10
    dec = Decoder("zstd", "bomb")
    biggest = total = 0
    for part in dec.feed(stored):
        biggest, total = max(biggest, len(part)), total + len(part)
    dec.finish()
    assert total == 256 << 20
    assert biggest <= decode.ZSTD_BLOCKS * (128 << 10)


# -- the process pool ----------------------------------------------------------------
def _corpus(root: Path) -> Path:
    (root / "data").mkdir()
    for i in range(3):
        data = _lines(500 + i)
        (root / "data" / f"p{i}.jsonl").write_bytes(data)
        (root / "data" / f"z{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data + b'{"text":"z"}\n'))
        (root / "data" / f"g{i}.jsonl.gz").write_bytes(gzip.compress(data + b'{"text":"g"}\n'))
    spec = root / "spec.toml"
    spec.write_text('name = "pool"\n[packing]\nseq_len = 64\n'
                    '[[sources]]\nname = "a"\npaths = ["data/*.jsonl"]\nformat = "jsonl"\n'
                    '[[sources]]\nname = "b"\npaths = ["data/*.jsonl.zst", "data/*.jsonl.gz"]\nformat = "jsonl"\n')
    return spec


def test_processes_give_the_manifest_bytes_of_threads(tmp_path):
    spec = _corpus(tmp_path)
    threads = freeze(spec, tmp_path / "t.json", processes=0, progress=False)
    procs = freeze(spec, tmp_path / "p.json", processes=2, progress=False)
    assert (tmp_path / "t.json").read_bytes() == (tmp_path / "p.json").read_bytes()
    assert threads.dataset_id == procs.dataset_id
    assert [s.records for s in procs.sources] == [500 + 501 + 502, 2 * (501 + 502 + 503)]


@pytest.mark.parametrize("bad", ["p0.jsonl", "p2.jsonl", "z2.jsonl.zst"])
def test_a_bad_line_in_a_process_is_named_like_on_a_thread(tmp_path, bad):
    """Whichever object is bad (the first job, a later one, a compressed one), the error is the one the
    threads give."""
    spec = _corpus(tmp_path)
    data = _lines(300, bad_at=123)
    (tmp_path / "data" / bad).write_bytes(zstandard.ZstdCompressor().compress(data) if bad.endswith(".zst") else data)
    messages = []
    for processes in (0, 2):
        with pytest.raises(SourceReadError) as info:
            freeze(spec, tmp_path / "m.json", processes=processes, progress=False)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"{bad}: line 123: text field 'text' not a string (int)" in messages[0]
    assert not (tmp_path / "m.json").exists()


def test_a_bad_line_on_threads_is_named_in_a_fresh_process(tmp_path, sluice_cli):
    """A small corpus is scanned on threads; a bad line there is the line's error, exit 2 (it was
    "bug in sluice: AttributeError" when no process pool had been made in the process)."""
    spec = _corpus(tmp_path)
    (tmp_path / "data" / "p1.jsonl").write_bytes(_lines(300, bad_at=123))
    r = sluice_cli("manifest", "freeze", str(spec), "-o", str(tmp_path / "m.json"), "--no-progress")
    assert r.returncode == 2
    assert "p1.jsonl: line 123: text field 'text' not a string (int)" in r.stderr
    assert "bug in sluice" not in r.stderr


def test_processes_flag_is_checked(tmp_path, sluice_main):
    spec = _corpus(tmp_path)
    r = sluice_main("manifest", "freeze", str(spec), "-o", str(tmp_path / "m.json"), "--processes", "-1")
    assert r.returncode == 2
    assert "sluice: error: manifest freeze: --processes must be 0 (threads only) or more, got -1" in r.stderr


@pytest.mark.slow
def test_a_dead_worker_is_a_manifest_error_naming_the_object(tmp_path):
    """A script that calls freeze() unguarded makes every worker die at start: the parent says so, names
    an object and the way out, and writes nothing."""
    import subprocess
    import sys

    spec = _corpus(tmp_path)
    script = tmp_path / "run.py"
    script.write_text("from sluice.manifest.freeze import freeze\n"
                      f"freeze({str(spec)!r}, {str(tmp_path / 'm.json')!r}, processes=2, progress=False)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "sluice.errors.ManifestError: source " in r.stderr
    assert "a freeze worker process died" in r.stderr and "--processes 0" in r.stderr
    assert not (tmp_path / "m.json").exists()


def test_webdataset_tar_zst_reads_through_the_frame_walk(tmp_path):
    """A .tar.zst (two frames, a skippable one between) reads like its .tar; cut short, it is refused."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(50):
            for suffix, body in (("txt", f"sample {i} " * (i + 1)), ("json", "{}")):
                info = tarfile.TarInfo(f"s{i:03d}.{suffix}")
                data = body.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    half = len(raw) // 2
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    stored = zstandard.ZstdCompressor().compress(raw[:half]) + skippable + zstandard.ZstdCompressor().compress(raw[half:])
    (tmp_path / "w.tar").write_bytes(raw)
    (tmp_path / "w.tar.zst").write_bytes(stored)
    plain = formats.read_texts(str(tmp_path / "w.tar"), "webdataset", "none", "txt", "w")
    assert len(plain) == 50
    assert formats.read_texts(str(tmp_path / "w.tar.zst"), "webdataset", "zstd", "txt", "w") == plain
    assert formats.scan_object(str(tmp_path / "w.tar.zst"), "webdataset", "zstd", "txt").records == 50
    (tmp_path / "cut.tar.zst").write_bytes(stored[:-3])
    with pytest.raises(SourceReadError, match=r"cut\.tar\.zst: truncated zstd stream"):
        formats.scan_object(str(tmp_path / "cut.tar.zst"), "webdataset", "zstd", "txt")
