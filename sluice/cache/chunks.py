"""Per-chunk BLAKE3 digests of cached objects, and the guard that checks served bytes against them.

A cached object is verified on its way into the cache (the fill's digest) and
on its way out: its bytes are cut in fixed chunks of `VERIFY_CHUNK` bytes
(the last one shorter), the BLAKE3 of every chunk is recorded when the object
is published (the index's `chunks` table), and a reader checks the chunks of
its pinned file against them:

* when it first maps or reads the object (`ChunkGuard.ensure`: every chunk,
  one pass at hashing speed, ~4.7 GB/s a core);
* again after the file changed (`ChunkGuard.check`): a cheap `fstat` compares
  the file's mtime and ctime with what they were when the chunks were last
  verified (the descriptor's inode cannot change, and a truncation or a chmod
  moves ctime too). A write to the file moves its mtime before its bytes
  change (the kernel stamps the file, then copies the data), so a reader that
  copied bytes and then finds the stamp unchanged copied verified bytes;
  the daemon's producer makes exactly that check after every call, before a
  step leaves it (docs/cache.md, "Verified on the way out").

A mismatch raises `ChunkDamaged` naming the object, its file, the chunk and
its byte range, the expected and the actual digest; the caller quarantines the
object (`NodeCache.quarantine_damaged`) and has it filled again.

Why chunks rather than the whole-object digest: a damaged chunk is named (an
operator can see which bytes rotted), and objects published before chunk
digests existed get them from one verified pass (`ensure` of an object without
them compares the whole digest and records its chunks for the next reader).
Damage that leaves the timestamps alone (bit rot under the page cache) is
found by the next reader that maps the object, by `sluice cache verify`, and
by the daemon's scrubber (`loaderd --scrub-rate`).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence

import blake3

from sluice.errors import CacheError, ChunkDamaged

VERIFY_CHUNK = 1 << 20  # bytes per verified chunk: 32 bytes of digest per MiB (32 KiB for a 1 GiB object)
_HEAD = struct.Struct("<BI")  # record version, chunk bytes; then 32 bytes per chunk
_VERSION = 1
_DIGEST = 32


def encode_chunks(chunk: int, digests: Sequence[bytes]) -> bytes:
    """The index value of an object's chunk digests."""
    return _HEAD.pack(_VERSION, chunk) + b"".join(digests)


def decode_chunks(data: bytes, key: str) -> tuple[int, tuple[bytes, ...]]:
    """(chunk bytes, digests) of an index value; CacheError naming the object if it is malformed."""
    if len(data) < _HEAD.size or (len(data) - _HEAD.size) % _DIGEST:
        raise CacheError(f"cache index: the chunk digests of object {key} are corrupt ({len(data)} bytes)")
    version, chunk = _HEAD.unpack_from(data)
    if version != _VERSION or chunk < 4096:
        raise CacheError(f"cache index: the chunk digests of object {key} have version {version}, chunk {chunk}")
    body = data[_HEAD.size:]
    return chunk, tuple(bytes(body[i:i + _DIGEST]) for i in range(0, len(body), _DIGEST))


def chunk_count(size: int, chunk: int = VERIFY_CHUNK) -> int:
    return -(-size // chunk) if size else 0


class ChunkHasher:
    """BLAKE3 of every `chunk`-byte piece of a stream fed in arbitrary pieces (a fill's buffers)."""

    def __init__(self, chunk: int = VERIFY_CHUNK) -> None:
        self.chunk = chunk
        self.digests: list[bytes] = []
        self._hash = blake3.blake3()
        self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.chunk - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk:
                self.digests.append(self._hash.digest())
                self._hash, self._filled = blake3.blake3(), 0

    def finish(self) -> tuple[bytes, ...]:
        if self._filled:
            self.digests.append(self._hash.digest())
            self._hash, self._filled = blake3.blake3(), 0
        return tuple(self.digests)


def _chunks_of(fd: int, size: int, chunk: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) of every `chunk`-byte piece of the first `size` bytes of an open file, read with
    positioned reads into one reused buffer. Not a memory map: a file truncated meanwhile (a stray writer)
    then reads short, which raises ChunkDamaged, instead of killing the process with SIGBUS."""
    buf = bytearray(min(chunk, size))
    view = memoryview(buf)
    for lo in range(0, size, chunk):
        n = min(chunk, size - lo)
        got = os.preadv(fd, [view[:n]], lo)
        if got != n:
            raise ChunkDamaged(f"file of {size} bytes read short at {lo + got} (truncated while it was verified)",
                               key="", chunk=lo // chunk)
        yield lo, view[:n]


def hash_file_chunks(fd: int, size: int, chunk: int = VERIFY_CHUNK) -> tuple[str, tuple[bytes, ...]]:
    """("b3:<hex>" of the whole file, chunk digests) of the first `size` bytes of an open file, one pass.
    Raises ChunkDamaged (key "") if the file is shorter than `size`."""
    whole = blake3.blake3()
    digests = []
    for _, part in _chunks_of(fd, size, chunk):
        whole.update(part)
        digests.append(blake3.blake3(part).digest())
    return "b3:" + whole.hexdigest(), tuple(digests)


Signature = tuple[int, int, int, int]


def signature(fd: int) -> Signature:
    """What changes when a file's bytes are written, replaced or truncated: inode, size, mtime, ctime (ns)."""
    st = os.fstat(fd)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ChunkGuard:
    """The served bytes of one pinned cached object, checked against its chunk digests.

    Holds its own descriptor of the object's file (a `dup` of the pin's), so it
    stays usable while the reader keeps it, and closes it in `close`. Thread
    safe. `digests` None: the object was published before chunk digests
    existed; the first `ensure` compares the whole digest (`content`) and
    learns them (`on_learned(chunk, digests)` records them in the index).
    """

    def __init__(self, fd: int, *, key: str, path: str, size: int, content: str, chunk: int,
                 digests: tuple[bytes, ...] | None,
                 on_learned: Callable[[int, tuple[bytes, ...]], None] | None = None) -> None:
        self.key, self.path, self.size, self.content = key, path, size, content
        self.chunk = chunk
        self.digests = digests
        self._fd = fd
        self._on_learned = on_learned
        self._mu = threading.Lock()
        self._verified: Signature | None = None  # the file's signature when its chunks were last verified
        self.verifications = 0  # full passes made (the first one and one after each change)

    def fileno(self) -> int:
        return self._fd

    @property
    def verified(self) -> bool:
        return self._verified is not None

    def ensure(self) -> None:
        """Verify every chunk unless they were verified and the file has not changed since; raise
        ChunkDamaged naming the first bad chunk."""
        with self._mu:
            if self._verified is not None and self._fd >= 0 and signature(self._fd) == self._verified:
                return
            self._verify()

    def check(self) -> bool:
        """True if the file is unchanged since its chunks were verified (one fstat); otherwise verify them
        again and return False (the caller's copies may predate the change: make them again), or raise
        ChunkDamaged."""
        verified = self._verified
        if verified is not None:  # the common case, without the lock (the producer asks once a call per object)
            try:
                st = os.fstat(self._fd)
            except OSError:  # closed meanwhile: the locked path below says so
                pass
            else:  # (an open descriptor keeps its inode; any write, truncation or chmod moves ctime)
                if st.st_ctime_ns == verified[3] and st.st_mtime_ns == verified[2]:
                    return True
        with self._mu:  # (closed meanwhile: `_verify` raises CacheError, never an OSError from fstat(-1))
            if self._verified is not None and self._fd >= 0 and signature(self._fd) == self._verified:
                return True
            self._verify()
            return False

    def verify_now(self) -> int:
        """Verify every chunk now, changed or not (a scrub: damage that left the timestamps alone, such as bit
        rot surfacing when a page is read from disk again); returns the bytes hashed. Raises ChunkDamaged."""
        with self._mu:
            self._verify()
            return self.size

    def _verify(self) -> None:
        if self._fd < 0:
            raise CacheError(f"object {self.key}: its chunk guard was closed")
        sig = signature(self._fd)  # before hashing: a change while hashing shows at the next check
        self.verifications += 1
        if sig[1] != self.size:
            raise ChunkDamaged(self._what(f"its file is {sig[1]} bytes, the cache recorded {self.size}"),
                               key=self.key, chunk=-1)
        if self.digests is None:
            try:
                whole, digests = hash_file_chunks(self._fd, self.size, self.chunk)
            except ChunkDamaged as exc:
                raise ChunkDamaged(self._what(str(exc)), key=self.key, chunk=exc.chunk) from None
            if whole != self.content:
                raise ChunkDamaged(self._what(f"its bytes hash to {whole}, the cache recorded {self.content} "
                                              "(no chunk digests were recorded for it)"), key=self.key, chunk=-1)
            self.digests = digests
            if self._on_learned is not None:
                try:
                    self._on_learned(self.chunk, digests)
                except CacheError:  # (a full or read-only index: the next reader learns them again)
                    pass
            self._verified = sig
            return
        if len(self.digests) != chunk_count(self.size, self.chunk):
            raise CacheError(f"object {self.key}: {len(self.digests)} chunk digests recorded for "
                             f"{self.size} bytes in chunks of {self.chunk}")
        try:
            for lo, part in _chunks_of(self._fd, self.size, self.chunk):
                i = lo // self.chunk
                got = blake3.blake3(part).digest()
                if got != self.digests[i]:
                    raise ChunkDamaged(self._what(
                        f"chunk {i} (bytes {lo}..{lo + len(part)}) hashes to b3:{got.hex()}, recorded "
                        f"b3:{self.digests[i].hex()}"), key=self.key, chunk=i)
        except ChunkDamaged as exc:
            if exc.key:
                raise
            raise ChunkDamaged(self._what(str(exc)), key=self.key, chunk=exc.chunk) from None
        self._verified = sig

    def _what(self, detail: str) -> str:
        return f"cached object {self.key} ({self.path}) was changed after it was verified: {detail}"

    def close(self) -> None:
        with self._mu:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"ChunkGuard({self.key}, {self.size} bytes, {'verified' if self.verified else 'unverified'})"
