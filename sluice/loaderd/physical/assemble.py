"""One assembly of the data path: node cache + encoder + DocSource, and the Plans over it.

The daemon (`server.py`) and the offline commands (`sluice plan / whence / ledger`, `plan_cli.py`) all read documents
the same way, so they build them here, once::

    manifest, spec, DataPathConfig
        -> NodeCache(cache_dir, budget)            digest-verified objects
        -> DeferredEncoder(manifest)               only if a source is text; parsed on first use
        -> DocSource(manifest, cache, encoder)     the DocTokens callback
        -> DataPath.plan()                         a Plan per producer (Plans cache orders; not shared)

That `sluice plan` and the daemon go through this one function is what keeps
their streams equal: the same cache rules, the same encoder, the same framing.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import InternalError, SpecError
from sluice.loaderd.logical import Plan
from sluice.loaderd.options import declared_fields
from sluice.loaderd.physical.jitload import KernelLoader, machine_cache_dir
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import Manifest
from sluice.runspec import RunSpec
from sluice.waits import joined

log = logging.getLogger("sluice.loaderd")


@dataclass(frozen=True, kw_only=True)
@declared_fields("data_path")
class DataPathConfig:
    """How documents are read: the node cache and the decode workers.

    `worker_kind` "process" decodes and tokenizes text objects in worker
    processes. `window_steps`: steps whose objects must be decoded at once (the
    daemon's prefetch lead), for the order cost check (ordercost.py); 0 skips
    the check. `allowed_roots`: the operator's roots (`--allow-root`), checked
    by the cache at every miss, in this process and in its worker processes.
    """

    # The fields loaderd's data-path options fill (cache_dir, cache_budget, workers, ...: every `Option` with a
    # `data_field`) are declared with those options in sluice/loaderd/options.py (`declared_fields`).
    window_steps: int = 1
    allowed_roots: Any = None  # sluice.cache.roots.AllowedRoots every cache miss must lie within (None: any)

    def __post_init__(self) -> None:
        if self.jit not in ("auto", "numba", "off"):
            raise SpecError(f"loaderd: jit {self.jit!r} is not 'auto', 'numba' or 'off'")
        if self.worker_kind not in ("thread", "process"):
            raise SpecError(f"loaderd: worker kind {self.worker_kind!r} is not 'thread' or 'process'")
        for name in ("cache_budget", "decoded_bytes", "workers"):
            if getattr(self, name) < 1:
                raise SpecError(f"loaderd: {name} must be >= 1, got {getattr(self, name)}")
        if self.demand_workers < 0:
            raise SpecError(f"loaderd: demand_workers must be >= 0, got {self.demand_workers}")
        if self.scrub_rate < 0:
            raise SpecError(f"loaderd: scrub_rate must be >= 0 bytes/s, got {self.scrub_rate}")
        if self.tokenizer_threads is not None and not (
                isinstance(self.tokenizer_threads, int) and 1 <= self.tokenizer_threads <= 1024):
            raise SpecError(f"loaderd: tokenizer threads must be an integer in [1, 1024], got {self.tokenizer_threads!r}")


class DataPath:
    """The assembled path: `cache`, `docs` (the DocTokens callback), `plan()`; `close()` releases both."""

    def __init__(self, manifest: Manifest, spec: RunSpec, cache: Any, docs: DocSource) -> None:
        self.manifest = manifest
        self.spec = spec
        self.cache = cache
        self.docs = docs

    def plan(self) -> Plan:
        """A new Plan over this manifest and run spec (one per producer: a Plan's caches are not shared)."""
        return Plan(self.manifest, self.spec)

    def close(self, timeout_s: float | None = None) -> list[str]:
        """Close the DocSource (`DocSource.close(timeout_s)`: None waits for its tasks) and the cache; the
        names of the worker threads still running a task past `timeout_s` (empty: all stopped)."""
        try:
            return self.docs.close(timeout_s)
        finally:
            self.cache.close()

    def __enter__(self) -> DataPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeferredEncoder:
    """The manifest's encoder, parsed on its first use (or from the first token-cache miss, `load_soon`): with
    every object's tokens cached, never.

    Its identity (digest, backend, specials rule: what cached tokens are keyed
    by) is known from the manifest, and the file is checked against the digest
    when this is made, so a missing or other tokenizer still stops the daemon
    at start; only the parse waits (0.25 s of a 0.7 s daemon start with a 32k
    vocabulary, measured: docs/loaderd.md, "Start-up"). Everything else
    (`encode_batch`, `vocab_size`, ...) is the loaded `Encoder`'s, loaded once
    under a lock by the first thread that needs it.
    """

    def __init__(self, manifest: Manifest, cache: Any = None) -> None:
        from sluice.tokenize.encoder import manifest_tokenizer_identity

        ident = manifest_tokenizer_identity(manifest)
        self.identity = ident
        self._manifest = manifest
        self._cache = cache  # the node cache: the tiktoken backend's built encoding is kept there
        self.digest = ident.digest
        self.backend = ident.backend
        self.specials_in_text = ident.specials_in_text
        self._lock = threading.Lock()
        self._encoder: Any = None
        self._loading: threading.Thread | None = None

    @property
    def loaded(self) -> bool:
        return self._encoder is not None

    def load_soon(self) -> None:
        """Start parsing the file on a thread of its own, once: a fill that found no cached tokens calls this
        before it fetches and decodes its raw object, so the parse (50-110 ms with fastokens, most of it in
        native code) runs while they do instead of after them, in the first batch's path.

        Nothing is served from that thread: whoever encodes still calls `encoder()`, which waits for the
        load under the lock and checks the identity, and a load that failed there is tried again by that
        caller, whose error it then is. A daemon thread: a SIGTERM never waits for it (the parse is bounded
        by the file, which the digest already pinned)."""
        if self._encoder is not None or self._loading is not None:
            return
        with self._lock:
            if self._encoder is not None or self._loading is not None:
                return
            self._loading = threading.Thread(target=self._load_quietly, name="loaderd-tokenizer-load", daemon=True)
        self._loading.start()

    def ended(self, timeout_s: float | None) -> bool:
        """Wait up to `timeout_s` (None: as long as it takes) for a parse started by `load_soon` to end; True when
        none runs (the daemon's exit waits for it, as for the kernel's load: `DocSource.close`)."""
        return joined(self._loading, timeout_s)

    def _load_quietly(self) -> None:
        try:
            self.encoder()
        except Exception:  # noqa: BLE001 - the caller that needs the encoder loads again and gets the error
            log.debug("tokenizer load ahead of use failed; the first encode loads it again", exc_info=True)

    def encoder(self) -> Any:
        """The parsed `Encoder` (TokenizerError if the file cannot be parsed; InternalError on an identity drift)."""
        with self._lock:
            if self._encoder is None:
                from sluice.tokenize import encoder_for_manifest

                enc = encoder_for_manifest(self._manifest, cache=self._cache)
                got = (enc.digest, enc.backend, enc.specials_in_text)
                if got != (self.digest, self.backend, self.specials_in_text):
                    raise InternalError(f"tokenizer identity {got} differs from the one the token cache was "
                                        f"keyed by, {(self.digest, self.backend, self.specials_in_text)}")
                self._encoder = enc
            return self._encoder

    def __getattr__(self, name: str) -> Any:  # only for what is not set above
        if name.startswith("_"):  # private and dunder lookups (copy, pickle) never load the tokenizer
            raise AttributeError(name)
        return getattr(self.encoder(), name)


def open_data_path(manifest: Manifest, spec: RunSpec, config: DataPathConfig, *, metrics: Any = None) -> DataPath:
    """Open the node cache, check the manifest's tokenizer if a source needs one, start the DocSource.

    Raises the cache's and the tokenizer's own errors (CacheError, TokenizerError)
    naming the directory or file; nothing is left open when it raises.
    """
    from sluice.cache import NodeCache

    cache = NodeCache(config.cache_dir, config.cache_budget, verify_on_read=config.verify_on_read,
                      allowed_roots=config.allowed_roots)
    try:
        encoder = None
        threads = config.tokenizer_threads
        if any(s.format != "tokens" for s in manifest.sources):
            encoder = DeferredEncoder(manifest, cache)
            _say_fallback(encoder.identity, metrics)
            if threads is not None:  # before anything encodes: the pools are sized once per process
                from sluice.tokenize.threads import configure_threads

                configure_threads(threads)
            if metrics is not None:
                metrics.tokenizer_threads(encoder.backend, docs_threads(threads))
        if config.window_steps:
            _check_order_cost(manifest, spec, cache, encoder, config)
        docs = DocSource(manifest, cache, encoder, budget_bytes=config.decoded_bytes, workers=config.workers,
                         metrics=metrics, worker_kind=config.worker_kind, demand_workers=config.demand_workers,
                         scrub_rate=config.scrub_rate, tokenizer_threads=threads)
        # numba's compiled code in the user's cache folder (compiled once per machine), else under the node cache
        docs.jit = KernelLoader(config.jit, functools.partial(machine_cache_dir, Path(config.cache_dir) / "jit"),
                                metrics)
    except BaseException:
        cache.close()
        raise
    return DataPath(manifest, spec, cache, docs)


def docs_threads(threads: int | None) -> int:
    """The encoder threads of this process: `threads` as configured, else what its environment gives."""
    from sluice.tokenize.threads import current_threads

    return threads if threads is not None else current_threads()


def _say_fallback(ident: Any, metrics: Any) -> None:
    """Once per daemon start: the manifest's backend is not installed, `tokenizers` encodes (same ids)."""
    if not ident.fallback:
        return
    log.warning("tokenizer backend %r recorded by the manifest is not installed here (pip install %s); "
                "encoding with %r instead: the same ids (proven when the manifest was frozen), tokens cached "
                "under the %r backend", ident.recorded, ident.recorded, ident.backend, ident.backend)
    if metrics is not None:
        metrics.tokenizer_fallback(ident.recorded, ident.backend)


def _check_order_cost(manifest: Manifest, spec: RunSpec, cache: Any, encoder: Any, config: DataPathConfig) -> None:
    """Refuse a global order over raw objects that would not fit the decode budget (ordercost.py)."""
    from sluice.loaderd.physical.ordercost import check
    from sluice.tokenize.tokcache import lookup_tokens

    def cached(s: int, o: int) -> bool:
        pin = lookup_tokens(cache, manifest, s, o, encoder)
        if pin is None:
            return False
        pin.close()
        return True

    check(Plan(manifest, spec), config.window_steps, config.decoded_bytes, cached if encoder is not None else None)
