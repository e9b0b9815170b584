"""How many Rust threads a tokenizer batch call uses in this process, set once and read back.

Threads (measured on tokenizers 0.23.3, see docs/tokenize.md):

* ``TOKENIZERS_PARALLELISM`` is read on *every* batch call: a false value
  ("false", "0", "off", ...) encodes serially in the calling thread.
* The Rust (rayon) pool is created lazily by the first parallel batch call in
  the process, not at import; its size is ``RAYON_NUM_THREADS`` as set at that
  moment (default: the CPUs available), and it never changes afterwards.

`configure_threads` applies those rules: 1 thread disables parallelism (any
time); N > 1 sets ``RAYON_NUM_THREADS`` and must happen before the first
parallel batch in the process. A worker process that wants a fixed count calls
it (or sets both variables) before its first encode.
"""

from __future__ import annotations

import os
import sys

from sluice import affinity
from sluice.errors import TokenizerError

_PARALLEL_ENV = "TOKENIZERS_PARALLELISM"
_POOL_ENV = "RAYON_NUM_THREADS"
_FASTOKENS_ENV = "FASTOKENS_BPE_THREADS"  # fastokens' own pool (sluice.tokenize.native)

# The Rust pool is process-global and fixed at creation, so the record of what
# this process asked for is process-global too. `_pool_threads` is set once a
# parallel batch has run (the pool then exists and cannot be resized).
_threads: int | None = None
_pool_threads: int | None = None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity when sluice started: the calling thread's own may be one
    CPU, as loaderd's are under --gil-cpu)."""
    return affinity.count()


def configure_threads(threads: int) -> None:
    """Fix how many Rust threads `encode_batch` uses in this process.

    ``threads=1``: encode serially in the calling thread (sets
    ``TOKENIZERS_PARALLELISM=false``; effective immediately). ``threads=N>1``:
    sets ``RAYON_NUM_THREADS=N`` and enables parallelism; raises TokenizerError
    if this process already created its pool with another size (the pool
    cannot be resized). A pool created by code outside sluice before this call
    cannot be detected: call this before anything encodes.
    """
    global _threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise TokenizerError(f"tokenizer threads: expected an integer >= 1, got {threads!r}")
    native = sys.modules.get("sluice.tokenize.native")
    made = getattr(native, "_FASTOKENS_POOL", None)
    if made is not None and made != threads:
        raise TokenizerError(
            f"tokenizer threads: this process already runs a {made}-thread fastokens pool; "
            f"it cannot be resized to {threads} (set the count before the first encode, or use another process)"
        )
    os.environ[_FASTOKENS_ENV] = str(threads)  # read once, when fastokens first encodes
    if threads == 1:
        os.environ[_PARALLEL_ENV] = "false"
    else:
        if _pool_threads is not None and _pool_threads != threads:
            raise TokenizerError(
                f"tokenizer threads: this process already runs a {_pool_threads}-thread tokenizers pool; "
                f"it cannot be resized to {threads} (set the count before the first encode, "
                "or use another process)"
            )
        os.environ[_POOL_ENV] = str(threads)
        os.environ[_PARALLEL_ENV] = "true"
    _threads = threads


def current_threads() -> int:
    """The number of Rust threads the next batch call uses (from the environment, as tokenizers reads it)."""
    value = os.environ.get(_PARALLEL_ENV)
    if value is not None and value.strip().lower() in ("", "off", "false", "f", "no", "n", "0"):
        return 1
    if _pool_threads is not None:
        return _pool_threads
    try:
        return max(1, int(os.environ.get(_POOL_ENV, "")))
    except ValueError:
        return available_cpus()


def note_parallel_use() -> None:
    """After a batch call: record the pool's size once a parallel batch ran (it exists now, never resized)."""
    global _pool_threads
    if _pool_threads is None and current_threads() > 1:
        _pool_threads = current_threads()
