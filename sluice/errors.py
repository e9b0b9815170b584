"""One root exception with typed subclasses.

Every message says what, where (file, object, line, field, step), what was
expected and what was found. The CLI maps any `SluiceError` to exit code 2 and
prints its message; anything else is a bug: the CLI reports it in one line
naming the exception and where it rose, exit 3 (SLUICE_TRACEBACK=1 prints the
traceback).
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


class WireError(ProtocolError):
    """A message that cannot be accepted; `code` is one of `sluice.wire.ERROR_CODES`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DaemonError(SluiceError):
    """loaderd answered ERROR; `code` is the wire error code, `step`/`replica` the request's."""

    def __init__(self, code: str, message: str, *, step: int | None = None, replica: int | None = None) -> None:
        super().__init__(f"loaderd: {code}: {message}")
        self.code = code
        self.step = step
        self.replica = replica


class StartError(SluiceError):
    """loaderd cannot start (a folder it needs cannot be created or opened, ...)."""


class BindError(StartError):
    """loaderd cannot listen on its endpoint (port in use, missing folder, no permission)."""


class DaemonUnavailable(SluiceError):
    """No daemon answered at the endpoint within the reconnect deadline."""


class HandshakeRefused(DaemonError, DaemonUnavailable):
    """loaderd refused the connection handshake: this client lacks the run token or CurveZMQ keys.

    `code` is UNAUTHORIZED; also a DaemonUnavailable (the daemon cannot be used).
    """


class DaemonTimeout(DaemonUnavailable):
    """A live daemon did not deliver a requested micro-batch within the client's bound.

    Fields name what was waited for: `endpoint`, `replica`, `step`, `micro`,
    `waited_s`.
    """

    def __init__(self, *, endpoint: str, replica: int, step: int, micro: int, waited_s: float) -> None:
        super().__init__(
            f"loaderd at {endpoint} did not deliver step {step} micro {micro} of replica {replica} within "
            f"{waited_s:.1f} s (the daemon is alive; raise the client's max_wait_s if steps are this slow)")
        self.endpoint = endpoint
        self.replica = replica
        self.step = step
        self.micro = micro
        self.waited_s = waited_s


class FencedError(SluiceError):
    """A message or commit carries a generation older than the current one."""


class CheckpointError(SluiceError):
    """A checkpoint is damaged, incomplete, or its publish was refused."""


class ObserveError(SluiceError):
    """A live view or post-run report cannot be made: no daemon or metrics at the address given
    (names it), or a ledger/log file that is not what it claims (names file and line)."""


class InternalError(SluiceError):
    """A bug in sluice: an invariant that should be impossible to break."""

    exit_code = 3

    def __init__(self, message: str) -> None:
        super().__init__(f"bug in sluice: {message}")


class EngineError(SluiceError):
    """A distributed engine (Ray) is not installed, cannot be reached, or lost a task beyond its retries."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint that does not fit this trainer (it lacks a stateful the trainer has)."""


class LocationRefused(CacheError):
    """An object's location lies outside the roots the operator allows (`--allow-root`)."""
