"""Cache keys and the streaming BLAKE3 hashers a fill feeds while it copies.

Whole files are hashed by `sluice.fsutil.hash_file` (the repository's one file
hasher); this module holds what is particular to the cache: the key of a
derived object, and two ways to hash a stream of chunks during a copy.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import blake3

from sluice.cache.chunks import ChunkHasher
from sluice.errors import CacheError, ManifestError
from sluice.manifest.canonical import canonical_bytes, digest_id

DERIVED_KIND = "sluice.derived/1"
# Observer of a fill's bytes: called with (chunk, offset) for every chunk hashed, in order, from
# offset 0, on the hashing thread, while the chunk's buffer is valid (it must keep no reference to
# it). A new try of the fill starts again at offset 0. What it computes is worth something only
# once the fill's digest matched (the fill returned); see `NodeCache.fetch(observe=...)`.
Observer = Callable[[memoryview, int], None]
_DIGEST_RE = re.compile(r"b3:[0-9a-f]{64}")


def key_hex(digest: str, where: str) -> str:
    """The 64 hex of a "b3:<hex>" digest or key; CacheError naming `where` otherwise."""
    if not (isinstance(digest, str) and _DIGEST_RE.fullmatch(digest)):
        raise CacheError(f"{where}: {digest!r} is not a digest of the form b3:<64 lowercase hex>")
    return digest[3:]


def derived_source(key_inputs: Mapping[str, Any]) -> str:
    """The canonical JSON text a derived key digests (recorded as the entry's source)."""
    if "kind" in key_inputs:
        raise CacheError("derived key inputs: the field name 'kind' is reserved")
    try:
        return canonical_bytes({"kind": DERIVED_KIND, **key_inputs}).decode()
    except ManifestError as exc:
        raise CacheError(f"derived key inputs {dict(key_inputs)!r}: {exc}") from exc


def derived_digest(key_inputs: Mapping[str, Any]) -> str:
    """Cache key ("b3:<hex>") of a derived object: BLAKE3 of its canonical inputs."""
    return digest_id(derived_source(key_inputs).encode())


class InlineHasher:
    """BLAKE3 of a stream of chunks, hashed in the caller's thread from one buffer.

    The cheapest in CPU (the chunk is hashed while it is hot in this core's
    cache), hence the default: a loader node's cores are busy decoding and
    tokenizing, and concurrent fills of different objects give the parallelism.
    """

    def __init__(self, chunk: int, observe: Observer | None = None) -> None:
        self._hash = blake3.blake3()
        self.chunks = ChunkHasher()  # the per-chunk digests verified on the way out (chunks.py)
        self._buf = memoryview(bytearray(chunk))
        self._observe = observe
        self._offset = 0  # bytes hashed so far (the next chunk's offset, for the observer)

    def _update(self, chunk: memoryview) -> None:
        self._hash.update(chunk)
        self.chunks.update(chunk)
        if self._observe is not None:
            self._observe(chunk, self._offset)
        self._offset += len(chunk)

    def free_buffer(self) -> memoryview:
        return self._buf

    def give_back(self, buf: memoryview) -> None:
        pass

    def feed(self, chunk: memoryview, buf: memoryview) -> None:
        self._update(chunk)

    def finish(self) -> str:
        return "b3:" + self._hash.hexdigest()


class ThreadHasher(InlineHasher):
    """BLAKE3 of a stream of chunks, hashed on a second thread from a fixed buffer pool.

    Bounded: four buffers of `chunk` bytes. The reader takes a free buffer,
    fills it, hands it to `feed` and writes it; the hashing thread returns it
    to the pool when done, so a buffer is never refilled before it is hashed.
    Faster in wall time when a core is idle; costs more CPU in total (the
    bytes move between cores), so it is slower on a busy machine.
    """

    _BUFFERS = 4

    def __init__(self, chunk: int, observe: Observer | None = None) -> None:
        self._hash = blake3.blake3()
        self.chunks = ChunkHasher()
        self._observe = observe
        self._offset = 0
        self._error: BaseException | None = None
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(self._BUFFERS):
            self._free.put(memoryview(bytearray(chunk)))
        self._work: queue.Queue[tuple[memoryview, memoryview] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sluice-cache-hash", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            chunk, buf = item
            try:
                if self._error is None:
                    self._update(chunk)
            except BaseException as exc:  # raised again by `finish`, in the filling thread
                self._error = exc
            self._free.put(buf)

    def free_buffer(self) -> memoryview:
        return self._free.get()

    def give_back(self, buf: memoryview) -> None:
        self._free.put(buf)

    def feed(self, chunk: memoryview, buf: memoryview) -> None:
        self._work.put((chunk, buf))

    def finish(self) -> str:
        if not self._done:
            self._done = True
            self._work.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        return "b3:" + self._hash.hexdigest()

