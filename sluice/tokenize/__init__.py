"""Tokenizers: identity (BLAKE3 of tokenizer.json), batch encoding, offline BPE training, pre-tokenized shards.

See docs/tokenize.md. `tokenizers` itself is imported only when a tokenizer is
loaded or trained.
"""

from sluice._lazy import lazy_exports

_EXPORTS = {
    "Encoder": "sluice.tokenize.encoder",
    "SpecialToken": "sluice.tokenize.encoder",
    "available_cpus": "sluice.tokenize.threads",
    "configure_threads": "sluice.tokenize.threads",
    "current_threads": "sluice.tokenize.threads",
    "encoder_for_manifest": "sluice.tokenize.encoder",
    "load_tokenizer": "sluice.tokenize.encoder",
    "tokenizer_digest": "sluice.tokenize.encoder",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
