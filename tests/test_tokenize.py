"""Tokenizer identity, loading, encoding, thread control and offline training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from sluice.errors import TokenizerError
from sluice.tokenize import Encoder, load_tokenizer, tokenizer_digest
from sluice.tokenize.train import train_bpe

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "",
    "héllo wörld — ünïcode ✓ 中文",
    "class A:\n    pass\n" * 20,
    "   leading spaces and trailing   ",
    "text that names <|endoftext|> and <|pad|><|bos|> literally",
]


@pytest.fixture(scope="module")
def encoder(tokenizer_file: Path) -> Encoder:
    return load_tokenizer(tokenizer_file)


# ---------------------------------------------------------------- identity


def test_digest_is_b3_of_the_file_bytes(tokenizer_file: Path) -> None:
    expected = "b3:" + blake3.blake3(tokenizer_file.read_bytes()).hexdigest()
    assert tokenizer_digest(tokenizer_file) == expected
    assert load_tokenizer(tokenizer_file, expected).digest == expected


def test_a_different_digest_is_refused_naming_both_and_the_file(tokenizer_file: Path) -> None:
    wrong = "b3:" + "0" * 64
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tokenizer_file, wrong)
    message = str(info.value)
    assert wrong in message and tokenizer_digest(tokenizer_file) in message
    assert str(tokenizer_file) in message and "refuses to run" in message


def test_one_changed_byte_changes_the_identity(tokenizer_file: Path, tmp_path: Path) -> None:
    data = tokenizer_file.read_bytes()
    edited = tmp_path / "tokenizer.json"
    edited.write_bytes(data + b"\n")  # same tokenizer, one more byte of whitespace
    assert edited.read_bytes() != data
    assert tokenizer_digest(edited) != tokenizer_digest(tokenizer_file)
    with pytest.raises(TokenizerError, match="differs from the manifest"):
        load_tokenizer(edited, tokenizer_digest(tokenizer_file))


@pytest.mark.parametrize(
    "content, reason",
    [
        (b'{"vocab": {"a": 0}, "merges": []}', "without a 'model' field"),
        (b'[1, 2, 3]', "without a 'model' field"),
        (b'{"model": {"type": "Nonsense"}, "version": "1.0"}', "that tokenizers can load"),
        (b"{not json", "invalid JSON"),
        (bytes(range(256)) * 4, "not UTF-8"),
        (b"\x80\x04\x95pickle-like bytes", "not UTF-8"),
    ],
)
def test_a_file_that_is_not_a_tokenizer_is_named_in_the_error(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bogus.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value) and reason in str(info.value)


def test_missing_file_and_directory_are_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"missing\.json: no such file"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="is a directory"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no such file"):
        tokenizer_digest(tmp_path / "missing.json")


def test_identity_fields(encoder: Encoder) -> None:
    assert encoder.version == "1.0"
    assert encoder.vocab_size == 1024
    assert [(s.content, s.id) for s in encoder.special_tokens] == [("<|endoftext|>", 0), ("<|pad|>", 1), ("<|bos|>", 2)]
    assert encoder.token_to_id("<|bos|>") == 2
    with pytest.raises(TokenizerError, match="no token '<|nope|>'"):
        encoder.token_to_id("<|nope|>")


# ---------------------------------------------------------------- encoding


def test_encode_batch_equals_raw_tokenizers_ids(encoder: Encoder, tokenizer_file: Path) -> None:
    raw = Tokenizer.from_file(str(tokenizer_file))
    raw.encode_special_tokens = True  # the default policy: special-token text is plain text
    expected = [e.ids for e in raw.encode_batch(TEXTS, add_special_tokens=False)]
    got = encoder.encode_batch(TEXTS)
    assert len(got) == len(TEXTS)
    for arr, ids in zip(got, expected):
        assert arr.dtype == np.uint32 and arr.ndim == 1
        assert arr.tolist() == ids
    assert got[1].size == 0
    assert encoder.encode_batch([]) == []
    assert encoder.decode(got[2]) == TEXTS[2]


def test_special_token_text_in_a_document_stays_text_by_default(tokenizer_file: Path) -> None:
    text = "a<|endoftext|>b"
    literal = load_tokenizer(tokenizer_file).encode_batch([text])[0]
    assert 0 not in literal.tolist()
    special = load_tokenizer(tokenizer_file, specials_in_text="special").encode_batch([text])[0]
    assert 0 in special.tolist()
    raw = Tokenizer.from_file(str(tokenizer_file))
    assert special.tolist() == raw.encode(text, add_special_tokens=False).ids
    with pytest.raises(TokenizerError, match="specials_in_text"):
        load_tokenizer(tokenizer_file, specials_in_text="maybe")


def test_no_framing_padding_or_truncation_from_the_file(tokenizer_file: Path, tmp_path: Path) -> None:
    """A file with a bos/eos post-processor, padding and truncation still yields each document's ids only."""
    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|endoftext|>", special_tokens=[("<|bos|>", 2), ("<|endoftext|>", 0)]
    )
    tok.enable_truncation(max_length=4)
    tok.enable_padding(pad_id=1, pad_token="<|pad|>", length=64)
    path = tmp_path / "framed.json"
    tok.save(str(path))
    plain = load_tokenizer(tokenizer_file).encode_batch(TEXTS)
    framed = load_tokenizer(path).encode_batch(TEXTS)
    assert [a.tolist() for a in framed] == [a.tolist() for a in plain]
    assert len(plain[3]) > 64  # longer than both the truncation and the padding length


# ---------------------------------------------------------------- threads

_THREAD_PROBE = r"""
import os, sys, json
from sluice.tokenize import load_tokenizer, configure_threads, current_threads
from sluice.errors import TokenizerError
def n(): return len(os.listdir("/proc/self/task"))
path, threads = sys.argv[1], int(sys.argv[2])
enc = load_tokenizer(path, threads=threads)
before = n()
enc.encode_batch(["x = 1\n" * 50] * 64)
out = {"before": before, "after": n(), "current": current_threads()}
try:
    configure_threads(threads + 1)
    out["resize"] = "allowed"
except TokenizerError as exc:
    out["resize"] = str(exc)
configure_threads(1)
out["serial"] = current_threads()
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux /proc")
@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_is_what_was_asked(tokenizer_file: Path, threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    proc = subprocess.run(
        [sys.executable, "-c", _THREAD_PROBE, str(tokenizer_file), str(threads)],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["current"] == threads
    if threads == 1:
        assert out["after"] == out["before"]  # no Rust pool was created
        assert out["resize"] == "allowed"  # no pool yet, so any size can still be chosen
    else:
        assert out["after"] - out["before"] == threads  # the pool, created by the first batch
        assert "cannot be resized" in out["resize"]
    assert out["serial"] == 1


def test_bad_thread_counts_are_refused(tokenizer_file: Path) -> None:
    for bad in (0, -2, True, 1.5):
        with pytest.raises(TokenizerError, match="threads"):
            load_tokenizer(tokenizer_file, threads=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- training


def _corpus(root: Path) -> Path:
    """A small real corpus: 12 stdlib sources of the email and json packages, one note, one jsonl."""
    import email

    sources = sorted(Path(email.__file__).parent.glob("*.py"))[:8] + sorted(Path(json.__file__).parent.glob("*.py"))[:4]
    (root / "a" / "deep").mkdir(parents=True)
    for i, src in enumerate(sources):
        (root / ("a/deep" if i % 3 == 0 else "a") / f"m{i:02d}.py").write_bytes(src.read_bytes())
    (root / "notes.md").write_text("# Notes\n\nsluice trains offline.\n", encoding="utf-8")
    (root / "docs.jsonl").write_text(
        "\n".join(json.dumps({"text": f"document {i}: {'word ' * i}"}) for i in range(30)) + "\n", encoding="utf-8"
    )
    (root / "ignored.bin").write_bytes(b"\xff\xfe not text")
    return root


def test_training_twice_gives_byte_identical_tokenizers(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    first = train_bpe([corpus], tmp_path / "t1.json", vocab_size=600)
    second = train_bpe([corpus], tmp_path / "t2.json", vocab_size=600)
    assert (tmp_path / "t1.json").read_bytes() == (tmp_path / "t2.json").read_bytes()
    assert first.digest == second.digest == tokenizer_digest(tmp_path / "t1.json")
    assert first.files == 14 and first.documents == 12 + 1 + 30  # the .bin file is not read
    assert first.vocab_size == 600
    enc = load_tokenizer(tmp_path / "t1.json")
    assert [(s.content, s.id) for s in enc.special_tokens] == [("<|endoftext|>", 0), ("<|pad|>", 1), ("<|bos|>", 2)]
    text = "byte-level: every input encodes, even \x00 and 🦀"
    assert enc.decode(enc.encode_batch([text])[0]) == text


def test_training_does_not_depend_on_the_thread_count(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    train_bpe([corpus], tmp_path / "here.json", vocab_size=500)
    code = (
        "import sys; from sluice.tokenize.train import train_bpe; "
        "train_bpe([sys.argv[1]], sys.argv[2], vocab_size=500)"
    )
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, "-c", code, str(corpus), str(tmp_path / "serial.json")], env=env, check=True, timeout=120)
    assert (tmp_path / "here.json").read_bytes() == (tmp_path / "serial.json").read_bytes()


def test_training_errors_are_clear(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"x")
    with pytest.raises(TokenizerError, match="no files to train on"):
        train_bpe([empty], tmp_path / "t.json", vocab_size=300)
    with pytest.raises(TokenizerError, match=r"nowhere: no such file or directory"):
        train_bpe([tmp_path / "nowhere"], tmp_path / "t.json", vocab_size=300)
    blank = tmp_path / "blank.txt"
    blank.write_text("", encoding="utf-8")
    with pytest.raises(TokenizerError, match="no text"):
        train_bpe([blank], tmp_path / "t.json", vocab_size=300)
    with pytest.raises(TokenizerError, match="at least 259"):
        train_bpe([blank], tmp_path / "t.json", vocab_size=100)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TokenizerError, match=r"bad\.txt: not UTF-8"):
        train_bpe([bad], tmp_path / "t.json", vocab_size=300)
    assert not (tmp_path / "t.json").exists()  # nothing half-written


def test_cli_train_then_identity(tmp_path: Path, sluice_main) -> None:
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "tok.json"
    proc = sluice_main("tokenize", "train", corpus, "-o", out, "--vocab-size", "400", "--special", "<|eos|>", "--json")
    assert proc.returncode == 0, proc.stderr
    trained = json.loads(proc.stdout)
    proc = sluice_main("tokenize", "identity", out, "--json")
    assert proc.returncode == 0, proc.stderr
    ident = json.loads(proc.stdout)
    assert ident["digest"] == trained["digest"] == tokenizer_digest(out)
    assert ident["vocab_size"] == 400 and ident["version"] == "1.0"
    assert ident["special_tokens"] == [{"id": 0, "content": "<|eos|>"}]
    proc = sluice_main("tokenize", "train", tmp_path / "missing", "-o", out, "--vocab-size", "400")
    assert proc.returncode == 2 and "sluice: error: corpus path" in proc.stderr and "missing" in proc.stderr
    proc = sluice_main("tokenize", "identity", corpus / "notes.md")
    assert proc.returncode == 2 and "notes.md: not a tokenizer.json" in proc.stderr


def test_cli_train_reads_compressed_jsonl_and_parquet_and_says_what_it_skipped(tmp_path: Path, sluice_main) -> None:
    """A folder as users have it: gzip and zstd jsonl and parquet with the field `body`, and files it cannot read."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    docs = [f"document {i}: " + "word " * (i % 40) for i in range(120)]
    lines = ["".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(docs[k::3])) for k in range(3)]
    (data / "a.jsonl.gz").write_bytes(gzip.compress(lines[0].encode()))
    (data / "sub" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines[1].encode()))
    pq.write_table(pa.table({"id": list(range(40)), "body": docs[2::3]}), data / "c.parquet")
    (data / "notes.csv").write_text("a,b\n")
    (data / "shard.tar").write_bytes(b"\0" * 512)
    out = tmp_path / "tok.json"

    proc = sluice_main("tokenize", "train", data, "-o", out, "--vocab-size", "400", "--text-field", "body", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["read"] == {"jsonl.gz": {"files": 1, "documents": 40}, "jsonl.zst": {"files": 1, "documents": 40},
                           "parquet": {"files": 1, "documents": 40}}
    assert got["files"] == 3 and got["documents"] == 120
    assert {Path(s["path"]).name: s["why"].split(" (")[0].split(":")[0] for s in got["skipped"]} == {
        "notes.csv": "not a corpus file", "shard.tar": "a tar archive"}
    proc = sluice_main("tokenize", "train", data, "-o", out, "--vocab-size", "400", "--text-field", "body")
    assert "read       1 jsonl.gz (40 documents), 1 jsonl.zst (40 documents), 1 parquet (40 documents)" in proc.stdout
    assert "skipped    " + str(data / "notes.csv") + ": not a corpus file" in proc.stdout

    # the default field is `text`: the first file without it is named, with the fields it has and the flag
    proc = sluice_main("tokenize", "train", data, "-o", tmp_path / "t2.json", "--vocab-size", "400")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"corpus file {data / 'a.jsonl.gz'} line 1: no string field 'text' (it has: 'body', 'id'); " \
           "--text-field names the field" in proc.stderr
    proc = sluice_main("tokenize", "train", data / "c.parquet", "-o", tmp_path / "t2.json", "--vocab-size", "400",
                      "--text-field", "id")
    assert proc.returncode == 2 and "column 'id' holds int64, not strings" in proc.stderr
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes((data / "a.jsonl.gz").read_bytes()[:200])
    proc = sluice_main("tokenize", "train", cut, "-o", tmp_path / "t2.json", "--vocab-size", "400", "--text-field", "body")
    assert proc.returncode == 2 and f"corpus file {cut}: truncated gzip stream" in proc.stderr
    assert not (tmp_path / "t2.json").exists()
