"""Embedded mode: a private loaderd for a single-process run, same stream.

`EmbeddedDaemon` starts the real daemon as a child process (the `loaderd`
entry point, so nothing is imported into the trainer's process but the client)
on an ipc socket in a private 0700 directory, with a fresh run token (a 0600
file in that directory, passed with --token-file; the client sends it), and
stops it (SIGTERM, then SIGKILL after a grace period) when closed. `embedded_client(...)` returns a
`Client` connected to it that owns the child. The stream is byte-identical to
a standalone daemon's because it is the same program.

The daemon dies with the trainer process (kill -9, an OOM kill), within 2 s
and through its ordinary SIGTERM stop, so its node cache stays consistent:
the trainer holds the write end of a pipe whose end-of-file the daemon
watches (``--parent-fd``), and on Linux, when started from the main thread,
the daemon also asks for SIGTERM at its parent's death (``prctl
PR_SET_PDEATHSIG``, which follows the starting thread: from any other thread
the pipe alone is used). `sluice.loaderd.parentwatch` has the details.

A daemon outlives a trainer restart in the deployment model (docs/deploy.md);
in one process the same is `client.close(keep_daemon=True)` and then
`client.daemon.client()`: a new client of the daemon that kept running,
whose `reset(state)` is a RESTORE, not a daemon start.

    from sluice.client import embedded_client
    with embedded_client("manifest.json", "run.toml", cache_dir="cache") as client:
        for mb in client:
            ...
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import DaemonUnavailable

if TYPE_CHECKING:
    from sluice.client.iterator import Client
    from sluice.client.owning import EmbeddedClient

_BOOT = "import sys; from sluice.loaderd.cli import main; sys.exit(main(sys.argv[1:]))"

# Write ends of the parent pipes of this process's live embedded daemons. A child forked without exec (a
# DataLoader worker, multiprocessing's fork) closes them: holding one would keep its daemon alive after the
# trainer's death for as long as that child lives.
_PARENT_PIPES: set[int] = set()
_AT_FORK: list[bool] = []


def _close_parent_pipes_in_child() -> None:
    for fd in _PARENT_PIPES:
        try:
            os.close(fd)
        except OSError:
            pass
    _PARENT_PIPES.clear()


def _parent_pipe() -> tuple[int, int]:
    """(read end for the daemon, write end kept by this process); both non-inheritable until passed."""
    if not _AT_FORK:
        os.register_at_fork(after_in_child=_close_parent_pipes_in_child)
        _AT_FORK.append(True)
    r, w = os.pipe()
    _PARENT_PIPES.add(w)
    return r, w


def first_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """The first stdout line of a starting daemon (its JSON announcement), or None if it died/timed out."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if sel.select(0.1):
                line = proc.stdout.readline()
                if line:
                    return line.decode("utf-8")
            if proc.poll() is not None:
                return None
        return None
    finally:
        sel.close()


class EmbeddedDaemon:
    """A child `loaderd` process on a private ipc socket."""

    def __init__(
        self,
        manifest: str | os.PathLike[str],
        runspec: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str],
        replicas: int = 1,
        serve: tuple[int, ...] | None = None,
        cache_budget: str = "8GiB",
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 60.0,
        log_path: str | os.PathLike[str] | None = None,
        wait: bool = True,
        exit_with_parent: bool = True,
    ) -> None:
        """Start the child; with `wait` (default) return once it listens, else call `wait_ready()` later.

        `wait=False` lets the caller do its own start-up (importing the client:
        numpy, pyzmq) while the child imports and opens the node cache.
        `exit_with_parent` (default): the child stops within 2 s of this
        process's death, however it dies (module docstring); False leaves it
        running with parent 1 until someone stops it.
        """
        self._dir = tempfile.mkdtemp(prefix="sluice-embedded-")  # 0700
        endpoint = f"ipc://{self._dir}/loaderd.sock"
        self.token = secrets.token_hex(32)
        token_file = os.path.join(self._dir, "token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        args = [
            sys.executable, "-c", _BOOT, str(manifest), str(runspec), "--cache", str(cache_dir),
            "--cache-budget", cache_budget, "--replicas", str(replicas), "--endpoint", endpoint,
            "--token-file", token_file, *(("--serve", ",".join(map(str, serve))) if serve else ()), *extra_args,
        ]
        self.replicas = replicas
        self.serve = serve
        self._log = open(log_path or os.path.join(self._dir, "loaderd.log"), "ab")
        self._parent_w: int | None = None
        read_end: tuple[int, ...] = ()
        if exit_with_parent:
            r, self._parent_w = _parent_pipe()
            read_end = (r,)
            args += ["--parent-fd", str(r)]
            if threading.current_thread() is threading.main_thread():  # PDEATHSIG fires when this thread ends
                args.append("--parent-death-signal")
        try:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, pass_fds=read_end)
        except BaseException:
            self._close_parent_pipe()
            raise
        finally:
            for fd in read_end:
                os.close(fd)  # the child holds its copy; ours would keep the pipe open after the child's death
        self._start_timeout_s = start_timeout_s
        self.endpoint: str = ""
        self.run_id: str = ""
        self.dataset_id: str = ""
        self.metrics_port: int | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait (up to the start timeout) for the child's announcement; DaemonUnavailable, with its log, if it died."""
        if self.endpoint:
            return
        info = json.loads(self._first_line(self._start_timeout_s))
        self.endpoint = info["endpoint"]
        self.run_id = info["run_id"]
        self.dataset_id = info["dataset_id"]
        self.metrics_port = info.get("metrics_port")

    def client(self, replica: int | None = None, **client_kwargs: Any) -> Client:
        """A new `Client` of this running daemon, as a restarted trainer's would be; it does not own the daemon.

        `replica` defaults to the first replica this daemon serves; the run
        token, run ID and dataset ID are this daemon's; `client_kwargs` are
        `Client`'s (as_numpy, timeout_s, ...). Closing the client leaves the
        daemon running: it keeps its node cache, planned steps and tokenizer,
        so a `reset(state)` on the new client costs a RESTORE, not a start
        (docs/loaderd.md). Close the daemon with `close()`.
        """
        from sluice.client.iterator import Client

        self.wait_ready()
        if self.proc.poll() is not None:
            raise DaemonUnavailable(f"embedded loaderd exited ({self.proc.returncode}); no client can attach")
        if replica is None:
            replica = self.serve[0] if self.serve else 0
        client_kwargs.setdefault("token", self.token)
        return Client(self.endpoint, replica, self.replicas, run_id=self.run_id, dataset_id=self.dataset_id,
                      **client_kwargs)

    def _first_line(self, timeout_s: float) -> str:
        line = first_line(self.proc, timeout_s)
        if line is not None:
            return line
        self.close()
        log = Path(self._log.name).read_text(errors="replace")[-4000:]
        raise DaemonUnavailable(f"embedded loaderd did not start (exit {self.proc.returncode}); its log:\n{log}")

    def close(self, grace_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._close_parent_pipe()
        self._log.close()
        for name in ("loaderd.sock", "token"):
            Path(self._dir, name).unlink(missing_ok=True)
        return self.proc.returncode

    def _close_parent_pipe(self) -> None:
        if self._parent_w is not None:
            _PARENT_PIPES.discard(self._parent_w)
            os.close(self._parent_w)
            self._parent_w = None


def embedded_client(
    manifest: str | os.PathLike[str],
    runspec: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str],
    replica: int = 0,
    replicas: int = 1,
    daemon_args: tuple[str, ...] = (),
    **client_kwargs: Any,
) -> EmbeddedClient:
    """Start a private daemon for (manifest, run spec) and return a client of it.

    The child starts first; the client's own imports (numpy, pyzmq) run while
    it starts, so the two start-ups overlap (docs/loaderd.md, "Start-up").
    """
    daemon = EmbeddedDaemon(manifest, runspec, cache_dir=cache_dir, replicas=replicas, serve=(replica,),
                            extra_args=daemon_args, wait=False)
    try:
        from sluice.client.owning import EmbeddedClient

        daemon.wait_ready()
        client_kwargs.setdefault("token", daemon.token)
        client = EmbeddedClient(daemon.endpoint, replica, replicas, run_id=daemon.run_id,
                                dataset_id=daemon.dataset_id, **client_kwargs)
    except BaseException:
        daemon.close()
        raise
    client.daemon = daemon
    return client


def __getattr__(name: str) -> Any:
    if name == "EmbeddedClient":  # defined next to the Client it extends, imported when first used
        from sluice.client.owning import EmbeddedClient

        return EmbeddedClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
