"""Tokenizers: identity (BLAKE3 of tokenizer.json), batch encoding, offline BPE training, pre-tokenized shards.

See docs/tokenize.md. `tokenizers` itself is imported only when a tokenizer is
loaded or trained.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names, imported on first use (PEP 562) so that `sluice` CLI start-up
# (which imports every component's cli module) stays light.
_EXPORTS = {
    "Encoder": "sluice.tokenize.encoder",
    "SpecialToken": "sluice.tokenize.encoder",
    "available_cpus": "sluice.tokenize.encoder",
    "configure_threads": "sluice.tokenize.encoder",
    "current_threads": "sluice.tokenize.encoder",
    "encoder_for_manifest": "sluice.tokenize.encoder",
    "load_tokenizer": "sluice.tokenize.encoder",
    "tokenizer_digest": "sluice.tokenize.encoder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
