"""The tiktoken backend's built encoding kept in the node cache: read at the next start, same ids, refused if malformed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from support import stdlib_texts, text_manifest
from sluice.errors import TokenizerError
from sluice.manifest.model import Manifest
from sluice.tokenize import encoder_for_manifest, load_tokenizer

pytest.importorskip("tiktoken")

from sluice.tokenize.fastcache import CachedEncoder, encoding_key, read_encoding, write_encoding  # noqa: E402

TEXTS = ["def f(x):\n    return x + 1\n", "", "héllo wörld ✓ 中文 🙂", "names <|endoftext|> literally", "   \n\t"]


def _manifest(folder: Path, tokenizer_file: Path, texts: tuple[str, ...] = ("a",)) -> Manifest:
    from sluice.manifest.model import load_manifest

    return load_manifest(text_manifest(folder, tokenizer_file, list(texts), backend="tiktoken", exhaustion="repeat"))


def test_the_second_start_reads_the_cached_encoding_and_gives_the_same_ids(tokenizer_file, tmp_path):
    from sluice.cache import NodeCache

    manifest = _manifest(tmp_path, tokenizer_file)
    hf = load_tokenizer(tokenizer_file)
    texts = TEXTS + stdlib_texts(30)
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        built = encoder_for_manifest(manifest, cache=cache)
        assert type(built) is not CachedEncoder  # a miss builds from tokenizer.json, then keeps the encoding
        pin = cache.get_derived(encoding_key(built.digest))
        assert pin is not None
        pin.close()
        again = encoder_for_manifest(manifest, cache=cache)
    assert isinstance(again, CachedEncoder) and again.backend == "tiktoken"
    assert again._tok is None  # tokenizers has not parsed the file
    want = hf.encode_batch(texts)
    for enc in (built, again):
        got = enc.encode_batch(texts)
        assert all(a.dtype == np.uint32 and np.array_equal(a, b) for a, b in zip(got, want))
        assert (enc.digest, enc.version, enc.vocab_size, enc.special_tokens, enc.specials_in_text) == (
            hf.digest, hf.version, hf.vocab_size, hf.special_tokens, hf.specials_in_text)
    # what only tokenizers answers parses the file on first need
    assert again.token_to_id("<|bos|>") == 2 and again.decode(want[0]) == texts[0]
    assert again._tok is not None


def test_a_changed_tokenizer_file_is_refused_before_the_cache_is_asked(tokenizer_file, tmp_path):
    from sluice.cache import NodeCache

    manifest = _manifest(tmp_path, tokenizer_file)
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        encoder_for_manifest(manifest, cache=cache)
        (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes() + b" ")
        with pytest.raises(TokenizerError, match="differs from the manifest's"):
            encoder_for_manifest(manifest, cache=cache)


def _written(tokenizer_file: Path, tmp_path: Path) -> tuple[Path, str]:
    enc = load_tokenizer(tokenizer_file, backend="tiktoken")
    path = tmp_path / "enc.bin"
    write_encoding(path, enc)
    return path, enc.digest


def _edit_header(data: bytes, edit) -> bytes:
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12 : 12 + hlen])
    edit(header)
    body = json.dumps(header).encode()
    head = data[:8] + struct.pack("<I", len(body)) + body
    head += b"\0" * (-len(head) % 8)
    return head + data[12 + hlen + (-(12 + hlen) % 8):]


@pytest.mark.parametrize("damage, reason", [
    (lambda d: b"NOTMAGIC" + d[8:], "bad magic"),
    (lambda d: d[:-1], "do not fill the file"),
    (lambda d: d + b"x", "do not fill the file"),
    (lambda d: d[:12] + b"[" + d[13:], "header is not JSON"),
    (lambda d: _edit_header(d, lambda h: h.__setitem__("format", "other/9")), "made for other/9"),
    (lambda d: _edit_header(d, lambda h: h.pop("pattern")), "header fields are not"),
    (lambda d: _edit_header(d, lambda h: h.__setitem__("vocab_size", "1024")), "header fields are not"),
    (lambda d: _edit_header(d, lambda h: h.__setitem__("specials", [["<|x|>", -1]])), "specials is not a list"),
])
def test_a_malformed_cached_encoding_is_refused_naming_the_file(tokenizer_file, tmp_path, damage, reason):
    path, digest = _written(tokenizer_file, tmp_path)
    header, ranks = read_encoding(path, digest)
    assert header["n"] == len(ranks) and header["tokenizer"] == digest
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TokenizerError, match=reason) as info:
        read_encoding(path, digest)
    assert str(path) in str(info.value)


def test_an_encoding_of_another_tokenizer_is_refused(tokenizer_file, tmp_path):
    path, _ = _written(tokenizer_file, tmp_path)
    with pytest.raises(TokenizerError, match="not sluice-tiktoken/1 / b3:0000"):
        read_encoding(path, "b3:" + "0" * 64)


def test_a_cached_object_that_does_not_parse_is_rebuilt_from_the_file(tokenizer_file, tmp_path, caplog):
    from sluice.cache import NodeCache

    manifest = _manifest(tmp_path, tokenizer_file)
    with NodeCache(tmp_path / "cache", 1 << 26) as cache:
        digest = load_tokenizer(tokenizer_file).digest
        cache.put_derived(encoding_key(digest), lambda tmp: tmp.write_bytes(b"not an encoding")).close()
        enc = encoder_for_manifest(manifest, cache=cache)
    assert type(enc) is not CachedEncoder and enc.backend == "tiktoken"
    assert "(bad magic); building the encoding from" in caplog.text
    assert all(np.array_equal(a, b) for a, b in zip(enc.encode_batch(TEXTS), load_tokenizer(tokenizer_file)
                                                     .encode_batch(TEXTS)))


def test_plan_with_the_cached_encoding_equals_plan_that_built_it(tokenizer_file, tmp_path, sluice_cli):
    from sluice.cache import NodeCache

    manifest = _manifest(tmp_path, tokenizer_file, tuple(TEXTS + stdlib_texts(20)))
    (tmp_path / "run.toml").write_text('run_id = "r"\nseed = 7\nlanes = 2\nglobal_batch = 2\nmicro_batch = 2\n')

    def plan(cache: Path) -> str:
        res = sluice_cli("plan", tmp_path / "manifest.json", tmp_path / "run.toml", "--steps", "0:6", "--json",
                         "--cache", cache)
        assert res.returncode == 0, res.stderr
        return res.stdout

    built = plan(tmp_path / "a")  # builds the encoding from tokenizer.json and keeps it
    key = encoding_key(manifest.tokenizer.digest)
    with NodeCache(tmp_path / "a", 1 << 26) as a, NodeCache(tmp_path / "b", 1 << 26) as b:
        pin = a.get_derived(key)
        assert pin is not None
        # a node cache holding the encoding but no tokens: the next plan must encode, with the cached encoding
        b.put_derived(key, lambda tmp: tmp.write_bytes(Path(pin.path).read_bytes())).close()
        pin.close()
    assert plan(tmp_path / "b") == built and len(built.splitlines()) == 6


def test_a_cache_that_cannot_keep_the_encoding_still_gives_the_built_encoder(tokenizer_file, tmp_path, caplog):
    from sluice.cache import NodeCache

    manifest = _manifest(tmp_path, tokenizer_file)
    with NodeCache(tmp_path / "cache", 4096) as cache:  # far below the encoding's size
        enc = encoder_for_manifest(manifest, cache=cache)
        assert cache.get_derived(encoding_key(enc.digest)) is None
    assert enc.backend == "tiktoken" and type(enc) is not CachedEncoder
    assert "is not kept in the node cache" in caplog.text
