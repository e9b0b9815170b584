"""The `fastokens` and `tokie` backends: other Rust tokenizers that load the same tokenizer.json.

Like `tiktoken` (sluice.tokenize.fast), a backend here is part of the tokenizer
identity (`TokenizerRef.backend`) and must give exactly the ids of `tokenizers`
(the `hf` backend) for every document. Each library parses the *verified*
bytes (never the path again), and what it is known to get wrong is refused at
load with the reason, so a manifest can never record it; everything else is
proven per corpus by `sluice tokenize check` (and by freeze on a sample).

    enc = load_tokenizer("tokenizer.json", digest, backend="fastokens")
    enc.encode_batch(texts)        # same uint32 arrays as backend="hf"

fastokens (0.3.5): ``Tokenizer.from_json_str``; ``encode_batch_flat`` gives
every document's ids in one uint32 buffer plus offsets (no Python object per
document). ``split_special_tokens=True`` is `specials_in_text="literal"`.
Refuses at load what it does not implement (Metaspace, ...): that message is
the reason. Threads: its own pool, sized once per process from
``FASTOKENS_BPE_THREADS`` when it first encodes; `configure_threads` sets it,
and the first encode of a process that never called it sets it to
`current_threads()`, so the pool is the count the caller budgets.

tokie (0.1.4): ``Tokenizer.from_json(path)`` reads a file, so the verified bytes
are written to a private temporary file for it. Five limits, measured here and
in its source, each handled so the ids stay those of `tokenizers`:

* its pre-tokenizers are its own lexers, not the file's regex: a Metaspace
  pre-tokenizer (SentencePiece style) gives other ids (2,153 of 2,300 strings,
  issue 24; every variant of prepend scheme and split tried here), and a
  llama-3 style Split regex too (59 of the first 12,288 code points, e.g.
  ``"\\t(s"``: a tab before punctuation, common in code). Only the GPT-2 shape,
  ``ByteLevel(use_regex=true)`` without a normalizer, is accepted (0 of the
  same probes differ); every other shape is refused at load;
* a document of 10,000 UTF-8 bytes or more is cut at spaces into one chunk per
  CPU, each encoded on its own thread, which splits pre-tokenizer pieces (a run
  of spaces) and gives other ids (a 200 KB stdlib file: different ids with both
  a GPT-2 and a llama-3 pattern); such documents are encoded by `tokenizers`;
* it matches special-token text inside a document with no way to turn that
  off, so a document containing an added token's content is encoded by
  `tokenizers` too;
* its GPT-2 lexer splits whitespace runs holding a vertical tab or a form
  feed, and a contraction right after a tab (``"\\t's"``: 's is one piece for
  `tokenizers`, two for tokie), other than the file's regex does: found by
  the differential test (hypothesis); 358 of 150,000 random whitespace and
  punctuation strings differed, every one holding ``\\x0b``, ``\\x0c`` or
  ``\\t'`` (none without); such documents are encoded by `tokenizers`;
* its batch call starts one thread per CPU whatever the budget, so batches
  are encoded one document per call (its sequential path) on at most
  `threads` Python threads (the GIL is released while it encodes).
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable

import numpy as np

from sluice.affinity import widened
from sluice.errors import TokenizerError
from sluice.tokenize.fast import SlicePool

NATIVE_BACKENDS = ("fastokens", "tokie")
# tokie 0.1.4 encodes a text of at least this many UTF-8 bytes in parallel chunks cut at spaces
# (Tokenizer::PARALLEL_CHUNK_THRESHOLD), which changes the ids: such texts go to `tokenizers`.
TOKIE_PARALLEL_BYTES = 10_000
_FASTOKENS_THREADS_ENV = "FASTOKENS_BPE_THREADS"

HfBatch = Callable[[list[str]], list[np.ndarray]]


def _import(backend: str, where: str) -> Any:
    try:
        return __import__(backend)
    except ImportError as exc:
        raise TokenizerError(f"{where}: the {backend} backend needs the `{backend}` package "
                             "(pip install 'sluice[fast]')") from exc


def _check_specials(name: str, token_to_id: Callable[[str], Any], specials: dict[str, int], where: str) -> None:
    """Refuse (TokenizerError) unless the library gives each special token the id `tokenizers` gives it."""
    wrong = [(c, i, token_to_id(c)) for c, i in specials.items() if token_to_id(c) != i]
    if wrong:
        shown = ", ".join(f"{c!r}: tokenizers {i}, {name} {got}" for c, i, got in wrong[:4])
        raise TokenizerError(f"tokenizer {where}: {name} gives special tokens other ids ({shown}); "
                             "use the hf backend")


def _metaspace(pre: Any) -> bool:
    """Whether a pre-tokenizer (JSON object) is or contains a Metaspace step."""
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Metaspace":
        return True
    return any(_metaspace(p) for p in pre.get("pretokenizers") or [])


class FastokensCodec:
    """Batch encoding with fastokens: one uint32 array per text (the `Encoder` contract)."""

    name = "fastokens"
    needs_hf = False
    __slots__ = ("_tok", "_split")

    def __init__(self, tok: Any, *, literal: bool) -> None:
        self._tok = tok
        self._split = literal  # special-token text is ordinary text

    def check_specials(self, specials: dict[str, int], where: str) -> None:
        _check_specials(self.name, self._tok.token_to_id, specials, where)

    def encode_batch(self, texts: list[str], threads: int) -> list[np.ndarray]:
        if not _POOL_MADE.is_set():
            ids, offsets = self._first(texts, threads)
        else:
            ids, offsets = self._flat(texts)
        # One copy makes the buffer writable (as the hf backend's arrays are); each document is a view of it.
        flat = np.frombuffer(ids, dtype="<u4").astype(np.uint32, copy=True)
        ends = np.frombuffer(offsets, dtype="<u8").tolist()
        return [flat[a:b] for a, b in zip(ends, ends[1:])]

    def _first(self, texts: list[str], threads: int) -> tuple[Any, Any]:
        """An encode before fastokens' pool exists: one thread at a time, widened.

        fastokens makes its pool on the first encode in the process, capped at the CPUs of the calling thread,
        and its threads inherit them: a thread loaderd pinned to one CPU (--gil-cpu) would get a pool of one.
        Every thread that arrives before the pool is made (loaderd's fill and demand threads start together)
        waits here for that one encode, so none enters fastokens pinned while the pool is still to be made."""
        with _FIRST_LOCK:
            if not _POOL_MADE.is_set():
                _size_pool(threads)
                with widened():
                    out = self._flat(texts)
                _POOL_MADE.set()
                return out
        return self._flat(texts)  # (the pool was made while this thread waited)

    def _flat(self, texts: list[str]) -> tuple[Any, Any]:
        return self._tok.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=self._split)


_FASTOKENS_POOL: int | None = None
_FIRST_LOCK = threading.Lock()  # held by the encode that makes fastokens' pool (FastokensCodec._first)
_POOL_MADE = threading.Event()  # set once that encode returned: the pool exists and keeps its size


def _size_pool(threads: int) -> None:
    """Before fastokens' first encode in this process: its pool gets `threads` (it is fixed once made)."""
    global _FASTOKENS_POOL
    if _FASTOKENS_POOL is None:
        os.environ[_FASTOKENS_THREADS_ENV] = str(max(1, threads))
        _FASTOKENS_POOL = threads


class TokieCodec:
    """Batch encoding with tokie, within its limits (module docstring); the rest goes to `tokenizers`."""

    name = "tokie"
    needs_hf = True
    __slots__ = ("_tok", "_screen", "_hf", "_pool")

    def __init__(self, tok: Any, *, added: tuple[str, ...]) -> None:
        self._tok = tok
        self._screen = added  # contents of every added token: texts holding one go to tokenizers
        self._hf: HfBatch | None = None
        self._pool = SlicePool("tokie")  # at most `threads` threads, whatever tokie's own batch call would start

    def attach(self, hf: HfBatch) -> None:
        """The `tokenizers` batch encoder for the texts tokie cannot encode exactly."""
        self._hf = hf

    def check_specials(self, specials: dict[str, int], where: str) -> None:
        _check_specials(self.name, self._tok.token_to_id, specials, where)

    def _exact(self, text: str) -> bool:
        """Whether tokie's sequential path gives `text` the ids of tokenizers (module docstring)."""
        if len(text) * 4 >= TOKIE_PARALLEL_BYTES and len(text.encode("utf-8", "surrogatepass")) >= TOKIE_PARALLEL_BYTES:
            return False
        if "\x0b" in text or "\x0c" in text or "\t'" in text:  # (its lexer's whitespace rules: docstring)
            return False
        return not any(s in text for s in self._screen)

    def _one(self, text: str) -> np.ndarray:
        # A one-text batch takes tokie's sequential path (no thread of its own) and returns numpy.
        ids, _lengths = self._tok.encode_batch_flat([text], add_special_tokens=False)
        return np.asarray(ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str], threads: int) -> list[np.ndarray]:
        mine = [i for i, t in enumerate(texts) if self._exact(t)]
        out: list[Any] = [None] * len(texts)
        if len(mine) < len(texts):
            if self._hf is None:
                raise TokenizerError("tokie backend: no tokenizers encoder attached for the texts tokie cannot encode")
            others = sorted(set(range(len(texts))) - set(mine))
            for i, arr in zip(others, self._hf([texts[i] for i in others])):
                out[i] = arr
        for i, arr in zip(mine, self._pool.map(self._one, [texts[i] for i in mine], threads)):
            out[i] = arr
        return out


def build_codec(backend: str, data: bytes, obj: dict[str, Any], where: str, *, literal: bool) -> Any:
    """The codec of `backend` for the tokenizer.json `data` (parsed as `obj`), or TokenizerError naming why not."""
    if backend == "fastokens":
        lib = _import(backend, where)
        try:
            tok = lib.Tokenizer.from_json_str(data.decode("utf-8"))
        except Exception as exc:  # fastokens raises ValueError naming what it does not support
            raise TokenizerError(f"{where}: fastokens cannot load it ({str(exc)[:300]}); use another backend") from exc
        return FastokensCodec(tok, literal=literal)
    if backend == "tokie":
        lib = _import(backend, where)
        _tokie_representable(obj, where)
        tok = _tokie_from_bytes(lib, data, where)
        added = tuple(str(t["content"]) for t in obj.get("added_tokens") or [] if isinstance(t, dict) and t.get("content"))
        return TokieCodec(tok, added=added)
    raise TokenizerError(f"{where}: {backend!r} is not a backend of sluice.tokenize.native ({', '.join(NATIVE_BACKENDS)})")


def _tokie_representable(obj: dict[str, Any], where: str) -> None:
    """Refuse (TokenizerError naming why) every tokenizer.json shape tokie is not proven on: only GPT-2 style."""
    pre = obj.get("pre_tokenizer")
    if _metaspace(pre):
        raise TokenizerError(f"{where}: tokie gives other ids than tokenizers with a Metaspace pre-tokenizer "
                             "(SentencePiece style); use the hf backend")
    if not (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)):
        shape = pre.get("type") if isinstance(pre, dict) else pre
        raise TokenizerError(f"{where}: tokie splits text by its own rules, equal to tokenizers' only for "
                             f"ByteLevel(use_regex=true) (GPT-2 style); this pre-tokenizer ({shape}) is refused "
                             "(a llama-3 Split regex gives other ids for '\\t(s'); use fastokens or hf")
    if obj.get("normalizer") is not None:
        kind = obj["normalizer"].get("type") if isinstance(obj["normalizer"], dict) else obj["normalizer"]
        raise TokenizerError(f"{where}: tokie is not proven with a normalizer ({kind}); use fastokens or hf")


def _tokie_from_bytes(lib: Any, data: bytes, where: str) -> Any:
    """tokie's Tokenizer from the verified bytes: it only reads a path, so a private copy is handed to it."""
    with tempfile.TemporaryDirectory(prefix="sluice-tokie-") as folder:  # 0700: nobody swaps the file
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "wb") as f:
            f.write(data)
        try:
            return lib.Tokenizer.from_json(path)
        except Exception as exc:  # tokie raises TokieError (an Exception) naming the problem
            raise TokenizerError(f"{where}: tokie cannot load it ({str(exc)[:300]}); use another backend") from exc
