"""One root exception with typed subclasses.

Every message says what, where (file, object, line, field, step), what was
expected and what was found. The CLI maps any `SluiceError` to exit code 2 and
prints its message; anything else is a bug and gets a traceback.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Root of every error sluice raises on purpose."""

    exit_code = 2


class SpecError(SluiceError):
    """A dataset spec or run spec (TOML) is invalid: names file and field."""


class ManifestError(SluiceError):
    """A manifest is malformed, or an input cannot be frozen into one."""


class SourceReadError(ManifestError):
    """A source object cannot be read or decoded: names object and line/record."""


class DigestMismatch(SluiceError):
    """Bytes do not match the digest (or size) a manifest promised."""


class CacheError(SluiceError):
    """The node cache cannot satisfy a request (budget, disk, lock)."""


class TokenizerError(SluiceError):
    """A tokenizer file is unreadable or differs from the manifest's identity."""


class StateError(SluiceError):
    """A data state is corrupt, from another dataset/run spec, or of another schema."""


class ExhaustedError(SluiceError):
    """A source with exhaustion rule `fail` (or every source under `stop`) ran out."""


class EndOfStream(ExhaustedError):
    """The stream has no further whole step (exhaustion `stop`, or every source renormalized away)."""


class ProtocolError(SluiceError):
    """A wire message is malformed, oversized, of an unknown kind or version."""


class FencedError(SluiceError):
    """A message or commit carries a generation older than the current one."""


class CheckpointError(SluiceError):
    """A checkpoint is damaged, incomplete, or its publish was refused."""


class InternalError(SluiceError):
    """A bug in sluice: an invariant that should be impossible to break."""

    exit_code = 3

    def __init__(self, message: str) -> None:
        super().__init__(f"bug in sluice: {message}")


class LocationRefused(CacheError):
    """An object's location lies outside the roots the operator allows (`--allow-root`)."""
