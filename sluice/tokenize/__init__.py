"""Tokenizers: identity (BLAKE3 of tokenizer.json), batch encoding, offline BPE training, pre-tokenized shards.

See docs/tokenize.md. `tokenizers` itself is imported only when a tokenizer is
loaded or trained.
"""

from sluice.tokenize.encoder import (
    Encoder,
    SpecialToken,
    available_cpus,
    configure_threads,
    current_threads,
    encoder_for_manifest,
    load_tokenizer,
    tokenizer_digest,
)

__all__ = [
    "Encoder",
    "SpecialToken",
    "available_cpus",
    "configure_threads",
    "current_threads",
    "encoder_for_manifest",
    "load_tokenizer",
    "tokenizer_digest",
]
