"""Tokenizer identity, loading and batch encoding.

A tokenizer is a `tokenizers` ``tokenizer.json`` file. Its identity is
``"b3:" + BLAKE3(file bytes)``; the manifest records it, and loading with an
expected digest refuses any other file. The file is read once: the digest and
the parsed tokenizer come from the same bytes (no window in which the file can
change between hashing and parsing). Parsing is `tokenizers`' own JSON
deserializer; nothing is unpickled or evaluated.

Example::

    enc = load_tokenizer("tokenizer.json", "b3:5f...")   # refuses another file
    enc.encode_batch(["def f():", "x = 1"])             # [array([..], uint32), ...]

Encoding contract (`Encoder.encode_batch`):

* one ``uint32`` array per text, the tokenizer's ids for that text only, with
  no bos/eos or other post-processor tokens (``add_special_tokens=False``):
  framing comes from the manifest's packing policy, added by the packer;
* padding and truncation configured inside the file are switched off, so a
  document is never cut or padded here;
* special-token text inside a document (a literal ``"<|endoftext|>"`` in a
  source file) is, by default, encoded as ordinary text
  (``specials_in_text="literal"``): a document can never inject a framing or
  control token. ``specials_in_text="special"`` keeps the `tokenizers` default.

Threads: `sluice.tokenize.threads` (how many Rust threads a batch call uses).
"""

from __future__ import annotations

import array
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sluice.errors import TokenizerError
from sluice.manifest.canonical import digest_id
from sluice.tokenize.threads import configure_threads, current_threads, note_parallel_use

# A tokenizer.json of a large vocabulary is tens of MiB; refuse absurd files
# instead of reading them whole into memory.
MAX_TOKENIZER_BYTES = 512 << 20
SPECIALS_IN_TEXT = ("literal", "special")

# Version of what a shard or a token-cache entry holds for a raw object:
# Encoder.encode_batch output (add_special_tokens=False, special-token text
# encoded literally, no padding or truncation), one document per raw record, in
# record order. Bump it when any of that changes: it is part of every derived
# object's lineage and name and of every token-cache key. It lives here, not in
# pretokenize.py, so the daemon's token cache need not import the pre-tokenizer
# (multiprocessing, its process pool) to name it.
TRANSFORM = "sluice-tokenize/1"

# array.array("I") is the fastest list[int] -> uint32 buffer path measured
# (faster than np.array / np.fromiter); only valid where C unsigned int is 4 bytes.
_ARRAY_CODE = "I" if array.array("I").itemsize == 4 else ("L" if array.array("L").itemsize == 4 else "")


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """``"b3:" + BLAKE3`` hex of the file's bytes; TokenizerError naming the file if unreadable."""
    return digest_id(_read_bytes(Path(path)))


def _read_bytes(path: Path) -> bytes:
    try:
        st = path.stat()
        size = st.st_size
        if size > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"tokenizer {path}: {size} bytes exceeds the {MAX_TOKENIZER_BYTES}-byte limit")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # a FIFO would block, a device never end
            raise TokenizerError(f"tokenizer {path}: not a regular file (a FIFO, socket or device is refused)")
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise TokenizerError(f"tokenizer {path}: no such file") from exc
    except IsADirectoryError as exc:
        raise TokenizerError(f"tokenizer {path}: is a directory, expected a tokenizer.json file") from exc
    except OSError as exc:
        raise TokenizerError(f"tokenizer {path}: cannot read ({exc.strerror})") from exc


@dataclass(frozen=True)
class SpecialToken:
    content: str
    id: int


def parse_tokenizer_json(data: bytes, where: str) -> tuple[Any, dict[str, Any]]:
    """Parse tokenizer JSON bytes into (tokenizers.Tokenizer, top-level JSON object)."""
    from tokenizers import Tokenizer

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{where}: not a tokenizer.json (not UTF-8 text: {exc.reason} at byte {exc.start})") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{where}: not a tokenizer.json (invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg})") from exc
    except RecursionError as exc:
        raise TokenizerError(f"{where}: not a tokenizer.json (JSON nested too deeply)") from exc
    except ValueError as exc:  # an integer beyond Python's 4300-digit conversion limit
        raise TokenizerError(f"{where}: not a tokenizer.json ({str(exc)[:200]})") from exc
    if not isinstance(obj, dict) or "model" not in obj:
        raise TokenizerError(f"{where}: not a tokenizer.json (a JSON {type(obj).__name__} without a 'model' field)")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception on a bad shape
        raise TokenizerError(f"{where}: not a tokenizer.json that tokenizers can load ({exc})") from exc
    return tok, obj


def ids_array(ids: list[int]) -> np.ndarray:
    """`ids` (token ids, each below 2**32) as a new uint32 array, by the fastest path measured (`_ARRAY_CODE`)."""
    if _ARRAY_CODE:
        return np.frombuffer(array.array(_ARRAY_CODE, ids), dtype=np.uint32)
    return np.array(ids, dtype=np.uint32)  # pragma: no cover


def _arrays(encodings: list[Any]) -> list[np.ndarray]:
    return [ids_array(e.ids) for e in encodings]


class Encoder:
    """A loaded, identity-checked tokenizer that encodes batches to uint32 arrays.

    Not a frozen dataclass because it owns a native tokenizer object; every
    attribute is read-only by convention and by property. Build it with
    `load_tokenizer` or `encoder_for_manifest`.
    """

    __slots__ = (
        "_tok", "_path", "_digest", "_version", "_vocab_size", "_specials", "_specials_in_text",
        "_encode", "_encode_literal", "_screen", "_fast",
    )

    def __init__(self, tok: Any, *, path: str, digest: str, version: str, specials_in_text: str = "literal",
                 fast: Any = None) -> None:
        if specials_in_text not in SPECIALS_IN_TEXT:
            raise TokenizerError(f"specials_in_text: {specials_in_text!r} is not one of {', '.join(SPECIALS_IN_TEXT)}")
        # `fast`: a TiktokenCodec (sluice.tokenize.fast) that encodes instead of `tok`;
        # `tok` still answers vocabulary questions and decodes.
        self._fast = fast
        # A data pipeline must see every token of a document: padding and
        # truncation stored in the file would silently cut or pad it.
        tok.no_padding()
        tok.no_truncation()
        if specials_in_text == "literal" and not hasattr(tok, "encode_special_tokens"):  # pragma: no cover
            raise TokenizerError("specials_in_text='literal' needs tokenizers >= 0.15")
        self._tok = tok
        self._path = path
        self._digest = digest
        self._version = version
        self._vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        decoder = tok.get_added_tokens_decoder()
        self._specials = tuple(
            SpecialToken(t.content, int(i)) for i, t in sorted(decoder.items()) if getattr(t, "special", False)
        )
        self._specials_in_text = specials_in_text
        # encode_batch_fast skips offset tracking (measured ~1.25x less CPU
        # than encode_batch on a byte-level BPE, tokenizers 0.23.3); older
        # tokenizers only have encode_batch, which gives the same ids.
        self._encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        self._encode_literal = None
        # Special-token text as literal text (encode_special_tokens=True) costs
        # ~1.5x in tokenizers 0.23, yet changes nothing for a text that holds
        # no special token's content. So the literal instance only encodes the
        # texts that contain one; `_screen` is the contents to look for, or
        # None when a substring test cannot decide (specials matched after a
        # normalizer), in which case every text goes the literal way.
        self._screen: tuple[str, ...] | None = ()
        if fast is not None:
            fast.check_specials({s.content: s.id for s in self._specials}, path)
        # A backend that encodes everything itself needs no literal instance
        # (a second parse of the file: 40-100 ms of its start); one that hands
        # some texts back to tokenizers (tokie) gets this encoder's hf path.
        if fast is not None and getattr(fast, "needs_hf", False):
            fast.attach(self._hf_batch)
        if (fast is None or getattr(fast, "needs_hf", False)) and specials_in_text == "literal" and self._specials:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(tok.to_str())
            literal.encode_special_tokens = True
            self._encode_literal = getattr(literal, "encode_batch_fast", None) or literal.encode_batch
            normalized = any(getattr(decoder[s.id], "normalized", False) for s in self._specials)
            self._screen = None if (normalized and tok.normalizer is not None) else tuple(s.content for s in self._specials)

    @property
    def backend(self) -> str:
        """Which library encodes: "hf" (`tokenizers`), "tiktoken", "fastokens" or "tokie" (part of the tokenizer identity)."""
        return "hf" if self._fast is None else str(self._fast.name)

    @property
    def path(self) -> str:
        return self._path

    @property
    def digest(self) -> str:
        """``b3:`` + BLAKE3 of the tokenizer.json bytes this encoder was built from."""
        return self._digest

    @property
    def version(self) -> str:
        """The file's own ``version`` field (tokenizers' serialization version, e.g. "1.0")."""
        return self._version

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens: every id is < vocab_size."""
        return self._vocab_size

    @property
    def special_tokens(self) -> tuple[SpecialToken, ...]:
        return self._specials

    @property
    def specials_in_text(self) -> str:
        return self._specials_in_text

    @property
    def tokenizer(self) -> Any:
        """The underlying `tokenizers.Tokenizer` (for decoding and inspection)."""
        return self._tok

    def token_to_id(self, token: str) -> int:
        """Id of `token` (e.g. "<|endoftext|>"); TokenizerError if the vocabulary lacks it."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"tokenizer {self._path} ({self._digest}): no token {token!r} in the vocabulary")
        return int(tid)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode `texts`; returns one uint32 array per text (no bos/eos; see module docstring)."""
        if not texts:
            return []
        if not isinstance(texts, list):
            texts = list(texts)
        if self._fast is not None:
            return self._fast.encode_batch(texts, current_threads())
        return self._hf_batch(texts)

    def _hf_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode_batch` by `tokenizers` (the reference every other backend must equal)."""
        if not texts:
            return []
        note_parallel_use()
        if self._encode_literal is None:
            return _arrays(self._encode(texts, add_special_tokens=False))
        if self._screen is None:
            return _arrays(self._encode_literal(texts, add_special_tokens=False))
        screen = self._screen
        hits = [i for i, t in enumerate(texts) if any(s in t for s in screen)]
        if not hits:
            return _arrays(self._encode(texts, add_special_tokens=False))
        out: list[Any] = [None] * len(texts)
        hit = set(hits)
        misses = [i for i in range(len(texts)) if i not in hit]
        if misses:
            for i, arr in zip(misses, _arrays(self._encode([texts[i] for i in misses], add_special_tokens=False))):
                out[i] = arr
        for i, arr in zip(hits, _arrays(self._encode_literal([texts[i] for i in hits], add_special_tokens=False))):
            out[i] = arr
        return out

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def __repr__(self) -> str:
        return (f"Encoder(path={self._path!r}, digest={self._digest!r}, vocab_size={self._vocab_size}, "
                f"backend={self.backend!r})")


def load_tokenizer(
    path: str | os.PathLike[str],
    expected_digest: str | None = None,
    *,
    threads: int | None = None,
    specials_in_text: str = "literal",
    backend: str = "hf",
) -> Encoder:
    """Load a tokenizer.json; with `expected_digest`, refuse a file of another identity.

    `threads` (if given) calls `configure_threads` first. `backend` "tiktoken"
    encodes with an encoding built from the same file (sluice.tokenize.fast).
    Raises TokenizerError naming the file when it is missing, not a tokenizer,
    of another digest, or not representable by the backend (naming why).
    """
    p = Path(path)
    if threads is not None:
        configure_threads(threads)
    data, digest = read_tokenizer_checked(p, expected_digest)
    tok, obj = parse_tokenizer_json(data, f"tokenizer {p}")
    version = obj.get("version")
    fast = None
    if backend != "hf":
        from sluice.tokenize.fast import BACKENDS, TiktokenCodec, build_encoding

        if backend not in BACKENDS:
            raise TokenizerError(f"tokenizer {p}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "tiktoken":
            fast = TiktokenCodec(build_encoding(obj, f"tokenizer {p}"), literal=specials_in_text == "literal")
        else:
            from sluice.tokenize.native import build_codec

            fast = build_codec(backend, data, obj, f"tokenizer {p}", literal=specials_in_text == "literal")
    return Encoder(
        tok,
        path=str(p),
        digest=digest,
        version=version if isinstance(version, str) else "",
        specials_in_text=specials_in_text,
        fast=fast,
    )


def read_tokenizer_checked(p: Path, expected_digest: str | None) -> tuple[bytes, str]:
    """(bytes, digest) of the tokenizer file `p`; a `TokenizerError` when its digest is not `expected_digest`."""
    data = _read_bytes(p)
    digest = digest_id(data)
    if expected_digest is not None and digest != expected_digest:
        raise TokenizerError(
            f"tokenizer {p}: digest {digest} differs from the manifest's {expected_digest}; "
            "sluice refuses to run with a tokenizer other than the one the dataset was frozen with"
        )
    return data, digest


def _manifest_tokenizer(manifest: Any) -> tuple[str, Any]:
    ref = manifest.tokenizer
    if ref is None:
        raise TokenizerError(f"manifest {manifest.name!r} names no tokenizer")
    location = manifest.resolve(ref.location)
    from sluice.manifest.storage import is_remote

    if is_remote(location):
        raise TokenizerError(f"manifest {manifest.name!r}: tokenizer {location} must be a local file")
    return location, ref


def backend_installed(backend: str) -> bool:
    """Whether the library of `backend` can be imported here ("hf" always: `tokenizers` is a dependency)."""
    if backend == "hf":
        return True
    import importlib

    try:  # an import, not a lookup: a broken install (a missing native library) counts as missing
        importlib.import_module(backend)  # the backends' modules are named as they are
    except ImportError:
        return False
    return True


def serving_backend(recorded: str) -> str:
    """The backend that encodes for a manifest that records `recorded`: itself, or "hf" where its library is missing.

    Every recorded backend was proven to give the ids of `tokenizers` (freeze,
    `sluice tokenize check`), so `tokenizers` serves the same stream; derived
    objects are keyed by the backend that made them ("hf" then). The daemon
    says so once in its log and in ``sluice_tokenizer_backend_fallback``.
    """
    return recorded if backend_installed(recorded) else "hf"


def encoder_for_manifest(manifest: Any, *, threads: int | None = None, cache: Any = None) -> Encoder:
    """The manifest's tokenizer, loaded and checked against `manifest.tokenizer.digest`.

    Encodes with the recorded backend, or with `tokenizers` where that backend's
    library is not installed (`serving_backend`). With a node `cache` and the
    tiktoken backend, the built encoding is a derived cache object
    (sluice.tokenize.fastcache): read on a hit, built and kept on a miss.
    """
    location, ref = _manifest_tokenizer(manifest)
    backend = serving_backend(getattr(ref, "backend", "hf"))
    # The digest pins the exact file, so vocab size and version follow from it.
    if cache is None or backend != "tiktoken":
        return load_tokenizer(location, ref.digest, threads=threads, backend=backend)
    from sluice.tokenize.fastcache import cached_encoder

    if threads is not None:
        configure_threads(threads)
    read_tokenizer_checked(Path(location), ref.digest)  # a missing or other file is refused before the cache is asked
    specials = load_tokenizer.__kwdefaults__["specials_in_text"]
    return cached_encoder(cache, location, ref.digest, specials,
                          lambda: load_tokenizer(location, ref.digest, backend=backend))


@dataclass(frozen=True)
class TokenizerIdentity:
    """What an encoder's derived objects (cached tokens) are keyed by: `Encoder`'s digest, backend, specials rule."""

    path: str
    digest: str
    backend: str  # the backend that encodes here (`serving_backend`)
    specials_in_text: str
    recorded: str = "hf"  # the manifest's backend; differs from `backend` where its library is missing

    @property
    def fallback(self) -> bool:
        return self.backend != self.recorded


def manifest_tokenizer_identity(manifest: Any) -> TokenizerIdentity:
    """The identity `encoder_for_manifest(manifest)` loads, checked without parsing the file.

    Reads and hashes the file (milliseconds) and raises the TokenizerError
    `encoder_for_manifest` would for a missing, unreadable or other file; the
    parse (a quarter of a second for a 32k vocabulary) is left to whoever
    encodes. For a caller that may never encode (every object's tokens are in
    the node cache) and must still fail at start on a wrong tokenizer.
    """
    location, ref = _manifest_tokenizer(manifest)
    read_tokenizer_checked(Path(location), ref.digest)
    specials = load_tokenizer.__kwdefaults__["specials_in_text"]  # what encoder_for_manifest loads with
    return TokenizerIdentity(path=location, digest=ref.digest, backend=serving_backend(getattr(ref, "backend", "hf")),
                             specials_in_text=specials, recorded=getattr(ref, "backend", "hf"))
