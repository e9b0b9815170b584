"""The tiktoken backend: same ids as tokenizers, refused (naming why) where it cannot be, part of the identity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from support import examples, stdlib_texts, text_manifest
from sluice.errors import ManifestError, TokenizerError
from sluice.manifest.policies import TokenizerRef
from sluice.tokenize import load_tokenizer

pytest.importorskip("tiktoken")

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "",
    "héllo wörld — ünïcode ✓ 中文 🙂",
    "   leading spaces and trailing   \n\n\t\r\n",
    "text that names <|endoftext|> and <|pad|><|bos|> literally",
    "it's we'll they've I'd 12345 3.14 x==y",
]


@pytest.fixture(scope="module")
def pair(tokenizer_file):
    return load_tokenizer(tokenizer_file), load_tokenizer(tokenizer_file, backend="tiktoken")


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype == np.uint32 and np.array_equal(x, y) for x, y in zip(a, b))


def test_tiktoken_gives_the_ids_of_tokenizers_on_real_text(pair):
    hf, tt = pair
    texts = TEXTS + stdlib_texts(40)
    assert tt.backend == "tiktoken" and hf.backend == "hf"
    assert (tt.digest, tt.vocab_size) == (hf.digest, hf.vocab_size)
    assert _same(hf.encode_batch(texts), tt.encode_batch(texts))


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60), min_size=1, max_size=8))
def test_tiktoken_equals_tokenizers_on_any_text(pair, texts):
    hf, tt = pair
    assert _same(hf.encode_batch(texts), tt.encode_batch(texts))


@pytest.mark.parametrize("literal", [True, False])
def test_every_batch_split_gives_tiktokens_own_ids_in_order(tokenizer_file, literal):
    """Serial or sliced over a pool, ids from tiktoken's buffer or its list (a lone surrogate, which
    the buffer call refuses), each text gets exactly what tiktoken's plain call gives, in order."""
    from sluice.tokenize.fast import TiktokenCodec, build_encoding

    enc = build_encoding(json.loads(Path(tokenizer_file).read_text()), "t")
    texts = TEXTS + stdlib_texts(40) + ["a lone \ud800 surrogate <|endoftext|>", "x"]
    codec = TiktokenCodec(enc, literal=literal)
    one = enc.encode_ordinary if literal else (lambda t: enc.encode(t, allowed_special="all"))
    want = [np.array(one(t), dtype=np.uint32) for t in texts]
    for threads in (1, 2, 3):
        for cut in (texts, texts[:3], texts[:1]):
            assert _same(codec.encode_batch(cut, threads), want[:len(cut)])


def test_special_token_text_is_matched_only_in_special_mode(tokenizer_file):
    text = ["a <|endoftext|> b"]
    for mode in ("literal", "special"):
        hf = load_tokenizer(tokenizer_file, specials_in_text=mode)
        tt = load_tokenizer(tokenizer_file, specials_in_text=mode, backend="tiktoken")
        assert _same(hf.encode_batch(text), tt.encode_batch(text))
        assert (0 in tt.encode_batch(text)[0]) == (mode == "special")


def _edited(tokenizer_file: Path, tmp_path: Path, edit) -> Path:
    obj = json.loads(tokenizer_file.read_text())
    edit(obj)
    path = tmp_path / f"tok-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize("edit, reason", [
    (lambda o: o.__setitem__("normalizer", {"type": "NFC"}), "cannot apply a normalizer (NFC)"),
    (lambda o: o.__setitem__("pre_tokenizer", {"type": "Whitespace"}), "cannot represent this pre-tokenizer"),
    (lambda o: o["pre_tokenizer"].__setitem__("add_prefix_space", True), "cannot represent this pre-tokenizer"),
    (lambda o: o["added_tokens"].append({"id": 1023, "content": "zzz", "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": False}),
     "cannot match added tokens that are not special ('zzz')"),
    (lambda o: o["model"]["merges"].reverse(), "tiktoken ranks merges by id"),
    (lambda o: o["model"].__setitem__("dropout", 0.1), "BPE dropout=0.1"),
])
def test_unrepresentable_tokenizers_are_refused_naming_why(tokenizer_file, tmp_path, edit, reason):
    path = _edited(tokenizer_file, tmp_path, edit)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(path, backend="tiktoken")
    assert reason in str(info.value) and str(path) in str(info.value)


def test_merges_written_as_strings_build_the_same_encoding(tokenizer_file, tmp_path, pair):
    # tokenizers < 0.20 wrote each merge as "left right"; both spellings build one encoding
    path = _edited(tokenizer_file, tmp_path, lambda o: o["model"].__setitem__(
        "merges", [" ".join(m) for m in o["model"]["merges"]]))
    legacy = load_tokenizer(path, backend="tiktoken")
    texts = TEXTS + stdlib_texts(10)
    assert _same(pair[1].encode_batch(texts), legacy.encode_batch(texts))


@pytest.mark.parametrize("edit, reason", [
    (lambda o: o["model"]["merges"].__setitem__(3, ["a", "b", "c"]), "merge 3 ['a', 'b', 'c'] is not a pair"),
    (lambda o: o["model"]["merges"].__setitem__(3, [o["model"]["merges"][3][0], "a b"]), "merge 3 "),
    (lambda o: o["model"]["vocab"].__setitem__("a b", 5000), "vocabulary entry 'a b' is not byte-level"),
])
def test_each_faulty_merge_or_entry_is_named(tokenizer_file, edit, reason):
    # build_encoding itself: tokenizers refuses some of these files before it is reached
    from sluice.tokenize.fast import build_encoding

    obj = json.loads(tokenizer_file.read_text())
    edit(obj)
    with pytest.raises(TokenizerError, match="^here: " + reason.replace("[", r"\[").replace("]", r"\]")):
        build_encoding(obj, "here")


def test_special_ids_that_tokenizers_renumbers_are_refused(tokenizer_file, tmp_path):
    # tokenizers gives an added token with an out-of-line id the next free id; tiktoken would keep the file's
    size = load_tokenizer(tokenizer_file).vocab_size
    path = _edited(tokenizer_file, tmp_path, lambda o: o["added_tokens"].append(
        {"id": size + 7, "content": "<|far|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}))
    with pytest.raises(TokenizerError, match=rf"other ids than the file records \('<\|far\|>'={size}, "):
        load_tokenizer(path, backend="tiktoken")


def test_a_model_other_than_bpe_is_refused(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "wl.json"))
    with pytest.raises(TokenizerError, match="needs a BPE model, this one is 'WordLevel'"):
        load_tokenizer(tmp_path / "wl.json", backend="tiktoken")


def _whole_piece_tokenizer(path: Path) -> Path:
    """Representable, yet not equal: 'abc' is a token (merge a + bc) that tokenizers never reaches from
    'abc' (a + b merges first, and ab + c is no merge), while tiktoken merges any adjacent pair whose
    concatenation is a token (ab + c)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"ab": 256, "bc": 257, "abc": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c"), ("a", "bc")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return path


def _manifest(folder: Path, tokenizer: Path, texts: list[str], backend: str = "hf") -> Path:
    return text_manifest(folder, tokenizer, texts, backend=backend)


def test_backend_is_part_of_the_identity_and_hf_keeps_old_bytes(tokenizer_file, tmp_path):
    from sluice.manifest.model import load_manifest

    (tmp_path / "hf").mkdir()
    (tmp_path / "tt").mkdir()
    hf = load_manifest(_manifest(tmp_path / "hf", tokenizer_file, TEXTS))
    tt = load_manifest(_manifest(tmp_path / "tt", tokenizer_file, TEXTS, backend="tiktoken"))
    assert b'"backend"' not in hf.canonical_bytes()  # manifests from before the field keep their ID
    assert tt.tokenizer.backend == "tiktoken" and hf.tokenizer.backend == "hf"
    assert tt.dataset_id != hf.dataset_id
    bad = json.loads(tt.canonical_bytes())
    for value in ("hf", "fast"):
        bad["tokenizer"]["backend"] = value
        with pytest.raises(ManifestError, match=r"tokenizer.backend: '(hf|fast)' is not one of tiktoken"):
            TokenizerRef.from_obj(bad["tokenizer"], "manifest tokenizer")


def test_tokenize_check_proves_equal_ids_and_names_a_difference(tokenizer_file, tmp_path, sluice_main):
    (tmp_path / "ok").mkdir()
    ok = _manifest(tmp_path / "ok", tokenizer_file, TEXTS + stdlib_texts(5))
    res = sluice_main("tokenize", "check", ok, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["equal"], out["backend"], out["documents"], out["mismatched"]) == (True, "tiktoken", 11, 0)
    res = sluice_main("tokenize", "check", ok, "--sample", "3")
    assert res.returncode == 0 and "SAME ids: tiktoken vs hf on 3 documents (first 3 documents of each" in res.stdout

    (tmp_path / "bad").mkdir()
    tok = _whole_piece_tokenizer(tmp_path / "whole.json")
    bad = _manifest(tmp_path / "bad", tok, ["xyz", "the abc song", "ab bc"])
    res = sluice_main("tokenize", "check", bad)
    assert res.returncode == 1, res.stderr
    assert "DIFFERENT ids" in res.stdout and "1 documents differ" in res.stdout
    assert "object docs.jsonl record 1: token 4: hf [256, 66, 220" in res.stdout  # " abc": Ġ a b c ...
    assert "vs tiktoken [258, 220" in res.stdout

    (tmp_path / "norm").mkdir()
    norm = _edited(tokenizer_file, tmp_path, lambda o: o.__setitem__("normalizer", {"type": "NFC"}))
    res = sluice_main("tokenize", "check", _manifest(tmp_path / "norm", norm, TEXTS))
    assert res.returncode == 2 and res.stderr.startswith("sluice: error:") and "normalizer" in res.stderr
    assert "Traceback" not in res.stderr


def test_freeze_records_the_backend_and_the_daemon_path_uses_it(tokenizer_file, tmp_path, sluice_main):
    from sluice.cache import NodeCache
    from sluice.manifest.model import load_manifest
    from sluice.tokenize import encoder_for_manifest
    from sluice.tokenize.tokcache import fill_tokens, token_key

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (tmp_path / "dataset.toml").write_text(
        'name = "fast"\ntokenizer = "tokenizer.json"\ntokenizer_backend = "tiktoken"\n'
        '[packing]\nseq_len = 32\neos = "<|endoftext|>"\n'
        '[[sources]]\nname = "docs"\npaths = ["docs.jsonl"]\nformat = "jsonl"\nweight = "1"\n')
    res = sluice_main("manifest", "freeze", tmp_path / "dataset.toml", "-o", tmp_path / "manifest.json", "--no-progress")
    assert res.returncode == 0, res.stderr
    manifest = load_manifest(tmp_path / "manifest.json")
    assert manifest.tokenizer.backend == "tiktoken"
    enc = encoder_for_manifest(manifest)
    assert enc.backend == "tiktoken"
    assert token_key(manifest, 0, 0, enc)["backend"] == "tiktoken"  # cached tokens are keyed by backend
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        got = fill_tokens(cache, manifest, 0, 0, enc)
        from sluice.manifest.token_shard import open_shard

        shard = open_shard(got.pin.path)
        want = load_tokenizer(tokenizer_file).encode_batch(TEXTS)
        assert all(np.array_equal(shard.doc(i), w) for i, w in enumerate(want))
        got.pin.close()
    # a spec asking for the backend with a tokenizer it cannot represent fails at freeze, naming why
    norm = _edited(tokenizer_file, tmp_path / "cache", lambda o: o.__setitem__("normalizer", {"type": "NFC"}))
    (tmp_path / "tokenizer.json").write_bytes(norm.read_bytes())
    res = sluice_main("manifest", "freeze", tmp_path / "dataset.toml", "-o", tmp_path / "m2.json", "--no-progress")
    assert res.returncode == 2 and "cannot apply a normalizer" in res.stderr and "Traceback" not in res.stderr

