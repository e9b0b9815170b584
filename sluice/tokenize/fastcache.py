"""The tiktoken backend's built encoding as a derived node-cache object: a daemon start reads it, never builds it.

Building the encoding from tokenizer.json (parse the JSON, parse it again with
`tokenizers` for the vocabulary size and special-token ids, map 32k byte-level
tokens to bytes, check the merges) is paid at every daemon start on the fly.
Its result depends only on the file's bytes, so it is a derived object of the
node cache like cached tokens (docs/tokenize.md, "Tokens in the node cache"),
keyed by BLAKE3 of::

    {"kind": "sluice.derived/1", "tokenizer": <tokenizer digest>, "backend": "tiktoken",
     "transform": "sluice-tiktoken/1"}

written once from a full, checked build (`load_tokenizer`: every refusal of
sluice.tokenize.fast applies first), its BLAKE3 recorded and checked on
verify-on-read like any fill, counted in the budget, evictable. A flat binary
file, never unpickled::

    b"SLTIKT1\\0"  u32 LE header length  header JSON (UTF-8)  zero pad to 8
    ranks: n x u32 LE    ends: n x u32 LE (end offset of token i in blob)    blob

header: {"format", "tokenizer", "pattern", "specials": [[content, id], ...]
(tiktoken's special tokens), "vocab_size", "version", "n", "blob_bytes"}. A file
that does not parse to exactly that shape is refused (TokenizerError naming it)
and the caller builds from tokenizer.json instead.

The `Encoder` made from it encodes with tiktoken at once and parses the file
with `tokenizers` only if asked for what only `tokenizers` answers (`tokenizer`,
`token_to_id`, `decode`), re-checking the file's digest then.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from sluice.errors import CacheError, TokenizerError
from sluice.flatfile import read_flat, write_flat
from sluice.tokenize.encoder import Encoder, SpecialToken, parse_tokenizer_json, read_tokenizer_checked

log = logging.getLogger("sluice.tokenize")

FORMAT = "sluice-tiktoken/1"
MAGIC = b"SLTIKT1\0"
_MAX_HEADER = 1 << 24  # a header names the special tokens and the regex: far below this


def encoding_key(tokenizer_digest: str) -> dict[str, str]:
    """The derived-object key inputs of the tiktoken encoding built from the tokenizer file of that digest."""
    return {"tokenizer": tokenizer_digest, "backend": "tiktoken", "transform": FORMAT}


def write_encoding(path: Path, encoder: Encoder) -> None:
    """Write `encoder`'s (a full tiktoken-backend build) encoding, vocabulary size and special ids to `path`."""
    enc = encoder._fast._enc
    # In the dict's own order (the vocabulary's): the reader rebuilds a dict, so no sort (this runs
    # on a cold start's path: 5 ms here, 25 ms with a sort and per-item generators).
    tokens = list(enc._mergeable_ranks)
    blob = b"".join(tokens)
    ranks = np.array(list(enc._mergeable_ranks.values()), dtype="<u4")
    ends = np.cumsum(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))).astype("<u4")
    header = {
        "format": FORMAT, "tokenizer": encoder.digest, "pattern": enc._pat_str,
        "specials": sorted([c, int(i)] for c, i in enc._special_tokens.items()),
        "hf_specials": [[s.content, s.id] for s in encoder.special_tokens],
        "vocab_size": encoder.vocab_size, "version": encoder.version, "n": len(tokens), "blob_bytes": len(blob),
    }
    write_flat(path, MAGIC, header, (ranks.tobytes(), ends.tobytes(), blob))


def read_encoding(path: str | Path, digest: str) -> tuple[dict[str, Any], dict[bytes, int]]:
    """(header, mergeable ranks) from a file `write_encoding` wrote for tokenizer `digest`; else TokenizerError."""
    where = f"cached tiktoken encoding {path}"
    data = Path(path).read_bytes()
    shape = {"format": str, "tokenizer": str, "pattern": str, "specials": list, "hf_specials": list,
             "vocab_size": int, "version": str, "n": int, "blob_bytes": int}
    header, at = read_flat(data, MAGIC, shape, where=where, fmt=FORMAT, max_header=_MAX_HEADER, error=TokenizerError)
    if header["format"] != FORMAT or header["tokenizer"] != digest:
        raise TokenizerError(f"{where}: made for {header['format']} / {header['tokenizer']}, not {FORMAT} / {digest}")
    for name in ("specials", "hf_specials"):
        if not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is str and type(p[1]) is int
                   and 0 <= p[1] < 1 << 31 for p in header[name]):
            raise TokenizerError(f"{where}: {name} is not a list of [content, id] pairs")
    n, blob_bytes = header["n"], header["blob_bytes"]
    if n < 256 or blob_bytes < n or at + 8 * n + blob_bytes != len(data):
        raise TokenizerError(f"{where}: {n} tokens in {blob_bytes} bytes do not fill the file's {len(data)} bytes")
    ranks = np.frombuffer(data, dtype="<u4", count=n, offset=at)
    ends = np.frombuffer(data, dtype="<u4", count=n, offset=at + 4 * n).astype(np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    if int(ends[-1]) != blob_bytes or bool(np.any(ends <= starts)) or int(ranks.max()) >= 1 << 31:
        raise TokenizerError(f"{where}: token offsets are not increasing to {blob_bytes}, or a rank is out of range")
    blob = data[at + 8 * n :]
    table = {blob[a:b]: r for a, b, r in zip(starts.tolist(), ends.tolist(), ranks.tolist())}
    if len(table) != n:
        raise TokenizerError(f"{where}: {n - len(table)} tokens repeat")
    return header, table


class CachedEncoder(Encoder):
    """An `Encoder` from a cached encoding: tiktoken encodes; `tokenizers` parses the file on first need only."""

    __slots__ = ("_load_lock",)

    def __init__(self, header: dict[str, Any], ranks: dict[bytes, int], *, path: str,
                 specials_in_text: str) -> None:
        # Encoder.__init__ is not called: it asks a parsed `tokenizers` instance for what the header holds.
        import tiktoken

        from sluice.tokenize.fast import TiktokenCodec

        try:
            enc = tiktoken.Encoding(f"sluice-tokenizer {path}", pat_str=header["pattern"], mergeable_ranks=ranks,
                                    special_tokens={c: i for c, i in header["specials"]})
        except Exception as exc:  # tiktoken raises ValueError (bad regex, clashing ids)
            raise TokenizerError(f"cached tiktoken encoding for {path}: tiktoken refuses it ({exc})") from exc
        self._fast = TiktokenCodec(enc, literal=specials_in_text == "literal")
        self._tok = None
        self._path = path
        self._digest = header["tokenizer"]
        self._version = header["version"]
        self._vocab_size = header["vocab_size"]
        self._specials = tuple(SpecialToken(c, i) for c, i in header["hf_specials"])
        self._specials_in_text = specials_in_text
        self._encode = self._encode_literal = None
        self._screen = ()
        self._load_lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` of the same file, parsed now if not yet (its digest checked again)."""
        with self._load_lock:
            if self._tok is None:
                data, _ = read_tokenizer_checked(Path(self._path), self._digest)
                tok, _obj = parse_tokenizer_json(data, f"tokenizer {self._path}")
                tok.no_padding()
                tok.no_truncation()
                self._tok = tok
            return self._tok

    def token_to_id(self, token: str) -> int:
        self.tokenizer  # noqa: B018 (loads it)
        return super().token_to_id(token)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        self.tokenizer  # noqa: B018
        return super().decode(ids)


def cached_encoder(cache: Any, path: str, digest: str, specials_in_text: str, build: Any) -> Encoder:
    """The tiktoken-backend `Encoder` of tokenizer `path` (already digest-checked), from the node cache.

    On a hit, read the cached encoding; on a miss or a cached file that does not
    parse, `build()` (the full `load_tokenizer`) and keep its encoding in the
    cache for the next start. A cache that cannot keep it (budget, disk) is no
    error: the built encoder is returned.
    """
    key = encoding_key(digest)
    pin = cache.get_derived(key)
    if pin is not None:
        try:
            header, ranks = read_encoding(pin.path, digest)
            return CachedEncoder(header, ranks, path=path, specials_in_text=specials_in_text)
        except (TokenizerError, OSError) as exc:  # made by other code, or unreadable: build from the file
            log.warning("%s; building the encoding from %s instead", exc, path)
        finally:
            pin.close()
    encoder = build()
    try:
        cache.put_derived(key, lambda tmp: write_encoding(tmp, encoder)).close()
    except (CacheError, OSError) as exc:  # optional: the next start builds it again
        log.warning("the built tiktoken encoding of %s is not kept in the node cache (%s)", path, exc)
    return encoder
