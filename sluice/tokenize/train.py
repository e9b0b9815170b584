"""Offline byte-level BPE training: a real tokenizer without a model hub.

``train_bpe(["data/", "notes.md"], "tokenizer.json", vocab_size=4096)`` reads
the corpus (files given by name, and under directories every ``*.jsonl``,
``*.jsonl.gz``, ``*.jsonl.zst``, ``*.parquet``, ``*.py``, ``*.txt`` and
``*.md`` file, recursively, in sorted path order), trains a `tokenizers` BPE
model with a ByteLevel pre-tokenizer and decoder and the 256-symbol byte
alphabet as the initial alphabet (so every input encodes, with no unknown
token), and writes ``tokenizer.json`` atomically. What it read (files and
documents per format) and what it skipped under the directories, with the
reason, are in the result (`TrainResult.read`, `TrainResult.skipped`).

Special tokens take the first ids in the order given (default
``<|endoftext|>`` = 0, ``<|pad|>`` = 1, ``<|bos|>`` = 2).

Determinism: the same corpus and options give a byte-identical
tokenizer.json, independent of the thread count (checked by the tests): files
are read in sorted order, `tokenizers`' BPE trainer breaks count ties by pair
order, and its serializer writes the vocabulary in id order.

jsonl files (plain, gzip or zstd; decompressed in bounded pieces, a cut-short
stream is an error) contribute the string field `text_field` of every line,
parquet files the string column `text_field` (read a batch at a time); a
file without it is an error naming the file, the field and the fields it
has. Other files contribute their whole UTF-8 text.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import SluiceError, TokenizerError

DEFAULT_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|bos|>")
# how a name ends -> the format it is read as (longest endings first: ".jsonl.gz" before ".gz")
FORMATS = ((".jsonl.gz", "jsonl.gz"), (".jsonl.zst", "jsonl.zst"), (".jsonl", "jsonl"), (".parquet", "parquet"),
           (".py", "text"), (".txt", "text"), (".md", "text"))
CORPUS_SUFFIXES = tuple(end for end, _ in FORMATS)
_COMPRESSION = {"jsonl.gz": "gzip", "jsonl.zst": "zstd"}
BYTE_ALPHABET = 256


@dataclass(frozen=True)
class TrainResult:
    path: str
    digest: str
    vocab_size: int
    files: int
    documents: int
    bytes: int
    read: dict[str, dict[str, int]] = field(default_factory=dict)  # format -> {"files", "documents"}
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of files under directories


def file_format(path: Path) -> str | None:
    """The format `path` is read as ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "text"), None if not a corpus file."""
    for end, fmt in FORMATS:
        if path.name.endswith(end):
            return fmt
    return None


def _why_skipped(path: Path) -> str:
    name = path.name
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "a tar archive (WebDataset): extract its text, or give the .txt files"
    if name.endswith((".gz", ".zst", ".bz2", ".xz")):
        return f"compressed, and not jsonl ({', '.join('*' + e for e, f in FORMATS if f in _COMPRESSION)} are read)"
    if name.startswith("."):
        return "a hidden file"
    return f"not a corpus file ({', '.join('*' + e for e in CORPUS_SUFFIXES)} are read under a directory)"


def corpus_files(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[Path], list[tuple[str, str]]]:
    """(files to read in order, (path, why) of files skipped under directories); TokenizerError for a missing path.

    A file given by name is always read (as text unless its name says jsonl or
    parquet); under a directory only the corpus formats are, in sorted order.
    """
    out: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for f in sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.as_posix()):
                if file_format(f) is None or f.name.startswith("."):
                    skipped.append((str(f), _why_skipped(f)))
                else:
                    out.append(f)
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise TokenizerError(f"corpus path {p}: neither a file nor a directory")
        else:
            raise TokenizerError(f"corpus path {p}: no such file or directory")
    return out, skipped


class _Corpus:
    """Iterates the documents of the corpus one at a time (bounded memory) and counts them per format."""

    def __init__(self, files: list[Path], text_field: str) -> None:
        self.files = files
        self.text_field = text_field
        self.documents = 0
        self.bytes = 0
        self.read: dict[str, dict[str, int]] = {}

    def __iter__(self) -> Iterator[str]:
        for f in self.files:
            fmt = file_format(f) or "text"
            counts = self.read.setdefault(fmt, {"files": 0, "documents": 0})
            counts["files"] += 1
            texts = self._parquet(f) if fmt == "parquet" else self._jsonl(f, fmt) if fmt.startswith("jsonl") \
                else iter((self._read(f),))
            for text in texts:
                if text:
                    self.documents += 1
                    self.bytes += len(text)
                    counts["documents"] += 1
                    yield text

    @staticmethod
    def _read(f: Path) -> str:
        try:
            return f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"corpus file {f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except OSError as exc:
            raise TokenizerError(f"corpus file {f}: cannot read ({exc.strerror})") from exc

    def _missing(self, f: Path, where: str, has: Sequence[str]) -> TokenizerError:
        shown = ", ".join(repr(h) for h in list(has)[:12]) or "none"
        return TokenizerError(f"corpus file {f}{where}: no string field {self.text_field!r} (it has: {shown}); "
                              "--text-field names the field to train on")

    def _jsonl(self, f: Path, fmt: str) -> Iterator[str]:
        try:
            stored = open(f, "rb")
        except OSError as exc:
            raise TokenizerError(f"corpus file {f}: cannot read ({exc.strerror})") from exc
        raw: Any = stored
        if fmt in _COMPRESSION:
            from sluice.manifest.decode import DecodedReader

            raw = io.BufferedReader(DecodedReader(stored, _COMPRESSION[fmt], f"corpus file {f}"))
        with stored, io.TextIOWrapper(raw, encoding="utf-8") as handle:
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
                        raise self._missing(f, f" line {lineno}", list(obj) if isinstance(obj, dict) else [])
                    yield text
            except UnicodeDecodeError as exc:
                raise TokenizerError(f"corpus file {f}: not UTF-8 text ({exc.reason})") from exc
            except TokenizerError:
                raise
            except SluiceError as exc:  # a gzip/zstd stream cut short or corrupt (SourceReadError names the file)
                raise TokenizerError(str(exc)) from exc
            except OSError as exc:
                raise TokenizerError(f"corpus file {f}: cannot read ({exc.strerror or exc})") from exc

    def _parquet(self, f: Path) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(f)
        except (OSError, pa.ArrowException) as exc:
            raise TokenizerError(f"corpus file {f}: not a readable parquet file ({exc})") from exc
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise self._missing(f, "", names)
        kind = pf.schema_arrow.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise TokenizerError(f"corpus file {f}: column {self.text_field!r} holds {kind}, not strings; "
                                 "--text-field names the column to train on")
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field]):
                for text in batch.column(0).to_pylist():
                    if text is not None:
                        yield text
        except (OSError, pa.ArrowException) as exc:
            raise TokenizerError(f"corpus file {f}: cannot read ({exc})") from exc


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
    files, skipped = corpus_files(corpus)
    if not files:
        raise TokenizerError(
            f"corpus {[str(c) for c in corpus]}: no files to train on "
            f"(directories are searched for {', '.join('*' + s for s in CORPUS_SUFFIXES)}"
            f"{f'; skipped {len(skipped)}: ' + ', '.join(f'{p} ({why})' for p, why in skipped[:3]) if skipped else ''})"
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
        read=docs.read,
        skipped=skipped,
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
