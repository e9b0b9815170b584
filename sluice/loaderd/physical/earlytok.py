"""Cold start: the manifest's tokenizer parsed on a thread of its own while the daemon imports the rest.

A daemon on an empty node cache will encode (nothing is cached), and the
parse (50-110 ms for a 32k vocabulary with fastokens; tokenizers parses the
file too) otherwise runs only when the first fill needs it, in the first
batch's path. `start` begins it as soon as the manifest is read, before the
server's modules are imported (cli.py), and `DeferredEncoder.encoder()`
(assemble.py) takes its result with `take` instead of parsing again. The
identity check stays where it was: `DeferredEncoder.encoder()` compares the
loaded encoder's digest, backend and specials rule before anything encodes,
and `encoder_for_manifest` refuses a file of another digest as always.

Only where the parse is certain to be needed and made the same way:

* some source is text (not pre-tokenized) and the node cache folder is absent
  or empty (a warm cache may hold every object's tokens: then nothing parses);
* the serving backend is not tiktoken, whose built encoding is itself a node
  cache object (made through the open cache: sluice.tokenize.fastcache).

A load that failed is dropped: the first encoder then loads again and raises
in its own context. The thread is a daemon thread: a SIGTERM never waits for
it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("sluice.loaderd")

# How long `take` waits for a parse that started: far above the parse itself (the digest already pinned the
# file, whose size bounds it); past it the caller parses on its own.
TAKE_WAIT_S = 60.0


class _Load:
    def __init__(self, manifest: Any) -> None:
        self.manifest = manifest
        self.encoder: Any = None
        self.thread = threading.Thread(target=self._run, name="loaderd-tokenizer-early", daemon=True)

    def _run(self) -> None:
        from sluice.tokenize import encoder_for_manifest

        try:
            self.encoder = encoder_for_manifest(self.manifest)
        except Exception:  # noqa: BLE001 - the first encoder loads again and gets the error in its context
            log.debug("tokenizer load at start failed; the first encode loads it again", exc_info=True)


_lock = threading.Lock()
_loads: dict[str, _Load] = {}  # by the manifest's tokenizer digest


def start(manifest: Any, cache_dir: str, threads: int | None) -> bool:
    """Start parsing `manifest`'s tokenizer if this daemon will need it (module docstring); whether it started.

    `threads`: the daemon's tokenizer threads (`configure_threads`), set here, before the parse, in the
    calling thread (the environment is never written while another thread may read it).
    """
    ref = manifest.tokenizer
    if ref is None or all(s.format == "tokens" for s in manifest.sources) or _holds_anything(cache_dir):
        return False
    from sluice.tokenize.encoder import serving_backend

    if serving_backend(getattr(ref, "backend", "hf")) == "tiktoken":
        return False
    if threads is not None:
        from sluice.tokenize.threads import configure_threads

        configure_threads(threads)
    load = _Load(manifest)
    with _lock:
        if ref.digest in _loads:
            return False
        _loads[ref.digest] = load
    load.thread.start()
    return True


def take(digest: str, timeout_s: float = TAKE_WAIT_S) -> Any:
    """The encoder `start` parsed for tokenizer `digest` (waiting up to `timeout_s` for it), once; else None."""
    with _lock:
        load = _loads.pop(digest, None)
    if load is None:
        return None
    load.thread.join(timeout_s)
    return load.encoder


def _holds_anything(folder: str) -> bool:
    try:
        with os.scandir(folder) as it:
            return any(True for _ in it)
    except FileNotFoundError:
        return False
    except OSError:  # not a folder, unreadable: the cache's own open says what is wrong
        return True
