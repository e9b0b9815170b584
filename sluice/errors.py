"""One root exception with typed subclasses.

Every message says what, where (file, object, line, field, step), what was
expected and what was found. The CLI maps any `SluiceError` to exit code 2 and
prints its message; anything else is a bug: the CLI reports it in one line
naming the exception and where it rose, exit 3 (SLUICE_TRACEBACK=1 prints the
traceback).
"""

from __future__ import annotations

import errno as _errno
from dataclasses import dataclass


class SluiceError(Exception):
    """Root of every error sluice raises on purpose."""

    exit_code = 2


class SpecError(SluiceError):
    """A dataset spec or run spec (TOML) is invalid: names file and field."""


class OrderCostError(SpecError):
    """The run's order over raw objects would not fit the decode budget (exit 2, at start)."""


class ManifestError(SluiceError):
    """A manifest is malformed, or an input cannot be frozen into one."""


class SourceReadError(ManifestError):
    """A source object cannot be read or decoded: names object and line/record."""


class ObjectReadError(SourceReadError):
    """The daemon could not read/decode an object of the manifest; `object_location` names it.

    The producer turns it into an ERROR(OBJECT) reply naming the step, with the
    location as a field the client can act on.
    """

    def __init__(self, message: str, object_location: str) -> None:
        super().__init__(message)
        self.object_location = object_location


class Cancelled(Exception):
    """A scan stopped because the caller's stop event was set (SIGINT during freeze).

    Not a SluiceError: it is control flow inside one command, never an input
    error, and the command that set the event turns it into its own exit.
    """


class Stopping(SluiceError):
    """The daemon is stopping (SIGTERM): a step that waited for a document ends here, unserved.

    Raised by the document source once it is interrupted, so a producer waiting
    for a cold fill leaves at once; the producer turns it into a SHUTTING_DOWN
    terminal entry nobody is left to read.
    """


class DigestMismatch(SluiceError):
    """Bytes do not match the digest (or size) a manifest promised."""


class CacheError(SluiceError):
    """The node cache cannot satisfy a request (budget, disk, lock)."""


class ChunkDamaged(DigestMismatch):
    """A cached object's bytes no longer match the chunk digests recorded when it was published.

    `key` is the object's cache key ("b3:<hex>"), `chunk` the index of the first chunk that did
    not match (-1 when the size or the whole-object digest is what differs). The reader must not
    serve what it copied; the object is quarantined and filled again (sluice/cache/chunks.py).
    """

    def __init__(self, message: str, *, key: str, chunk: int) -> None:
        super().__init__(message)
        self.key = key
        self.chunk = chunk


class TokenizerError(SluiceError):
    """A tokenizer file is unreadable or differs from the manifest's identity."""


class TokenizerWorkerError(TokenizerError):
    """A tokenizer worker process died or hung on every try (names the worker, the object, the records)."""

    def __init__(self, message: str, worker: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker  # its process id, when it was known

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return type(self), (str(self), self.worker)


class StateError(SluiceError):
    """A data state is corrupt, from another dataset/run spec, or of another schema."""


class ResizeRefused(StateError):
    """A data state saved by `saved_world_size` ranks resumed on `world_size` ranks under a
    resume contract (`resume`) that promises the same data-parallel size."""

    def __init__(self, message: str, *, resume: str, saved_world_size: int, world_size: int) -> None:
        super().__init__(message)
        self.resume = resume
        self.saved_world_size = saved_world_size
        self.world_size = world_size


class ExhaustedError(SluiceError):
    """A source with exhaustion rule `fail` (or every source under `stop`) ran out."""


class EndOfStream(ExhaustedError):
    """The stream has no further whole step (exhaustion `stop`, or every source renormalized away)."""


class ProtocolError(SluiceError):
    """A wire message is malformed, oversized, of an unknown kind or version."""


class WireError(ProtocolError):
    """A message that cannot be accepted; `code` is one of `sluice.wire.errorcodes.ERROR_CODES`."""

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


class CadenceError(SluiceError):
    """Cadence inputs out of range (negative or zero cost/MTBF): `sluice cadence`, trainer_hooks.cadence."""


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


class CacheWriteError(CacheError):
    """The node cache's disk refused a write (ENOSPC, EDQUOT, EIO, EFBIG, EROFS): the bytes were
    made or read but cannot be kept there. `errno` is the refusal's; readers may serve what was
    made from memory instead (docs/cache.md, "A full disk")."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:  # crosses process pools intact
        return type(self), (str(self), self.errno)


# The write errors that mean "this disk will not keep it" (not a bug, not a bad source): a full disk,
# a quota, a failing device, a file-size limit, a file system remounted read-only.
DISK_REFUSALS = frozenset({_errno.ENOSPC, _errno.EDQUOT, _errno.EIO, _errno.EFBIG, _errno.EROFS})


@dataclass(frozen=True)
class FillReport:
    """What a failed node-cache fill saw: the typed `details` of FillMismatch / FillReadError."""

    digest: str  # the object's digest (its cache key)
    location: str  # as the manifest records it
    source: str  # what was read (the resolved location)
    expected_digest: str
    expected_size: int
    actual_digest: str | None  # of the last try's bytes; None when nothing could be read
    actual_size: int | None  # at most expected_size + 1: a longer source is read no further
    tries: int


class FillMismatch(DigestMismatch):
    """A cache fill never got the promised bytes after all its tries."""

    def __init__(self, message: str, details: FillReport) -> None:
        super().__init__(message)
        self.details = details

    def __reduce__(self) -> tuple[type, tuple[str, FillReport]]:  # crosses process pools intact
        return type(self), (str(self), self.details)


class FillReadError(SourceReadError):
    """A cache fill could not read its source on any try."""

    def __init__(self, message: str, details: FillReport) -> None:
        super().__init__(message)
        self.details = details

    def __reduce__(self) -> tuple[type, tuple[str, FillReport]]:  # crosses process pools intact
        return type(self), (str(self), self.details)


class ObjectMissing(SourceReadError):
    """The store answers that a remote object is not there (HTTP 404, no such key)."""


class MissingExtra(SourceReadError):
    """A location's scheme needs an optional package that is not installed (names the scheme and the
    extra to install). Never retried: installing the package is the only cure."""
