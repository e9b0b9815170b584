"""The `DocTokens` callback of the logical plane: tokens from the node cache, or tokenized in chunks.

The unit of work is one object (a jsonl/parquet/tar file or a `.sltok`
shard); the unit of *availability* is a chunk of it. For a text object a
worker first asks the node cache for the object's tokens (a derived object,
`sluice.tokenize.tokcache`): on a hit it memory-maps them and no tokenizer
runs. On a miss it streams the raw object in bounded chunks (about 1 MiB of
decoded input each), encodes each chunk and appends it to the token shard the
cache will publish; a document is served as soon as its chunk is written,
read back from that file. When the object is done the cache publishes the
shard (digest recorded, counted in the cache budget, shared by every process
on the node) and the entry switches to the memory map. So a restart, a new
epoch or a second daemon on the node never tokenizes that object again.

    prefetch(refs)  ->  one work item per distinct object, in need order,
                        at most `max_inflight` objects in progress; records
                        beyond an object's fill go to its demand task; True
                        (settled) when every object named is done already
    __call__(ref)   ->  the object's entry; a record the fill wrote is read back,
                        one beyond it waits for the demand task to make it

Out of order (demand.py, sluice/tokenize/records.py): the fill goes front to
back, but a step in `block` or `global` order needs documents from anywhere in
the object. A record beyond the fill's position is read alone, by counting
lines rather than parsing them, encoded with the other records asked for (a
step's, and the next steps' from prefetch), and served from memory until
the fill passes it; the fill still writes every document, so the cache gets
the whole object. So the first step of a 1 GB object waits for one fill of
the raw object, not for its tokenization; for a plain jsonl object the line
count comes from that fill (a `StagedIndexer` observing it, tied to the
digest: sluice/tokenize/lineindex.py), and kept in the node cache, so a
restarted or second daemon whose raw fetch is a hit reads it instead of
counting (lineindexes.py; a hit without one has it built once, off the
serving path, for the next). What the packers
need comes first: between its chunks a fill waits while demand tasks run
(until none ran for demandtasks.py's `_QUIET_S`, at most `demand.YIELD_S`), unless its chunks
are cheap (`demand.FillPace`: a fast backend's fill does not wait); its chunk,
`FILL_CHUNK_BYTES`, is the longest a demand batch waits for the tokenizer's
thread pool. Documents the demand made and still holds when the fill reaches
them are written as they are (`demand.FillEncoder`): each is tokenized once.

Bounds and policies:

* Memory per object in progress: one chunk of texts and its encodings
  (`chunk_bytes`, default `FILL_CHUNK_BYTES`, of decoded input, measured ~40 bytes of peak RSS per input
  byte with `tokenizers`), whatever the object's size or compression ratio;
  a single document larger than a chunk is encoded whole.
* Entries: every finished entry is charged `ENTRY_COST` (a map and a
  descriptor; the tokens live in the page cache), an entry whose tokens the
  node cache could not keep (budget, disk) is charged its file size: its
  unlinked spool file is held on disk. Least recently used finished entries
  are dropped past `budget_bytes` or entrytable.py's `_MAX_ENTRIES` entries; an object dropped and needed again is read
  from the cache (or tokenized again), never different.
* Pins: an entry holds its cache pin, so the cache cannot evict bytes we map.
* Line indexes of raw fills: by digest, least recently used dropped past
  `lineindexes.MAX_BYTES` of marks; while a fill runs, its indexer's staging
  buffers (4 MiB). They are node-cache objects too (counted in its budget).
* Out of order, per object in progress: at most `demand.SIDE_BYTES` of token
  arrays in memory, then a spill file (`demand.SPILL_BYTES` of disk,
  `demand.SPILL_DOCS` documents), each prefetching thread's last prefetch's records (a thread's
  prefetch replaces its own last one: work for a position a RESTORE left is
  dropped before it starts; other replicas' announcements are kept), and the
  locator's bounds (one 64 KiB window, 24 bytes per window indexed; a
  compressed object's decoded bytes spooled to an unlinked file up to the
  furthest record asked for).

Workers are threads: `tokenizers` releases the GIL in `encode_batch` and
parallelises internally, zstd/pyarrow decode release it too; docs/loaderd.md
has the measurement behind this choice. With `worker_kind="process"` a
worker process tokenizes and writes the shard; the thread holds the cache's
fill lock, serves chunks as the worker reports them (fills.py, `_remote`) and publishes.

Errors: a corrupt or missing object (after the cache's retries and quarantine)
raises `ObjectReadError`, which names the object, its source and the digest;
the pipeline turns it into an ERROR(OBJECT) reply naming the step too.

Layout: `DocSource` here is the facade the daemon calls (its state, made in
`__init__` under one lock and one set of counters; reading a document,
stopping, the served-bytes checks); its work is in four parts it inherits,
each a module: the entry table (entrytable.py: make, find, charge, evict and
drop entries), the fills (fills.py: map or make an entry's tokens, the raw
pin, the fill worker hand-off), the demand path (demandtasks.py: records
beyond the fill, made out of order, and the fill's pause for them) and the
announcements (announce.py: prefetch, and stale objects after a RESTORE).
The entry's state machine is entry.py, the out-of-order state and the fill's
reuse of it demand.py, the demand's worker processes demandpool.py, and the
tokenizing itself lives in sluice.tokenize.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from sluice.errors import SluiceError, Stopping
from sluice.loaderd.physical.announce import Announcements
from sluice.loaderd.physical.demandtasks import DemandTasks
from sluice.loaderd.physical.entry import Entry as _Entry
from sluice.loaderd.physical.entry import Evicted as _Evicted
from sluice.loaderd.physical.entrytable import EntryTable
from sluice.loaderd.physical.fillprocs import FillProcesses, worker_init
from sluice.loaderd.physical.fills import Fills
from sluice.loaderd.physical.lineindexes import LineIndexes
from sluice.loaderd.physical.served import ServedBytes

# A fill's chunk is the longest a demand batch waits for the tokenizer's thread
# pool (it is shared by the process): 256 KiB is about 60k tokens, tens of ms.
FILL_CHUNK_BYTES = 256 << 10

class DocSource(Announcements, DemandTasks, Fills, EntryTable):
    """Thread-safe `DocTokens` implementation over a NodeCache and an Encoder."""

    def __init__(
        self,
        manifest: Any,
        cache: Any,
        encoder: Any | None,
        *,
        budget_bytes: int = 256 << 20,
        workers: int = 2,
        max_inflight: int = 8,
        metrics: Any = None,
        worker_kind: str = "thread",
        chunk_bytes: int = FILL_CHUNK_BYTES,
        demand_workers: int = 0,
        scrub_rate: int = 0,
        tokenizer_threads: int | None = None,
    ) -> None:
        self.manifest = manifest
        self.cache = cache
        self.jit: Any = None  # the fused path's KernelLoader (physical/jitload.py), set by open_data_path
        self.encoder = encoder
        self.budget_bytes = budget_bytes
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loaderd-worker")
        # Records far beyond an object's fill are tokenized out of order here (demand.py).
        self._demands = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="loaderd-demand")
        # Per prefetching thread (one per replica's producer): the entries holding its announced
        # records; each prefetch replaces its own caller's, never another's. Guarded by `_lock`.
        self._ahead: dict[int, set[_Entry]] = {}
        # After a RESTORE: the objects of each prefetching thread's last window, and the threads
        # restored since their last prefetch (see `restored`); guarded by `_lock`.
        self._windows: dict[int, frozenset[tuple[int, int]]] = {}
        self._restoring: set[int] = set()
        self.fill_reused_docs = 0  # documents a fill took from the demand path instead of tokenizing them
        self.stale_fills_stopped = 0  # fills stopped because a RESTORE left their object behind
        self.stale_records_dropped = 0  # announced records of such objects dropped before being made
        self._busy = threading.Condition()  # guards the two below
        self._demanding = 0  # demand tasks scheduled or running
        self._quiet_since = 0.0  # when the last one ended
        self.demanded_docs = 0  # documents tokenized out of order (before their object's fill reached them)
        # Of the documents handed to packers, those a packer waited for on the demand path (not made
        # ahead from an announcement): a measure of how far the prefetch announcements keep ahead.
        self.demand_waited_docs = 0
        self._waited_lock = threading.Lock()  # (taken under an entry's lock: no other lock inside)
        # Of those, tokenized again by the fill (docs/tokenize.md, "Each document tokenized once"): made
        # after the fill had passed them, or dropped past `demand.SIDE_BYTES` and the spill's bounds.
        self.demand_late_docs = 0
        self.side_dropped_docs = 0
        self.spilled_docs = 0  # parked past demand.SIDE_BYTES: spilled to disk, read back by the fill
        self.indexed_objects = 0  # objects located out of order with the line index of their raw fill
        # demand_workers > 0: the demand tasks' reading and encoding runs in that many worker
        # processes (demandpool.py); 0: in the demand threads themselves.
        self._dpool: Any = None  # started with the first object that needs the demand path
        if demand_workers < 0:
            raise SluiceError(f"loaderd: demand workers {demand_workers} must be >= 0")
        self._dpool_workers = demand_workers
        # The encoder threads this process was given (None: its environment's); worker processes share them.
        self.tokenizer_threads = tokenizer_threads
        self._dpool_lock = threading.Lock()
        # worker_kind "process": tokenizing text objects (and their GIL-held
        # JSON/parquet decoding) runs in `workers` processes that fill the node
        # cache; the threads above wait for them and map the result.
        self._procs: Any = None
        if worker_kind == "process" and any(src.format != "tokens" for src in manifest.sources):
            self._procs = FillProcesses(
                workers, worker_init,
                (manifest, str(cache.root), cache.budget_bytes, cache.verify_on_read, chunk_bytes,
                 getattr(cache, "allowed_roots", None),  # every miss checked in the workers too
                 self._threads_each(workers)))
        elif worker_kind not in ("thread", "process"):
            raise SluiceError(f"loaderd: worker kind {worker_kind!r} is not 'thread' or 'process'")
        # Line indexes of plain jsonl objects made by their raw fills, in memory and in the node cache.
        self.line_indexes = LineIndexes(cache)
        self._closing = threading.Event()  # a fill in progress stops at its next chunk
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._stride = max([len(src.objects) for src in manifest.sources] + [1])  # (source, object) -> one int
        self._running: set[tuple[int, int]] = set()
        # `all_done`: the LRU's changes (an entry made, finished or dropped) and the answer at the last count
        self._objects = sum(len(src.objects) for src in manifest.sources)
        self._changes = 0
        self._all_done: tuple[int, bool] = (-1, False)
        self.nbytes = 0
        self.calls = 0  # documents handed to the packer (for the prefetch estimate)
        self.hits = 0
        self.misses = 0
        self.tokenized_objects = 0  # objects this DocSource tokenized (0 when the node cache had them all)
        # A full node-cache disk (docs/cache.md, "A full disk"): token fills served from memory or from
        # their unlinked file, by `Filled.held` (objects whose out-of-order reading stopped: the metric). Each
        # object's first such event is logged (`_noted`), the later ones only counted.
        self.not_kept: dict[str, int] = {"memory": 0, "spool": 0}
        self._noted: set[tuple[str, tuple[int, int]]] = set()
        self.cached_objects = 0  # text objects whose tokens came from the node cache
        needs_tokenizer = any(s.format != "tokens" for s in manifest.sources)
        if needs_tokenizer and encoder is None:
            raise SluiceError(f"manifest {manifest.name!r}: text sources need a tokenizer, none was loaded")
        # What this source serves, verified on its way out of the node cache (served.py); last: its scrubber
        # reads the entries. `_reads` is its per-thread record of the entries read (the read path's one store).
        self.served = ServedBytes(self, self._metrics, scrub_rate=scrub_rate)
        self._reads = self.served.reads

    def interrupt(self) -> None:
        """Begin to stop (the daemon got SIGTERM): from now on a packer waiting for a document, or asking
        for one not yet made, gets `Stopping` at once instead of waiting for a fill; fills and demand tasks
        stop at their next chunk or batch. Never waits; `close` then releases everything."""
        with self._lock:
            self._closing.set()  # under the lock: `_entry` makes no entry after this
            entries = list(self._lru.values())
        for entry in entries:  # readers in `Entry.doc` wake (Evicted) and meet `_closing`
            entry.close()
        with self._busy:
            self._busy.notify_all()  # a fill paused between chunks (`_between_chunks`) goes on to stop

    def close(self, timeout_s: float | None = None) -> list[str]:
        """Stop the workers and release every entry.

        `timeout_s` None: wait for the running tasks (each stops at its next
        chunk or batch) and let worker processes finish theirs. Else wait at most
        `timeout_s` seconds in all (the daemon stops: docs/loaderd.md,
        "Stopping"): worker processes are terminated (killed if they do not go),
        and the names of the threads still running a task after that (a tokenizer
        call or a raw fetch that does not look at the stop flag) are returned for
        the caller to report; empty when everything stopped.
        """
        from sluice.procpool import stop_threads

        deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s

        def left_s() -> float | None:
            return None if timeout_s is None else max(0.0, deadline - time.monotonic())

        self.interrupt()
        self.served.stop(left_s())
        if self.jit is not None:  # a compile child must not outlive the daemon
            self.jit.close()
        left = stop_threads(self._demands, deadline)
        with self._dpool_lock:
            dpool = self._dpool
        if dpool is not None:
            dpool.close(left_s())
        left += stop_threads(self._pool, deadline)
        left += self.line_indexes.close(deadline)
        if self._procs is not None:
            self._procs.shutdown(left_s())
        with self._lock:
            for entry in self._lru.values():
                if not entry.done:  # its work was cancelled before it started, or is still running
                    entry.fail(Stopping("loaderd: document source closed"))
                entry.close()
            self._lru.clear()
            self.nbytes = 0
        # Threads that import or parse in the background, joined within the deadline, else named (the daemon
        # then leaves at once): an exit that ran while numba's import did printed a traceback from the
        # interpreter's exit handlers.
        if self.jit is not None and not self.jit.ended(left_s()):
            left.append("loaderd-jit-load")
        if hasattr(self.encoder, "ended") and not self.encoder.ended(left_s()):
            left.append("loaderd-tokenizer-load")
        return left

    # -- the DocTokens callback ---------------------------------------------
    def __call__(self, ref: Any) -> np.ndarray:
        self.calls += 1
        if self._metrics is not None:  # realized share per source (documents handed to the packers)
            self._metrics.source_docs[ref.source].inc()
        key = (ref.source, ref.obj)
        while True:
            entry = self._entry(key, bounded=False)
            assert entry is not None
            self._reads.entries[key] = entry
            try:
                return entry.doc(ref.record)
            except _Evicted:
                if self._closing.is_set():  # (the daemon stops: no new entry, no wait for a fill)
                    raise Stopping("loaderd: stopping; document "
                                   f"{ref.record} of source {ref.source} object {ref.obj} not read") from None
                continue  # a new entry maps (or makes) the tokens again

    def begin_reads(self) -> None:
        """Forget the calling thread's reads: the next `check_reads` covers what it reads from now on."""
        self.served.begin()

    def check_reads(self) -> bool:
        """After a producer call, before its steps leave it: True if every cached file the calling thread read
        documents from is unchanged since it was verified; False if some changed (verified again; a damaged one
        quarantined, named and dropped): the caller makes its steps again (served.py)."""
        return self.served.check()

    def scrub(self, budget: int) -> int:
        """Verify about `budget` bytes of mapped objects again, changed or not; returns the bytes hashed (served.py)."""
        return self.served.scrub(budget)

    @property
    def damaged_objects(self) -> int:
        """Cached objects found changed after they were verified (and quarantined) by this source's readers."""
        return self.served.damaged_objects

    def doc_length(self, source: int, obj: int, record: int) -> int | None:
        """The token count of record `record` of object `obj` of `source` when its tokens are mapped here or
        held by the node cache (a text object's derived tokens), else None. Never fills and never waits for a
        fill: a RESTORE's check on the IO thread (gate.py) costs at most one cache lookup and map."""
        got = self.mapped_now(source, [obj])
        if got:
            offsets = got[obj][0]
            return int(offsets[record + 1]) - int(offsets[record]) if 0 <= record < len(offsets) - 1 else None
        if self.encoder is None or self.manifest.sources[source].format == "tokens":
            return None
        from sluice.manifest.token_shard import open_shard
        from sluice.tokenize.tokcache import lookup_tokens

        try:
            pin = lookup_tokens(self.cache, self.manifest, source, obj, self.encoder)
        except SluiceError:  # (a damaged entry: the fill meets it again and reports it)
            return None
        if pin is None:
            return None
        try:
            offsets = open_shard(pin.path).offsets
            return int(offsets[record + 1]) - int(offsets[record]) if 0 <= record < len(offsets) - 1 else None
        except SluiceError:
            return None
        finally:
            pin.close()

    def count(self, source: int, n: int) -> None:
        """Account `n` documents of `source` handed to the packers from `mapped` shards, as `n` calls would."""
        self.calls += n
        self.hits += n
        if self._metrics is not None:
            self._metrics.source_docs[source].inc(n)
