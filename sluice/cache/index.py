"""The cache's LMDB index: one environment per process, no pickle, byte keys.

Layout of `<root>/index/` (one LMDB environment, named databases):

| database   | key                          | value                                     |
| ---------- | ---------------------------- | ----------------------------------------- |
| `objects`  | ASCII hex of the cache key   | `IndexRecord` as struct (size, filled_ns, kind, content digest) + source |
| `lru`      | same key                     | `<Q` last use, ns since the epoch         |
| `reserve`  | key of a fill in progress    | `<Q` bytes reserved against the budget    |
| `meta`     | `objects`, `bytes`, `budget` | `<Q`                                      |
| `counters` | counter name                 | `<Q` cumulative over all processes        |
| `chunks`   | same key as `objects`        | per-chunk BLAKE3 of the bytes (chunks.py)  |

Keys are the bytes of the lowercase hex digest, so LMDB's byte order is the
digest order (no string/int confusion). Values are JSON or `struct`, never
pickle. `objects`/`bytes` totals change in the same transaction as the entries
they count, so they are always exact.

One environment per folder per process, shared by all handles (LMDB forbids
opening it twice in a process). It must not be used across a fork:
`Index.env` reopens it when the process ID changed, after closing the
inherited handle (LMDB's close touches only the calling process's reader
slots). Best practice is still to create the NodeCache after forking.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from sluice.cache.lockguard import Membership, check_before_open
from sluice.errors import CacheError, CacheWriteError, InternalError
from sluice.fsutil import reserve_lmdb_lock

INDEX_FORMAT = "sluice-cache-index/1"
_U64 = struct.Struct("<Q")
COUNTERS = (
    "hits",
    "misses",
    "fills",
    "fill_bytes",
    "fill_us",
    "verify_failures",
    "retries",
    "evictions",
    "quarantined",
)
_DBS = (b"objects", b"lru", b"reserve", b"meta", b"counters", b"chunks")
_MAX_READERS = 1024  # LMDB reader slots: processes x threads reading the index at once


_KINDS = ("raw", "derived")
_RECORD = struct.Struct("<BQQB32s")  # version, size, filled_ns, kind, content digest; then source (UTF-8)
_RECORD_VERSION = 1


class IndexRecord(NamedTuple):
    """What the index knows about one published object.

    Encoded with `struct` (the hit path decodes one per fetch, so it must cost
    about a microsecond, hence an immutable NamedTuple rather than a frozen
    dataclass, whose construction costs several): ``<B version, <Q size, <Q filled_ns, <B kind,
    32 bytes of BLAKE3, then the source as UTF-8``.
    """

    size: int
    kind: str  # "raw" (key = content digest) or "derived" (key digests the inputs)
    content: str  # "b3:<hex>" of the file's bytes
    source: str  # where the bytes came from (location, or the derived key's inputs)
    filled_ns: int

    def encode(self) -> bytes:
        head = _RECORD.pack(_RECORD_VERSION, self.size, self.filled_ns, _KINDS.index(self.kind),
                            bytes.fromhex(self.content[3:]))
        return head + self.source.encode("utf-8")

    @classmethod
    def decode(cls, data: bytes, key: bytes) -> IndexRecord:
        try:
            version, size, filled_ns, kind, content = _RECORD.unpack_from(data)
            if version != _RECORD_VERSION:
                raise ValueError(f"record version {version}, expected {_RECORD_VERSION}")
            return cls(size, _KINDS[kind], "b3:" + content.hex(), bytes(data[_RECORD.size:]).decode("utf-8"),
                       filled_ns)
        except (struct.error, ValueError, IndexError) as exc:
            raise CacheError(f"cache index: entry {key.decode(errors='replace')} is corrupt ({exc})") from exc


def u64(data: bytes | None) -> int:
    return _U64.unpack(data)[0] if data else 0


def pack_u64(value: int) -> bytes:
    return _U64.pack(max(0, value))


@dataclass
class _Shared:
    """One process's LMDB environment for one folder, shared by its Index handles."""

    pid: int
    env: Any
    db: dict[bytes, Any]
    users: int = 0
    member: Membership | None = None
    # One write transaction at a time per process: with py-lmdb (2.3), a thread
    # that commits or aborts while another thread of the process waits in
    # begin(write=True) can hang both for good. Threads queue on this lock
    # instead; other processes still queue on LMDB's own writer lock.
    write_mu: threading.Lock = field(default_factory=threading.Lock)


# py-lmdb refuses to open one environment twice in a process, and LMDB forbids
# it anyway, so every Index of a folder shares one environment per process.
_SHARED: dict[str, _Shared] = {}
_SHARED_MU = threading.Lock()


class Index:
    """Per-process handle on `<root>/index`; safe to share between threads.

    Commits are not fsynced by LMDB itself (the environment is shared by every
    NodeCache of the process, durable or not): a durable caller calls `sync()`
    after a commit that must survive power loss. LMDB stays consistent after a
    process crash (kill -9) either way.
    """

    def __init__(self, root: Path, *, map_size: int = 1 << 30) -> None:
        self.path = root / "index"
        self._map_size = map_size
        self._pid = -1
        self._shared: _Shared | None = None
        self._env: Any = None
        self.db: dict[bytes, Any] = {}

    @property
    def env(self) -> Any:
        if self._pid != os.getpid():
            self._attach()
        return self._env

    def _attach(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        pid = os.getpid()
        with _SHARED_MU:
            if self._pid == pid:
                return
            shared = _SHARED.get(key)
            if shared is not None and shared.pid != pid:
                # Inherited over a fork: close it before opening our own. LMDB's
                # close clears only the calling PID's reader slots and unmaps the
                # child's copy, leaving the parent's environment untouched.
                del _SHARED[key]
                if shared.member is not None:
                    shared.member.close()  # the parent's lock lives on through its own descriptor
                shared.env.close()
                shared = None
            if shared is None:
                shared = self._open_env()
                _SHARED[key] = shared
            shared.users += 1
            self._shared, self._env, self.db, self._pid = shared, shared.env, shared.db, pid

    def _open_env(self) -> _Shared:
        check_before_open(self.path)
        try:
            reserve_lmdb_lock(self.path, _MAX_READERS)  # a full disk: an error here, not SIGBUS in LMDB
        except OSError as exc:
            raise CacheWriteError(f"cache index {self.path}: cannot make its lock file ({exc.strerror}); free "
                                  "space on the cache's disk", exc.errno) from exc
        try:
            env = lmdb.open(str(self.path), map_size=self._map_size, max_dbs=len(_DBS), subdir=True,
                            readahead=False, max_readers=_MAX_READERS, sync=False, metasync=False, mode=0o600)
            for name in ("data.mdb", "lock.mdb"):  # private whatever the umask
                os.chmod(self.path / name, 0o600)
        except lmdb.Error as exc:
            raise CacheError(f"cache index {self.path}: cannot open ({exc})") from exc
        db = {name: env.open_db(name) for name in _DBS}
        with env.begin(write=True, db=db[b"meta"]) as txn:
            fmt = txn.get(b"format")
            if fmt is None:
                txn.put(b"format", INDEX_FORMAT.encode())
            elif fmt.decode(errors="replace") != INDEX_FORMAT:
                env.close()
                raise CacheError(f"cache index {self.path}: format {fmt!r}, this sluice reads {INDEX_FORMAT!r}")
        env.reader_check()  # free reader slots left by killed processes
        return _Shared(pid=os.getpid(), env=env, db=db, member=Membership(self.path))

    def sync(self) -> None:
        """Flush committed transactions to disk (fsync)."""
        self.env.sync(True)

    def read(self) -> Any:
        return self.env.begin(write=False)

    @contextlib.contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction; a full LMDB map or a full disk becomes a CacheError that says what to do."""
        env = self.env  # attaches on first use, which sets self._shared
        shared = self._shared
        if shared is None or shared.member is None:
            raise InternalError(f"cache index {self.path}: a write on a handle that is not attached")
        shared.member.check()
        try:
            with shared.write_mu, env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as exc:
            raise CacheError(
                f"cache index {self.path}: the LMDB map ({self._map_size} bytes) is full; "
                "run `sluice cache gc` with a smaller --budget, or use a fresh cache folder"
            ) from exc
        except lmdb.DiskError as exc:  # the disk under the cache is full (ENOSPC): nothing was committed
            raise CacheError(f"cache index {self.path}: a write was not committed ({exc}); free space on the "
                             "cache's disk or run `sluice cache gc` with a smaller --budget") from exc

    def get(self, txn: Any, key: bytes) -> IndexRecord | None:
        data = txn.get(key, db=self.db[b"objects"])
        return None if data is None else IndexRecord.decode(data, key)

    def put(self, txn: Any, key: bytes, rec: IndexRecord, now_ns: int) -> None:
        """Insert `rec` (must be new) and count it in the totals."""
        if not txn.put(key, rec.encode(), db=self.db[b"objects"], overwrite=False):
            raise CacheError(f"cache index: {key.decode()} is already published")
        txn.put(key, pack_u64(now_ns), db=self.db[b"lru"])
        self.add_meta(txn, objects=1, nbytes=rec.size)

    def delete(self, txn: Any, key: bytes) -> IndexRecord | None:
        rec = self.get(txn, key)
        if rec is None:
            return None
        txn.delete(key, db=self.db[b"objects"])
        txn.delete(key, db=self.db[b"lru"])
        txn.delete(key, db=self.db[b"chunks"])
        self.add_meta(txn, objects=-1, nbytes=-rec.size)
        return rec

    def get_chunks(self, txn: Any, key: bytes) -> bytes | None:
        """The encoded chunk digests of a published object (chunks.decode_chunks), or None if none were recorded."""
        data = txn.get(key, db=self.db[b"chunks"])
        return None if data is None else bytes(data)

    def put_chunks(self, txn: Any, key: bytes, value: bytes) -> None:
        txn.put(key, value, db=self.db[b"chunks"])

    def items(self, txn: Any) -> Iterator[tuple[bytes, IndexRecord]]:
        for key, value in txn.cursor(db=self.db[b"objects"]):
            yield bytes(key), IndexRecord.decode(value, bytes(key))

    def last_use(self, txn: Any) -> dict[bytes, int]:
        return {bytes(k): u64(v) for k, v in txn.cursor(db=self.db[b"lru"])}

    def touch(self, txn: Any, touches: Mapping[bytes, int]) -> None:
        lru = self.db[b"lru"]
        objects = self.db[b"objects"]
        for key, ns in touches.items():
            if txn.get(key, db=objects) is not None and u64(txn.get(key, db=lru)) < ns:
                txn.put(key, pack_u64(ns), db=lru)

    def add_meta(self, txn: Any, *, objects: int = 0, nbytes: int = 0) -> None:
        meta = self.db[b"meta"]
        if objects:
            txn.put(b"objects", pack_u64(u64(txn.get(b"objects", db=meta)) + objects), db=meta)
        if nbytes:
            txn.put(b"bytes", pack_u64(u64(txn.get(b"bytes", db=meta)) + nbytes), db=meta)

    def meta(self, txn: Any, name: bytes) -> int:
        return u64(txn.get(name, db=self.db[b"meta"]))

    def set_meta(self, txn: Any, name: bytes, value: int) -> None:
        txn.put(name, pack_u64(value), db=self.db[b"meta"])

    def add_counters(self, txn: Any, deltas: Mapping[str, int]) -> None:
        db = self.db[b"counters"]
        for name, delta in deltas.items():
            if delta:
                key = name.encode()
                txn.put(key, pack_u64(u64(txn.get(key, db=db)) + delta), db=db)

    def counters(self, txn: Any) -> dict[str, int]:
        db = self.db[b"counters"]
        return {name: u64(txn.get(name.encode(), db=db)) for name in COUNTERS}

    def reservations(self, txn: Any) -> dict[bytes, int]:
        return {bytes(k): u64(v) for k, v in txn.cursor(db=self.db[b"reserve"])}

    def reserve(self, txn: Any, key: bytes, nbytes: int) -> None:
        txn.put(key, pack_u64(nbytes), db=self.db[b"reserve"])

    def unreserve(self, txn: Any, key: bytes) -> None:
        txn.delete(key, db=self.db[b"reserve"])

    def close(self) -> None:
        """Release this handle; the environment closes with the process's last handle."""
        with _SHARED_MU:
            shared, self._shared = self._shared, None
            if shared is not None and shared.pid == os.getpid():
                shared.users -= 1
                if shared.users == 0:
                    key = os.path.realpath(self.path)
                    if _SHARED.get(key) is shared:
                        del _SHARED[key]
                    if shared.member is not None:
                        shared.member.close()
                    shared.env.close()
            self._env = None
            self._pid = -1
