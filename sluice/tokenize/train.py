"""Offline byte-level BPE training: a real tokenizer without a model hub.

``train_bpe(["src/", "notes.md"], "tokenizer.json", vocab_size=4096)`` reads
the corpus (files given by name, and under directories every ``*.py``,
``*.txt``, ``*.md`` and ``*.jsonl`` file, recursively, in sorted path order),
trains a `tokenizers` BPE model with a ByteLevel pre-tokenizer and decoder and
the 256-symbol byte alphabet as the initial alphabet (so every input encodes,
with no unknown token), and writes ``tokenizer.json`` atomically.

Special tokens take the first ids in the order given (default
``<|endoftext|>`` = 0, ``<|pad|>`` = 1, ``<|bos|>`` = 2).

Determinism: the same corpus and options give a byte-identical
tokenizer.json, independent of the thread count (checked by the tests): files
are read in sorted order, `tokenizers`' BPE trainer breaks count ties by pair
order, and its serializer writes the vocabulary in id order.

``*.jsonl`` files contribute the string field `text_field` of every line; other
files contribute their whole UTF-8 text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import TokenizerError

DEFAULT_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|bos|>")
CORPUS_SUFFIXES = (".py", ".txt", ".md", ".jsonl")
BYTE_ALPHABET = 256


@dataclass(frozen=True)
class TrainResult:
    path: str
    digest: str
    vocab_size: int
    files: int
    documents: int
    bytes: int


def corpus_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand `paths` into the sorted list of files to read; TokenizerError for a missing path."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.suffix in CORPUS_SUFFIXES),
                key=lambda f: f.as_posix(),
            )
            out.extend(found)
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise TokenizerError(f"corpus path {p}: neither a file nor a directory")
        else:
            raise TokenizerError(f"corpus path {p}: no such file or directory")
    return out


class _Corpus:
    """Iterates the documents of the corpus one at a time (bounded memory) and counts them."""

    def __init__(self, files: list[Path], text_field: str) -> None:
        self.files = files
        self.text_field = text_field
        self.documents = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        for f in self.files:
            if f.suffix == ".jsonl":
                yield from self._jsonl(f)
            else:
                text = self._read(f)
                if text:
                    self.documents += 1
                    self.bytes += len(text)
                    yield text

    @staticmethod
    def _read(f: Path) -> str:
        try:
            return f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"corpus file {f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except OSError as exc:
            raise TokenizerError(f"corpus file {f}: cannot read ({exc.strerror})") from exc

    def _jsonl(self, f: Path) -> Iterator[str]:
        try:
            handle = open(f, encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(f"corpus file {f}: cannot read ({exc.strerror})") from exc
        with handle:
            try:
                for lineno, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise TokenizerError(f"corpus file {f} line {lineno}: not JSON ({exc.msg})") from exc
                    text = obj.get(self.text_field) if isinstance(obj, dict) else None
                    if not isinstance(text, str):
                        raise TokenizerError(
                            f"corpus file {f} line {lineno}: no string field {self.text_field!r}"
                        )
                    if text:
                        self.documents += 1
                        self.bytes += len(text)
                        yield text
            except UnicodeDecodeError as exc:
                raise TokenizerError(f"corpus file {f}: not UTF-8 text ({exc.reason})") from exc


def train_bpe(
    corpus: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIALS,
    text_field: str = "text",
    min_frequency: int = 0,
) -> TrainResult:
    """Train a byte-level BPE on `corpus` and write it to `output` atomically.

    Raises TokenizerError for a missing path, an empty corpus, unreadable text,
    duplicate special tokens or a vocab size too small for the byte alphabet
    plus the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sluice.manifest.canonical import digest_id

    specials = list(special_tokens)
    if len(set(specials)) != len(specials):
        raise TokenizerError(f"special tokens: duplicates in {specials}")
    if any(not s for s in specials):
        raise TokenizerError("special tokens: an empty string is not a token")
    floor = BYTE_ALPHABET + len(specials)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < floor:
        raise TokenizerError(
            f"vocab size {vocab_size!r}: must be at least {floor} "
            f"(256 byte symbols + {len(specials)} special tokens)"
        )
    files = corpus_files(corpus)
    if not files:
        raise TokenizerError(
            f"corpus {[str(c) for c in corpus]}: no files to train on "
            f"(directories are searched for {', '.join('*' + s for s in CORPUS_SUFFIXES)})"
        )
    docs = _Corpus(files, text_field)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter(docs), trainer=trainer)
    if docs.documents == 0:
        raise TokenizerError(f"corpus {[str(c) for c in corpus]}: {len(files)} files but no text in them")

    data = tok.to_str().encode("utf-8")
    target = Path(output)
    _atomic_write(target, data)
    return TrainResult(
        path=str(target),
        digest=digest_id(data),
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        files=len(files),
        documents=docs.documents,
        bytes=docs.bytes,
    )


def _atomic_write(target: Path, data: bytes) -> None:
    """Write `data` to `target` atomically (temp file + fsync + rename; see freeze.write_atomic)."""
    from sluice.fsutil import write_atomic

    if not target.parent.is_dir():
        raise TokenizerError(f"output {target}: folder {target.parent} does not exist")
    try:
        write_atomic(target, data)
    except OSError as exc:
        raise TokenizerError(f"output {target}: cannot write ({exc.strerror})") from exc
