"""The dataset's tokenizer at freeze: read and identified (`load_tokenizer`), its backend proven (`settle_backend`).

A backend other than `tokenizers` ("hf") is recorded only once it gave the
same ids as `tokenizers` on a stratified sample of the corpus; "auto" records
the fastest installed backend so proven (docs/tokenize.md, "Choosing a backend").
"""

from __future__ import annotations

import json
from typing import Any

from sluice.errors import SpecError, TokenizerError
from sluice.manifest.canonical import digest_id
from sluice.manifest.inputs import read_input
from sluice.manifest.model import Manifest
from sluice.manifest.policies import TokenizerRef
from sluice.tokenize.native import NATIVE_BACKENDS

MAX_TOKENIZER_BYTES = 1 << 28  # real tokenizer.json files are tens of MB
# A tokenizer backend other than hf is proven on about this many documents (stratified: the first ones of
# every local text object) before freeze records it; `sluice tokenize check` proves every document.
FREEZE_CHECK_DOCUMENTS = 2000
# ... and at most about this many characters of text (long documents): `tokenizers` encodes the sample too,
# at ~1 M tokens/s, so this bounds freeze's extra time to a few seconds.
FREEZE_CHECK_CHARS = 4 << 20
# "auto" tries these in order (docs/tokenize.md, "Choosing a backend"): fastokens is the fastest everywhere;
# tiktoken before tokie, which is faster on short documents only (it hands every document of 10 kB or more
# to tokenizers: 1.1x hf on whole files, tiktoken 10x) and is exact only under three guards.
AUTO_BACKENDS = ("fastokens", "tiktoken", "tokie")



def load_tokenizer(path: str, location: str, spec_path: str, backend: str = "hf") -> tuple[TokenizerRef, Any]:
    """The tokenizer file at `path` read (bounded), parsed by `tokenizers`, and identified: its `TokenizerRef`
    (recorded `location`, BLAKE3 digest, version, vocabulary size, backend) and the loaded Tokenizer. A backend
    that cannot represent it is refused here, naming why (TokenizerError)."""
    where = f"tokenizer {path} (dataset spec {spec_path}: tokenizer)"
    data = read_input(path, f"dataset spec {spec_path}: tokenizer", MAX_TOKENIZER_BYTES, SpecError)
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError
        raise TokenizerError(f"{where}: not a tokenizer.json (not JSON: {str(exc)[:200]})") from exc
    if not isinstance(obj, dict) or "model" not in obj:
        raise TokenizerError(f"{where}: not a tokenizer.json (no 'model' object)")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"{where}: the tokenizers library refuses it ({exc})") from exc
    if backend == "tiktoken":  # refuse now, naming why, a tokenizer the backend cannot represent
        from sluice.tokenize.fast import build_encoding

        build_encoding(obj, where)
    elif backend in NATIVE_BACKENDS:
        from sluice.tokenize.native import build_codec

        build_codec(backend, data, obj, where, literal=True)
    version = obj.get("version")
    ref = TokenizerRef(
        location=location,
        digest=digest_id(data),
        version=version if isinstance(version, str) else "",
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        backend="hf" if backend == "auto" else backend,  # "auto" is decided on the frozen objects
    )
    return ref, tok


def _prove_backend(manifest: Manifest, backend: str, where: str) -> Any:
    """`tokenize check` of `backend` on a stratified sample of the manifest's local text objects.

    Returns the CheckResult; raises TokenizerError when the backend cannot
    represent the tokenizer (naming why) or its library is missing.
    """
    from sluice.tokenize.check import LocalObjects, check_backend

    try:
        return check_backend(manifest, backend, cache=LocalObjects(), sample=FREEZE_CHECK_DOCUMENTS,
                             sample_chars=FREEZE_CHECK_CHARS)
    except TokenizerError as exc:
        raise TokenizerError(f"{where}: tokenizer_backend {backend!r}: {exc}") from exc


def settle_backend(manifest: Manifest, requested: str, where: str, notes: list[str] | None) -> Manifest:
    """The manifest with the backend `requested` proven, or for "auto" the fastest one proven (else "hf").

    A named backend that gives other ids on the sample is refused (TokenizerError
    naming the document and token offset); "auto" tries `AUTO_BACKENDS` in
    order and records the first that is installed, represents the tokenizer
    and gives the same ids on the sample. `notes` gets one line per decision.
    """
    import dataclasses

    from sluice.tokenize.encoder import backend_installed

    def record(backend: str) -> Manifest:
        assert manifest.tokenizer is not None
        return dataclasses.replace(manifest, tokenizer=dataclasses.replace(manifest.tokenizer, backend=backend))

    def say(line: str) -> None:
        if notes is not None:
            notes.append(line)

    if requested != "auto":
        result = _prove_backend(manifest, requested, where)
        if not result.equal:
            first = result.mismatches[0].describe(requested)
            raise TokenizerError(
                f"{where}: tokenizer_backend {requested!r} gives other ids than tokenizers on {result.mismatched} of "
                f"{result.documents} sampled documents (first: {first}); a backend must give the same ids for every "
                "document: use \"hf\" or \"auto\""
            )
        say(f"tokenizer backend {requested}: same ids as tokenizers on {result.documents} sampled documents")
        return manifest
    for backend in AUTO_BACKENDS:
        if not backend_installed(backend):
            say(f"tokenizer backend auto: {backend} is not installed")
            continue
        try:
            result = _prove_backend(manifest, backend, where)
        except TokenizerError as exc:
            say(f"tokenizer backend auto: {backend} refused: {exc}")
            continue
        if not result.equal:
            say(f"tokenizer backend auto: {backend} gives other ids on {result.mismatched} of {result.documents} "
                f"sampled documents (first: {result.mismatches[0].describe(backend)})")
            continue
        if result.documents == 0:
            say(f"tokenizer backend auto: no local text document to prove {backend} on; recording hf")
            return record("hf")
        say(f"tokenizer backend auto: {backend} (the fastest proven: same ids as tokenizers on "
            f"{result.documents} sampled documents)")
        return record(backend)
    say("tokenizer backend auto: hf (no faster backend is installed and proven)")
    return record("hf")
