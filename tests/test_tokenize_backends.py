"""The fastokens and tokie backends: the ids of `tokenizers` on three tokenizer families, or refused naming why.

Three families are trained here, offline, on the standard library's sources:
GPT-2 style byte-level BPE (conftest's `tokenizer_file`), a llama-3 style regex
+ byte-level BPE, and a SentencePiece style BPE (Metaspace, byte fallback).
Every backend that loads a family is compared with `tokenizers` on
hypothesis-generated unicode; one that cannot reproduce a family is refused at
load and at freeze, with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from support import examples, stdlib_texts, text_manifest
from sluice.errors import TokenizerError
from sluice.tokenize import load_tokenizer

pytest.importorskip("fastokens")
pytest.importorskip("tokie")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NATIVE = ("fastokens", "tokie")
# (family, backend) pairs a backend serves; the others are refused (test_*_is_refused_naming_why)
SERVED = [("gpt2", "fastokens"), ("gpt2", "tokie"), ("llama3", "fastokens")]
TEXTS = [
    "def f(x):\n    return x + 1\n",
    "",
    "héllo wörld — ünïcode ✓ 中文 🙂 👨‍👩‍👧 e\u0301\u0302",
    "   leading spaces and trailing   \n\n\t\r\n",
    "text that names <|endoftext|> and <|pad|><|bos|> literally, <|begin_of_text|> too",
    "it's we'll they've I'd 12345 3.14 x==y",
]


def _train(tok: Tokenizer, trainer: trainers.BpeTrainer, path: Path) -> Path:
    tok.train_from_iterator(stdlib_texts(60), trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def families(tokenizer_file, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("families")
    llama = Tokenizer(models.BPE())
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama.decoder = decoders.ByteLevel()
    _train(llama, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
           folder / "llama3.json")
    spm = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    # Trained on words (split=True: 0.5 s, not the 27 s of whole documents as one word), saved as llama-2's
    # tokenizer.json has it: no split, "▁" before the first word only.
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    spm.train_from_iterator(stdlib_texts(60), trainer=trainers.BpeTrainer(
        vocab_size=1024, show_progress=False, special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    spm.save(str(folder / "spm.json"))
    return {"gpt2": tokenizer_file, "llama3": folder / "llama3.json", "spm": folder / "spm.json"}


_encoders: dict[tuple[str, str], object] = {}


def _enc(families: dict[str, Path], family: str, backend: str):
    """Loaded once per (family, backend) for the module: hypothesis calls the test many times."""
    key = (family, backend)
    if key not in _encoders:
        _encoders[key] = load_tokenizer(families[family], backend=backend)
    return _encoders[key]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype == np.uint32 and np.array_equal(x, y) for x, y in zip(a, b))


# Unicode the pre-tokenizers treat differently: letters of several scripts, digits, combining marks,
# emoji with joiners, every kind of whitespace run, contractions, and special-token text.
_PIECES = st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "'s", "'LL", "n't",
                           "e\u0301", "\u0308", "👨‍👩‍👧", "🏳️‍🌈", "中文", "한국어", "ا", "ß", "İ", "123456", "3.14",
                           "<|endoftext|>", "<|pad|>", "<s>", "</s>", "<unk>", "▁", "def ", "():", "x_y"])
_TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=60),
    st.lists(st.one_of(_PIECES, st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)),
             max_size=20).map("".join),
)
_BATCH = st.lists(_TEXT, min_size=1, max_size=8)


@pytest.mark.parametrize("family, backend", SERVED)
def test_backend_gives_the_ids_of_tokenizers_on_real_text(families, family, backend):
    hf, other = _enc(families, family, "hf"), _enc(families, family, backend)
    texts = TEXTS + stdlib_texts(40)
    assert other.backend == backend and (other.digest, other.vocab_size) == (hf.digest, hf.vocab_size)
    assert _same(hf.encode_batch(texts), other.encode_batch(texts))


@pytest.mark.parametrize("family, backend", SERVED)
@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=_BATCH)
@example(texts=["\x0c's", "x\t't", "  \x0b\r've", ".?\n\n\x0c\u1680'", "'\x0c   \x0c\n"])  # tokie's lexer (native.py)
def test_backend_equals_tokenizers_on_any_unicode(families, family, backend, texts):
    assert _same(_enc(families, family, "hf").encode_batch(texts), _enc(families, family, backend).encode_batch(texts))


@pytest.mark.parametrize("backend", NATIVE)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=_BATCH)
def test_special_mode_equals_tokenizers(families, backend, texts):
    """specials_in_text="special": a special token's text is the token, as tokenizers matches it."""
    hf = load_tokenizer(families["gpt2"], specials_in_text="special")
    other = load_tokenizer(families["gpt2"], backend=backend, specials_in_text="special")
    assert _same(hf.encode_batch(texts), other.encode_batch(texts))


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_long_documents_keep_the_ids_where_tokie_alone_would_not(families, family):
    """tokie cuts a text of >= 10,000 bytes at spaces into per-CPU chunks, which splits pre-tokenizer
    pieces: its own ids differ on a long stdlib file; the backend gives that text to tokenizers."""
    import tokie

    long_doc = "\n".join(stdlib_texts(30))[:200_000]
    hf = _enc(families, family, "hf")
    want = hf.encode_batch([long_doc])
    raw = tokie.Tokenizer.from_json(str(families[family])).encode(long_doc, add_special_tokens=False).ids
    assert list(raw) != want[0].tolist()  # the reason for the rule (tokie 0.1.4)
    for fam, backend in SERVED:
        if fam == family:
            assert _same(want, _enc(families, family, backend).encode_batch([long_doc]))


@pytest.mark.parametrize("backend, reason", [
    ("fastokens", "fastokens cannot load it (pre-tokenizer error: unsupported pre-tokenizer type: Metaspace)"),
    ("tokie", "tokie gives other ids than tokenizers with a Metaspace pre-tokenizer (SentencePiece style)"),
    ("tiktoken", "the tiktoken backend cannot represent this pre-tokenizer"),
])
def test_sentencepiece_family_is_refused_naming_why(families, backend, reason):
    pytest.importorskip(backend)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(families["spm"], backend=backend)
    assert reason in str(info.value) and str(families["spm"]) in str(info.value)


def test_tokie_refuses_the_llama3_family_whose_tab_it_splits_otherwise(families):
    import tokie

    with pytest.raises(TokenizerError, match=r"tokie splits text by its own rules.*\(Sequence\) is refused"):
        load_tokenizer(families["llama3"], backend="tokie")
    raw = tokie.Tokenizer.from_json(str(families["llama3"]))
    text = "def f(x):\n\t(self, y) = x\n"
    assert list(raw.encode(text, add_special_tokens=False).ids) != _enc(families, "llama3", "hf").encode_batch([text])[0].tolist()
    assert _same(_enc(families, "llama3", "hf").encode_batch([text]), _enc(families, "llama3", "fastokens").encode_batch([text]))


def test_tokie_would_serve_other_ids_on_the_sentencepiece_family(families):
    """Why tokie is refused there: loaded directly, it gives other ids for ordinary text."""
    import tokie

    hf = _enc(families, "spm", "hf")
    raw = tokie.Tokenizer.from_json(str(families["spm"]))
    texts = stdlib_texts(10)
    differ = sum(list(raw.encode(t, add_special_tokens=False).ids) != a.tolist()
                 for t, a in zip(texts, hf.encode_batch(texts)))
    assert differ >= 1


class OneIdOff:
    """A real fastokens codec whose output has one id changed: document `doc`, token `at`."""

    def __new__(cls, tok, doc: int, at: int):
        from sluice.tokenize.native import FastokensCodec

        class Broken(FastokensCodec):
            __slots__ = ()

            def encode_batch(self, texts, threads):
                out = super().encode_batch(texts, threads)
                if len(out) > doc and out[doc].size > at:
                    out[doc] = out[doc].copy()
                    out[doc][at] = (int(out[doc][at]) + 1) % 256
                return out

        return Broken(tok, literal=True)


def test_a_broken_backend_is_caught_naming_document_and_offset(families, tmp_path):
    import fastokens

    from sluice.cache import NodeCache
    from sluice.manifest.model import load_manifest
    from sluice.tokenize.check import check_backend
    from sluice.tokenize.encoder import Encoder, tokenizer_digest

    path = families["gpt2"]
    texts = TEXTS + stdlib_texts(5)
    manifest = load_manifest(text_manifest(tmp_path, path, texts))
    broken = Encoder(Tokenizer.from_file(str(path)), path=str(path), digest=tokenizer_digest(path), version="1.0",
                     fast=OneIdOff(fastokens.Tokenizer.from_file(str(path)), doc=7, at=5))
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        good = check_backend(manifest, "fastokens", cache=cache)
        bad = check_backend(manifest, "fastokens", cache=cache, other=broken)
    assert good.equal and good.documents == len(texts)
    assert (bad.equal, bad.mismatched) == (False, 1)
    m = bad.mismatches[0]
    assert (m.source, m.location, m.record, m.position) == ("docs", "docs.jsonl", 7, 5)
    assert m.describe("fastokens").startswith("source 'docs' object docs.jsonl record 7: token 5: hf [")


@pytest.mark.parametrize("backend", NATIVE)
def test_tokenize_check_proves_each_backend_on_a_corpus(families, tmp_path, sluice_main, backend):
    ok = text_manifest(tmp_path, families["gpt2"], TEXTS + stdlib_texts(20))
    res = sluice_main("tokenize", "check", ok, "--backend", backend, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["equal"], out["backend"], out["documents"], out["mismatched"]) == (True, backend, 26, 0)
    res = sluice_main("tokenize", "check", ok, "--backend", backend, "--sample", "4")
    assert res.returncode == 0 and f"SAME ids: {backend} vs hf on 4 documents" in res.stdout


def _spec(folder: Path, tokenizer: Path, texts: list[str], backend: str) -> Path:
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (folder / "dataset.toml").write_text(
        f'name = "fast"\ntokenizer = "tokenizer.json"\ntokenizer_backend = "{backend}"\n'
        '[packing]\nseq_len = 32\neos_id = 0\n'
        '[[sources]]\nname = "docs"\npaths = ["docs.jsonl"]\nformat = "jsonl"\nweight = "1"\n')
    return folder / "dataset.toml"


def test_auto_records_the_fastest_proven_backend(families, tmp_path, sluice_main):
    from sluice.manifest.model import load_manifest

    spec = _spec(tmp_path, families["gpt2"], TEXTS + stdlib_texts(10), "auto")
    res = sluice_main("manifest", "freeze", spec, "-o", tmp_path / "m.json", "--no-progress", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tokenizer_backend"] == "fastokens"
    assert "tokenizer backend auto: fastokens (the fastest proven: same ids as tokenizers on 16 sampled" in out["notes"][0]
    assert load_manifest(tmp_path / "m.json").tokenizer.backend == "fastokens"


def test_auto_on_the_sentencepiece_family_records_hf_saying_why(families, tmp_path, sluice_main):
    from sluice.manifest.model import load_manifest

    spec = _spec(tmp_path, families["spm"], TEXTS + stdlib_texts(5), "auto")
    res = sluice_main("manifest", "freeze", spec, "-o", tmp_path / "m.json", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert load_manifest(tmp_path / "m.json").tokenizer.backend == "hf"
    assert "auto: fastokens refused" in res.stderr and "Metaspace" in res.stderr
    assert "auto: tokie refused" in res.stderr and "auto: hf (no faster backend" in res.stderr


@pytest.mark.parametrize("backend, reason", [
    ("tokie", "tokie gives other ids than tokenizers with a Metaspace pre-tokenizer"),
    ("fastokens", "unsupported pre-tokenizer type: Metaspace"),
])
def test_freeze_refuses_a_family_the_backend_cannot_reproduce(families, tmp_path, sluice_main, backend, reason):
    spec = _spec(tmp_path, families["spm"], TEXTS, backend)
    res = sluice_main("manifest", "freeze", spec, "-o", tmp_path / "m.json", "--no-progress")
    assert res.returncode == 2 and reason in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "m.json").exists()


def test_freeze_refuses_a_backend_whose_ids_differ_on_the_sample(tmp_path, sluice_main):
    """Representable by tiktoken, yet other ids for ' abc' (test_tokenize_fast._whole_piece_tokenizer):
    freeze used to record it; now the sample check refuses it naming the document and token."""
    pytest.importorskip("tiktoken")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"ab": 256, "bc": 257, "abc": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c"), ("a", "bc")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "whole.json"))
    (tmp_path / "d").mkdir()
    spec = _spec(tmp_path / "d", tmp_path / "whole.json", ["xyz", "the abc song", "ab bc"], "tiktoken")
    res = sluice_main("manifest", "freeze", spec, "-o", tmp_path / "m.json", "--no-progress")
    assert res.returncode == 2, res.stderr
    assert "tokenizer_backend 'tiktoken' gives other ids than tokenizers on 1 of 3 sampled documents" in res.stderr
    assert "source 'docs' object d/docs.jsonl record 1: token 4: hf [256, 66, 220" in res.stderr
    assert not (tmp_path / "m.json").exists()


def test_daemon_falls_back_to_tokenizers_where_the_backend_is_missing(families, tmp_path, monkeypatch, caplog):
    """A manifest recording fastokens on a node without it: tokenizers encodes the same ids, tokens are
    keyed under "hf", and the daemon says so once in its log and in a metric."""
    from sluice.loaderd.metrics import Metrics
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard
    from sluice.runspec import RunSpec
    from sluice.tokenize.tokcache import fill_tokens

    texts = TEXTS + stdlib_texts(5)
    manifest = load_manifest(text_manifest(tmp_path, families["gpt2"], texts, backend="fastokens"))
    spec = RunSpec(run_id="r1", seed=1, lanes=1, global_batch=2, micro_batch=2)
    caplog.set_level(logging.WARNING, logger="sluice.loaderd")
    installed = Metrics("run", manifest.dataset_id, ["docs"], [1.0])
    with open_data_path(manifest, spec, DataPathConfig(cache_dir=str(tmp_path / "c0"), cache_budget=1 << 26),
                        metrics=installed) as data:  # installed: the daemon's path encodes with fastokens
        assert data.docs.encoder.backend == "fastokens" and data.docs.encoder.encoder().backend == "fastokens"
    assert not caplog.records
    labels = {"run_id": "run", "dataset_id": manifest.dataset_id, "recorded": "fastokens", "serving": "hf"}
    assert installed.registry.get_sample_value("sluice_tokenizer_backend_fallback", labels) is None

    monkeypatch.setitem(sys.modules, "fastokens", None)  # `import fastokens` raises ImportError: not installed
    metrics = Metrics("run", manifest.dataset_id, ["docs"], [1.0])
    with open_data_path(manifest, spec, DataPathConfig(cache_dir=str(tmp_path / "cache"), cache_budget=1 << 26),
                        metrics=metrics) as data:
        enc = data.docs.encoder
        assert (enc.identity.recorded, enc.backend) == ("fastokens", "hf")
        got = fill_tokens(data.cache, manifest, 0, 0, enc)
        shard = open_shard(got.pin.path)
        want = load_tokenizer(families["gpt2"]).encode_batch(texts)
        assert all(np.array_equal(shard.doc(i), w) for i, w in enumerate(want))
        got.pin.close()
    said = [r.getMessage() for r in caplog.records if "not installed here" in r.getMessage()]
    assert len(said) == 1 and "'fastokens'" in said[0] and "'hf'" in said[0]
    assert metrics.registry.get_sample_value("sluice_tokenizer_backend_fallback", labels) == 1


@pytest.mark.slow  # two fresh interpreters
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="fastokens caps its pool at the CPUs available")
def test_fastokens_threads_stay_within_the_budget(families, tmp_path):
    """configure_threads(1): fastokens starts no thread; (2): its pool is 2 (one worker besides the
    caller), and cannot be resized afterwards, like tokenizers' pool."""
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from support import stdlib_texts
from sluice.tokenize.encoder import load_tokenizer
from sluice.tokenize.threads import configure_threads
from sluice.errors import TokenizerError
def workers():
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith("fastokens") for n in names)
configure_threads(int(sys.argv[1]))
enc = load_tokenizer({str(families['gpt2'])!r}, backend="fastokens")
enc.encode_batch(stdlib_texts(60) * 4)
print(workers())
try:
    configure_threads(3)
    print("resized")
except TokenizerError as exc:
    print("refused" if "cannot be resized" in str(exc) else exc)
"""
    out = [subprocess.run([sys.executable, "-c", code, n], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FASTOKENS_BPE_THREADS": "8"}) for n in ("1", "2")]
    assert [o.returncode for o in out] == [0, 0], [o.stderr for o in out]
    assert out[0].stdout.split() == ["0", "refused"]
    assert out[1].stdout.split() == ["1", "refused"]


@pytest.mark.slow  # worker processes
def test_pretokenize_and_cache_warm_use_the_recorded_backend(families, tmp_path, sluice_main):
    """Both offline paths load the manifest's backend (their outputs are keyed and named by it) and make
    the token arrays tokenizers makes."""
    from sluice.cache import NodeCache
    from sluice.manifest.model import load_manifest
    from sluice.manifest.token_shard import open_shard
    from sluice.tokenize import encoder_for_manifest
    from sluice.tokenize.pretokenize import pretokenize
    from sluice.tokenize.tokcache import lookup_tokens

    texts = TEXTS + stdlib_texts(8)
    (tmp_path / "raw").mkdir()
    manifest = load_manifest(text_manifest(tmp_path / "raw", families["gpt2"], texts, backend="fastokens"))
    want = load_tokenizer(families["gpt2"]).encode_batch(texts)

    result = pretokenize(manifest, tmp_path / "out", workers=1, progress=False)
    derived = load_manifest(tmp_path / "out" / "manifest.json")
    assert derived.tokenizer.backend == "fastokens" and result.manifest.dataset_id == derived.dataset_id
    shard = open_shard(derived.resolve(derived.sources[0].objects[0].location))
    assert [shard.doc(i).tolist() for i in range(len(texts))] == [w.tolist() for w in want]

    res = sluice_main("cache", "warm", tmp_path / "raw" / "manifest.json", tmp_path / "cache", "--budget", "64M",
                      "--tokens", "--token-workers", "1", "--json")
    assert res.returncode == 0, res.stderr
    enc = encoder_for_manifest(manifest)
    assert enc.backend == "fastokens"
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        pin = lookup_tokens(cache, manifest, 0, 0, enc)  # keyed by backend: a hf fill would not be found
        assert pin is not None
        cached = open_shard(pin.path)
        assert [cached.doc(i).tolist() for i in range(len(texts))] == [w.tolist() for w in want]
        pin.close()


def test_freeze_sample_is_bounded_in_characters_too(families, tmp_path):
    """Freeze's check encodes its sample with tokenizers as well: long documents stop it by characters
    (at least one document per object), so a corpus of large files does not make freeze slow."""
    from sluice.manifest.model import load_manifest
    from sluice.tokenize.check import LocalObjects, check_backend

    texts = ["x" * 999 + "\n" for _ in range(10)]
    manifest = load_manifest(text_manifest(tmp_path, families["gpt2"], texts))
    got = [check_backend(manifest, "fastokens", cache=LocalObjects(), sample=100, sample_chars=chars).documents
           for chars in (2500, 10, None)]
    assert got == [2, 1, 10]


@pytest.mark.parametrize("mode", ["literal", "special"])
def test_added_tokens_plain_and_special(families, tmp_path, mode):
    """Added tokens that are not special (tokenizers splits them out of the text in both modes, one with
    lstrip) and a special added after training: fastokens gives the same ids; tokie, which does not know
    the late special token, is refused naming it."""
    from tokenizers import AddedToken

    tok = Tokenizer.from_file(str(families["gpt2"]))
    tok.add_tokens(["zzz", AddedToken(" def", lstrip=True), AddedToken("<|mask|>", special=True)])
    tok.save(str(tmp_path / "added.json"))
    texts = ["a zzz b", "zzzzzz", "x  def f(): <|mask|> <|endoftext|>", "def def  def", "<|mask|>"]
    want = load_tokenizer(tmp_path / "added.json", specials_in_text=mode).encode_batch(texts)
    got = load_tokenizer(tmp_path / "added.json", backend="fastokens", specials_in_text=mode).encode_batch(texts)
    assert _same(want, got)
    with pytest.raises(TokenizerError, match=r"tokie gives special tokens other ids \('<\|mask\|>': tokenizers 1026"):
        load_tokenizer(tmp_path / "added.json", backend="tokie", specials_in_text=mode)
