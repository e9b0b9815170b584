"""`loaderd` (console script) and `sluice loaderd`: run the per-node daemon.

    loaderd MANIFEST RUNSPEC --cache DIR [--cache-budget 8GiB]
            [--replicas R --serve 0,1 | --replicas R --node-rank N --ranks-per-node K]
            [--endpoint ipc://...|tcp://127.0.0.1:*] [--endpoint-file PATH] [--metrics-port N]
            [--token-file PATH]   (every option below; docs/loaderd.md)

On start it prints one JSON line ``{"endpoint", "metrics_port", "pid",
"instance", "run_id", "dataset_id"}`` on stdout and writes the endpoint (one line) to
``--endpoint-file`` (mode 0600, atomically). Logs are JSON lines on stderr.
SIGTERM or SIGINT drains (pending requests get ERROR SHUTTING_DOWN) and exits 0
within 2 s at any stage, a cold fill included (docs/loaderd.md, "Stopping").
A daemon that cannot start (e.g. its endpoint cannot be bound: port in use)
says why on stderr and exits 2 at once, so a supervisor restarts it.

Who may connect (docs/hardening.md): the default ipc socket lives in a private
0700 folder. A tcp endpoint or an abstract ``ipc://@name`` socket needs a run
token: ``--token-file`` names a 0600 file holding the secret the launcher also
gives the trainers (``SLUICE_TOKEN`` or ``Client(token=...)``); requests
without it are refused UNAUTHORIZED. Beyond loopback only CurveZMQ is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from sluice.errors import SluiceError, SpecError, StartError
from sluice.loaderd.options import add_options, server_values


def parse_replicas(text: str, replicas: int) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise SpecError(f"--serve {text!r}: expected comma-separated replica numbers such as 0,1") from exc
    if not out:
        raise SpecError("--serve: at least one replica")
    return out


def node_replicas(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The replicas of node `--node-rank` N with `--ranks-per-node` K: N*K .. N*K+K-1 (None without them).

    torchrun gives node N the global ranks N*K .. N*K+K-1 and rank r is replica
    r, so a node's daemon serves exactly its own trainers. SpecError names the
    flag when the pair is incomplete, combined with --serve, or outside R.
    """
    if args.node_rank is None and args.ranks_per_node is None:
        return None
    if args.node_rank is None or args.ranks_per_node is None:
        raise SpecError("loaderd: --node-rank and --ranks-per-node go together")
    if args.serve:
        raise SpecError("loaderd: give either --serve or --node-rank/--ranks-per-node, not both")
    n, k = args.node_rank, args.ranks_per_node
    if n < 0 or k < 1 or (n + 1) * k > args.replicas:
        raise SpecError(f"loaderd: --node-rank {n} --ranks-per-node {k} names replicas {n * k}..{(n + 1) * k - 1}, "
                        f"outside the run's --replicas {args.replicas} (0..{args.replicas - 1})")
    return tuple(range(n * k, (n + 1) * k))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """loaderd's arguments on `p`: the manifest, the run spec and every option of options.py."""
    p.add_argument("manifest", help="frozen manifest.json")
    p.add_argument("runspec", help="run spec (TOML)")
    add_options(p)


def demand_workers_arg(value: str) -> int:
    """`--demand-workers`: "auto" (demandpool.default_workers) or an integer in [0, 256]."""
    from sluice.loaderd.physical.demandpool import default_workers

    return _count_or_auto(value, "--demand-workers", 0, 256, default_workers)


def tokenizer_threads_arg(value: str) -> int:
    """`--tokenizer-threads`: "auto" (the CPUs this process may run on) or an integer in [1, 1024]."""
    from sluice.tokenize.threads import available_cpus

    return _count_or_auto(value, "--tokenizer-threads", 1, 1024, available_cpus)


def _count_or_auto(value: str, flag: str, low: int, high: int, auto: Any) -> int:
    """`auto()` for "auto", else `value` as an integer in [low, high]; SpecError naming `flag` otherwise."""
    if value == "auto":
        return int(auto())
    try:
        n = int(value)
    except ValueError:
        n = low - 1
    if not low <= n <= high:
        raise SpecError(f"loaderd: {flag} {value!r} is not 'auto' or an integer in [{low}, {high}]")
    return n


def _folder_arg(flag: str, path: str) -> None:
    """SpecError naming `flag` where `path` is not a folder and cannot become one: it is a file, or the first
    of its parents that exists is not a folder (said before the start, where the daemon's own mkdir would
    name only an inner path). Makes nothing: a start refused later leaves no empty folder behind."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise SpecError(f"loaderd: {flag} {path} exists and is not a folder")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise SpecError(f"loaderd: {flag} {path}: cannot make this folder: {parent} is not a folder")


def config_from_args(args: argparse.Namespace) -> Any:
    from sluice.loaderd.server import ServerConfig
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    threads = tokenizer_threads_arg(args.tokenizer_threads)  # a bad flag is named before any file is read
    manifest = load_manifest(args.manifest)
    from sluice.cache.roots import check_manifest, roots_for  # every object within --allow-root, before serving

    roots = roots_for(manifest, args.allow_root)
    check_manifest(manifest, roots, where=f"manifest {args.manifest}")
    spec = load_runspec(args.runspec)
    for flag, path in (("--cache", args.cache), ("--state-dir", args.state_dir)):
        if path:
            _folder_arg(flag, path)
    folder = os.path.dirname(os.path.abspath(args.endpoint_file)) if args.endpoint_file else None
    if folder and not os.path.isdir(folder):  # said before the start, not as a temporary file's name after it
        raise SpecError(f"loaderd: --endpoint-file {args.endpoint_file}: folder {folder} does not exist")
    serve = node_replicas(args) or (parse_replicas(args.serve, args.replicas) if args.serve
                                    else tuple(range(args.replicas)))
    curve = None
    if args.curve_secret or args.curve_clients:
        if not (args.curve_secret and args.curve_clients):
            raise SpecError("loaderd: --curve-secret and --curve-clients go together")
        from sluice.curve import load_server_keys

        curve = load_server_keys(args.curve_secret, args.curve_clients)
    from sluice.wire.runtoken import read_token_file

    token = read_token_file(args.token_file) if args.token_file else None
    return ServerConfig(
        **server_values(args, demand_workers=demand_workers_arg(args.demand_workers), tokenizer_threads=threads),
        manifest=manifest,
        spec=spec,
        serve=serve,
        curve=curve,
        token=token,
        allowed_roots=roots,  # checked again at every cache miss (a link may change after the start)
    )


def run(args: argparse.Namespace) -> int:
    from sluice.loaderd import logs, parentwatch
    from sluice.loaderd.endpoint import raise_open_files_limit, write_private
    from sluice.loaderd.server import Server

    if args.parent_death_signal:  # first: a trainer killed while the manifest loads takes this process along
        parentwatch.set_death_signal(signal.SIGTERM)
    if args.parent_fd is not None:
        parentwatch.check_parent_fd(args.parent_fd)
    config = config_from_args(args)
    raise_open_files_limit()  # every connection is a descriptor: a soft limit of 1,024 is 1,000 idle peers
    holder: dict[str, Any] = {}
    handler = logs.setup(args.log_level, config.spec.run_id, config.manifest.dataset_id,
                         lambda: holder["server"].generation if "server" in holder else None)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    if args.parent_fd is not None:  # end-of-file: the trainer is gone (also if it died before the prctl above)
        parentwatch.watch_parent_fd(args.parent_fd, stop)
    try:
        server = Server(config)
    except OSError as exc:
        raise StartError(f"loaderd: cannot start: {exc}") from exc
    holder["server"] = server
    running: list[str] = []
    try:
        if not stop.is_set():  # a SIGTERM while the server was made: nothing is bound or started yet
            endpoint = server.bind(freeze_gc=True)  # this process is the daemon: its start-up heap is frozen
            if args.endpoint_file:
                write_private(args.endpoint_file, endpoint + "\n")
            print(json.dumps({"endpoint": endpoint, "metrics_port": server.metrics_port, "pid": _pid(),
                              "instance": server.instance, "run_id": server.run_id,
                              "dataset_id": server.dataset_id}), flush=True)
            server.serve(stop)
    except OSError as exc:  # endpoint file folder missing, metrics port in use, ...
        raise StartError(f"loaderd: cannot start: {exc}") from exc
    finally:
        # within Server.close's bound, counted from the earliest the signal can have come (docs/loaderd.md,
        # "Stopping")
        running = server.close(server.stop_budget()) + _busy_threads()
        for s, h in old.items():
            signal.signal(s, h)
        if running:
            _leave_now(running)
        import logging

        logging.getLogger("sluice.loaderd").removeHandler(handler)
    return 0


def _busy_threads() -> list[str]:
    """Threads other than this one that the interpreter would wait for at exit (not daemon threads)."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def _leave_now(running: list[str]) -> None:
    """Exit 0 at once, without the interpreter's wait for `running` (threads in a task that does not look at
    the stop flag: one tokenizer call, one raw fetch): a supervisor's SIGTERM is answered within the bound,
    never after the task. Everything durable is closed already (the fencing store, the cache's counters);
    what the task leaves half-made in the node cache is debris its collection removes, as after kill -9."""
    import logging
    logging.getLogger("sluice.loaderd").warning(
        "loaderd: stopped; leaving without waiting for work still running", extra={"running": running})
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _pid() -> int:
    return os.getpid()


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("loaderd", help="run the per-node loader daemon",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `loaderd` console script."""
    parser = argparse.ArgumentParser(prog="loaderd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SluiceError as exc:  # (messages of the daemon's own start say "loaderd: ..." already)
        print(f"loaderd: error: {str(exc).removeprefix('loaderd: ')}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # e.g. the endpoint file's folder is missing: say so, no traceback
        print(f"loaderd: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line naming the bug, never a traceback
        from sluice.cli import report_bug

        return report_bug(exc)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
