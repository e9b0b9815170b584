"""The `tiktoken` backend: the same byte-level BPE, encoded by tiktoken's faster core.

A tokenizer backend is part of the tokenizer identity (`TokenizerRef.backend`
in the manifest, `"hf"` when absent): `hf` encodes with `tokenizers`,
`tiktoken` with a `tiktoken.Encoding` built from the *same* tokenizer.json:

* ranks: every vocabulary entry, mapped from GPT-2's byte-to-unicode alphabet
  back to its bytes, with its id as its rank (tiktoken returns ranks as ids);
* the pre-tokenizer regex: `ByteLevel(use_regex=true)`'s GPT-2 pattern, or the
  pattern of a `Split(Regex, Isolated)` followed by `ByteLevel(use_regex=false)`;
* special tokens: the added tokens marked special. Special-token text inside
  a document is ordinary text (`specials_in_text="literal"`, the default:
  `encode_ordinary`), or matched as the token (`"special"`).

tiktoken merges, within one regex piece, the adjacent pair whose concatenation
has the lowest rank, and takes a piece that is itself a token whole; `tokenizers`
applies the merges list in order. They agree when the merge order is the id
order and every multi-byte token is a merge result, which `build_encoding`
checks, and else refuses naming why. Remaining corner cases (a whole-piece token
that the merges would not reach) are what `sluice tokenize check` is for: it
proves equal ids on a manifest's documents before a manifest records this backend.

Refused, with the reason (TokenizerError): a normalizer; any other pre-tokenizer
(Metaspace, Whitespace, a Split with another behaviour or inverted, a prefix
space); a model other than BPE, or BPE with dropout, byte fallback, a subword
prefix or word suffix; a vocabulary without all 256 bytes; added tokens that are
not special (tiktoken cannot split them out of the text as tokenizers does).
"""

from __future__ import annotations

import codecs
import json
import operator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sluice.errors import TokenizerError
from sluice.tokenize.encoder import ids_array

BACKENDS = ("hf", "tiktoken", "fastokens", "tokie")  # fastokens, tokie: sluice.tokenize.native
_SLICES_PER_THREAD = 4  # tasks per pool thread in one encode_batch call
_NO_SPECIALS: frozenset[str] = frozenset()

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=true), as in its source.
BYTE_LEVEL_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level vocabulary uses for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _byte_level_codec() -> Any:
    """A charmap codec table: the byte-level alphabet's characters to their bytes, one C call per string.

    `codecs.charmap_encode(text, "strict", table)` maps a whole token at once and
    raises UnicodeEncodeError (with the position) on a character outside the
    alphabet; a per-character Python lookup cost ~3x more (measured on a 32k
    vocabulary: 14 against 5 ms), paid at every daemon start with this backend.
    """
    by_byte = {b: c for c, b in _byte_decoder().items()}
    return codecs.charmap_build("".join(by_byte[b] for b in range(256)))


_CODEC: Any = None


def _codec() -> Any:
    """The byte-level charmap table, built on first use (it is the same for every tokenizer)."""
    global _CODEC
    if _CODEC is None:
        _CODEC = _byte_level_codec()
    return _CODEC


def _to_bytes(token: str) -> bytes:
    """The bytes of a byte-level token; UnicodeEncodeError if a character is outside GPT-2's byte alphabet."""
    return codecs.charmap_encode(token, "strict", _codec())[0]


def _pattern(pre: Any, where: str) -> str:
    def byte_level(p: Any, use_regex: bool) -> bool:
        return (isinstance(p, dict) and p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and bool(p.get("use_regex", True)) == use_regex)

    if byte_level(pre, True):
        return BYTE_LEVEL_PATTERN
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if (len(steps) == 2 and isinstance(steps[0], dict) and steps[0].get("type") == "Split"
                and isinstance(steps[0].get("pattern"), dict) and "Regex" in steps[0]["pattern"]
                and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert", False)
                and byte_level(steps[1], False)):
            return str(steps[0]["pattern"]["Regex"])
    shape = json.dumps(pre, sort_keys=True)[:200]
    raise TokenizerError(
        f"{where}: the tiktoken backend cannot represent this pre-tokenizer ({shape}); it supports "
        "ByteLevel(add_prefix_space=false, use_regex=true) or Sequence[Split(Regex, Isolated), "
        "ByteLevel(add_prefix_space=false, use_regex=false)]"
    )


def build_encoding(obj: dict[str, Any], where: str) -> Any:
    """A `tiktoken.Encoding` equal in ids to the tokenizer.json object `obj`, or TokenizerError naming why not."""
    try:
        import tiktoken
    except ImportError as exc:
        raise TokenizerError(f"{where}: the tiktoken backend needs the `tiktoken` package "
                             "(pip install 'sluice[fast]')") from exc
    if obj.get("normalizer") is not None:
        kind = obj["normalizer"].get("type") if isinstance(obj["normalizer"], dict) else obj["normalizer"]
        raise TokenizerError(f"{where}: the tiktoken backend cannot apply a normalizer ({kind}); use the hf backend")
    pattern = _pattern(obj.get("pre_tokenizer"), where)
    model = obj.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"{where}: the tiktoken backend needs a BPE model, this one is {model.get('type')!r}")
    for field in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(field):  # None, "", 0 and false are all "off"
            raise TokenizerError(f"{where}: the tiktoken backend cannot represent BPE {field}={model.get(field)!r}")
    added = [t for t in obj.get("added_tokens") or [] if isinstance(t, dict)]
    plain = [t.get("content") for t in added if not t.get("special", False)]
    if plain:
        raise TokenizerError(f"{where}: the tiktoken backend cannot match added tokens that are not special "
                             f"({', '.join(map(repr, plain[:5]))}): tokenizers splits them out of the text")
    specials = {str(t["content"]): int(t["id"]) for t in added}
    ranks: dict[bytes, int] = {}
    for token, rank in (model.get("vocab") or {}).items():
        if token in specials:
            continue
        try:
            ranks[_to_bytes(token)] = int(rank)
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"{where}: vocabulary entry {token!r} is not byte-level "
                                 "(a character outside GPT-2's byte alphabet)") from exc
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{where}: the tiktoken backend needs all 256 bytes in the vocabulary; "
                             f"{len(missing)} are missing (first: {missing[0]:#04x})")
    _check_merges(model.get("merges") or [], ranks, where)
    try:
        return tiktoken.Encoding(f"sluice-{where}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as exc:  # tiktoken raises ValueError (bad regex, clashing ids)
        raise TokenizerError(f"{where}: tiktoken refuses the encoding ({exc})") from exc


def _check_merges(merges: list[Any], ranks: dict[bytes, int], where: str) -> None:
    """Merge order must be id order, and every multi-byte token a merge result (tiktoken ranks by id).

    A whole-list pass (comprehensions, no per-merge branches: 3x faster on a
    32k vocabulary) decides; only a list it rejects is walked merge by merge,
    to name the first fault.
    """
    made = _merged_tokens(merges, ranks)
    if made is None:
        made = _walk_merges(merges, ranks, where)
    orphans = [t for t in ranks if len(t) > 1 and t not in made]
    if orphans:
        raise TokenizerError(f"{where}: {len(orphans)} multi-byte tokens are no merge's result "
                             f"(first: {orphans[0]!r}); tiktoken would produce them where tokenizers cannot")


def _merged_tokens(merges: list[Any], ranks: dict[bytes, int]) -> set[bytes] | None:
    """The merges' results when every merge is a byte-level pair of vocabulary tokens in rising id order, else None."""
    codec, encode = _codec(), codecs.charmap_encode
    try:
        pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
        # A pair's parts must be two strings; "+" of a str and a non-str raises TypeError.
        if any(len(p) != 2 or type(p[0]) is not str for p in pairs):
            return None
        joined = [encode(left + right, "strict", codec)[0] for left, right in pairs]
    except (TypeError, LookupError, ValueError):  # UnicodeEncodeError is a ValueError
        return None
    order = list(map(ranks.get, joined))
    if None in order or not all(map(operator.lt, [-1, *order[:-1]], order)):
        return None
    return set(joined)


def _walk_merges(merges: list[Any], ranks: dict[bytes, int], where: str) -> set[bytes]:
    """Merge by merge: raise TokenizerError naming the first merge that is no pair, not byte-level, or out of order."""
    made: set[bytes] = set()
    last = -1
    get = ranks.get
    for i, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str)):
            raise TokenizerError(f"{where}: merge {i} {merge!r} is not a pair")
        try:
            # Only the concatenation is looked up: its characters are both parts', so a
            # part outside the alphabet fails here too.
            joined = _to_bytes(pair[0] + pair[1])
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"{where}: merge {i} {merge!r} is not byte-level") from exc
        rank = get(joined)
        if rank is None:
            raise TokenizerError(f"{where}: merge {i} {merge!r} makes a token that is not in the vocabulary")
        if rank <= last:
            raise TokenizerError(f"{where}: merge {i} {merge!r} gives id {rank}, not above the previous merge's "
                                 f"{last}: tiktoken ranks merges by id, so it would merge in another order")
        last = rank
        made.add(joined)
    return made


class SlicePool:
    """`[one(x) for x in items]` on `threads` Python threads, for an `one` that releases the GIL while it encodes.

    The pool is made on first use and remade when the thread count changes.
    One task per slice of items, not per item: a future per document (submit,
    hand-off, result) holds the GIL longer than a short document's conversion,
    and every such moment stalls the daemon's other threads. A few slices per
    thread keep the threads evenly loaded. Results come back in order.
    """

    __slots__ = ("_pool", "_size", "_prefix")

    def __init__(self, prefix: str) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._prefix = prefix

    def map(self, one: Any, items: list[Any], threads: int) -> list[Any]:
        if threads <= 1 or len(items) < 2:
            return [one(x) for x in items]
        if self._pool is None or self._size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._size = ThreadPoolExecutor(threads, thread_name_prefix=self._prefix), threads
        n = len(items)
        parts = min(n, threads * _SLICES_PER_THREAD)
        bounds = [n * i // parts for i in range(parts + 1)]
        out: list[Any] = []
        for made in self._pool.map(lambda ab: [one(x) for x in items[ab[0]:ab[1]]], zip(bounds, bounds[1:])):
            out.extend(made)
        return out


class TiktokenCodec:
    """Batch encoding with a tiktoken Encoding: one uint32 array per text (the `Encoder` contract)."""

    name = "tiktoken"
    __slots__ = ("_enc", "_literal", "_pool", "_numpy", "_specials")

    def __init__(self, encoding: Any, *, literal: bool) -> None:
        self._enc = encoding
        self._literal = literal
        # tiktoken >= 0.8 returns ids as a numpy view of its own buffer (1.1x faster per document,
        # and the GIL is held only to wrap the buffer); older versions build a list.
        self._numpy = hasattr(encoding, "encode_to_numpy")
        self._specials = encoding.special_tokens_set
        self._pool = SlicePool("tiktoken")

    def check_specials(self, specials: dict[str, int], where: str) -> None:
        """Refuse (TokenizerError) unless the special tokens' ids are those `tokenizers` gives (`specials`).

        tokenizers renumbers an added token whose id in the file is out of line
        (it takes the next free id), while the encoding was built from the file's
        ids: in "special" mode the two would differ.
        """
        ours = dict(self._enc._special_tokens)
        if ours != specials:
            diff = sorted(set(ours.items()) ^ set(specials.items()))[:4]
            raise TokenizerError(f"tokenizer {where}: tokenizers gives the special tokens other ids than the file "
                                 f"records ({', '.join(f'{c!r}={i}' for c, i in diff)}); use the hf backend")

    def encode_batch(self, texts: list[str], threads: int) -> list[np.ndarray]:
        return self._pool.map(self._one_literal if self._literal else self._one_special, texts, threads)

    def _one_literal(self, text: str) -> np.ndarray:
        # The ids straight into a buffer (no list of Python ints, no copy): `encode_to_numpy` with no
        # special token allowed or checked is `encode_ordinary`. A lone surrogate (JSON allows one)
        # makes the buffer call raise; `encode_ordinary` replaces it as tiktoken always does.
        if self._numpy:
            try:
                return self._enc.encode_to_numpy(text, allowed_special=_NO_SPECIALS, disallowed_special=())
            except UnicodeEncodeError:
                pass
        return ids_array(self._enc.encode_ordinary(text))

    def _one_special(self, text: str) -> np.ndarray:
        if self._numpy:
            try:
                return self._enc.encode_to_numpy(text, allowed_special=self._specials, disallowed_special=())
            except UnicodeEncodeError:
                pass
        return ids_array(self._enc.encode(text, allowed_special="all"))

