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
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from sluice.cliargs import ranged
from sluice.errors import SluiceError, SpecError, StartError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """'8GiB' -> 8589934592, '500M' -> 500000000, '4096' -> 4096; SpecError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise SpecError(f"size {text!r} is not a number of bytes such as 4096, 500MB or 8GiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    if len(m.group(1)) > 30:  # also keeps int() below Python's 4300-digit limit
        raise SpecError(f"size {text[:40]!r}...: too many digits")
    return int(m.group(1)) * _UNITS[unit]


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
    p.add_argument("manifest", help="frozen manifest.json")
    p.add_argument("runspec", help="run spec (TOML)")
    p.add_argument("--cache", required=True, help="node cache directory")
    p.add_argument("--cache-budget", default="8GiB", help="node cache byte budget (default 8GiB)")
    p.add_argument("--allow-root", action="append", metavar="ROOT",
                   help="folder or s3://bucket/prefix/ object locations may lie within (repeatable; default: "
                        "the manifest's folder only: s3 objects need an explicit s3:// root); a manifest outside is refused")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel size R of the run (default 1)")
    p.add_argument("--serve", default=None, help="replicas this node serves, e.g. 0,1 (default: all R)")
    p.add_argument("--node-rank", type=int, default=None, metavar="N",
                   help="with --ranks-per-node K: serve replicas N*K .. N*K+K-1, the ranks torchrun puts on "
                        "node N (instead of --serve; see docs/deploy.md)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="K", help="trainer ranks per node (--node-rank)")
    p.add_argument("--endpoint", default=None,
                   help="ipc://PATH or tcp://127.0.0.1:PORT|* (default: ipc socket in a private 0700 temp dir)")
    p.add_argument("--endpoint-file", default=None, help="write the bound endpoint to this file (0600)")
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="CurveZMQ secret key of the daemon (sluice curve-keys); with --curve-clients, "
                        "encrypts and authenticates every connection and allows tcp beyond loopback")
    p.add_argument("--curve-clients", default=None, metavar="DIR",
                   help="folder of the client public keys (*.key) allowed to connect")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file (mode 0600) holding this run's token; every request must carry it "
                        "(required for tcp:// and ipc://@ endpoints without CurveZMQ)")
    p.add_argument("--state-dir", default=None, help="fencing LMDB directory (default CACHE/loaderd-state)")
    p.add_argument("--metrics-port", type=ranged(int, 0, 65535, "--metrics-port"), default=None,
                   help="serve Prometheus /metrics on 127.0.0.1:PORT (0 = any free port; default off)")
    p.add_argument("--metrics-ids", action="store_true",
                   help="label the metrics with the run and dataset IDs (default: the labels say 'hidden', "
                        "since every local user can read the metrics port)")
    p.add_argument("--workers", type=ranged(int, 1, 1024, "--workers"), default=2, help="read/decode/tokenize workers (default 2)")
    p.add_argument("--worker-kind", choices=["thread", "process"], default="thread",
                   help="decode+tokenize text objects in threads or in worker processes (default thread; "
                        "see docs/loaderd.md for the measurement)")
    p.add_argument("--demand-workers", default="auto", metavar="N|auto",
                   help="processes that tokenize the records a step needs out of order (0 = threads in the "
                        "daemon; auto = the measured rule of docs/tokenize.md, 'Out of order')")
    p.add_argument("--tokenizer-threads", default="auto", metavar="N|auto",
                   help="threads the tokenizer encodes with in this daemon (its pool: tokenizers' RAYON_NUM_THREADS, "
                        "fastokens' FASTOKENS_BPE_THREADS, tiktoken's and tokie's Python pool); worker processes "
                        "share them out. Leave the trainer's cores free with N below the node's CPUs (auto = the "
                        "CPUs this daemon may run on, its affinity; see docs/tokenize.md, 'Threads')")
    p.add_argument("--producer", choices=["thread", "process"], default="thread",
                   help="run each replica's producer (the logical plane) in a thread or its own process "
                        "(default thread; see docs/loaderd.md)")
    p.add_argument("--jit", choices=["auto", "off"], default="auto",
                   help="the fused producer path's compiled kernel (numba, the 'jit' extra): auto = load it in "
                        "the background after 2,048 steps (a long run) and use it once loaded, numpy until then or "
                        "without numba; off = numpy only (default auto; see docs/logical.md)")
    p.add_argument("--lead-steps", type=int, default=8, help="steps produced ahead of the consumer (default 8)")
    p.add_argument("--queue-bytes", default="256MiB", help="assembled micro-batch bytes per replica (default 256MiB)")
    p.add_argument("--decoded-bytes", default="256MiB", help="decoded/tokenized object bytes (default 256MiB)")
    p.add_argument("--request-ttl", type=ranged(float, 0, 86_400, "--request-ttl", low_open=True), default=60.0,
                   help="seconds a parked GET waits before it is answered ERROR EXPIRED (a live client asks "
                        "again; a vanished one's credit is released); a silent client's HELLO peers claim "
                        "lapses after twice this (default 60)")
    p.add_argument("--memory-limit", default="auto", metavar="SIZE|auto|off",
                   help="bound on the daemon's anonymous memory: above it every connection is dropped with what "
                        "libzmq buffered for it, and clients restore as after a restart (auto: memory at start "
                        "+ --queue-bytes per served replica + --decoded-bytes + 512MiB; see docs/hardening.md)")
    p.add_argument("--no-verify-on-read", action="store_true",
                   help="do not re-hash cache hits at lookup (the objects served are still verified when first "
                        "mapped and after their file changes: docs/cache.md, 'Verified on the way out')")
    p.add_argument("--scrub-rate", default="32MiB", metavar="SIZE",
                   help="bytes per second of mapped cache objects verified again in the background, changed or "
                        "not, to find damage that leaves a file's timestamps alone (bit rot); 0 = off "
                        "(default 32MiB: under 1%% of a core)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--parent-fd", type=int, default=None, metavar="FD",
                   help="stop (as on SIGTERM) when this inherited pipe's read end reaches end-of-file: the "
                        "process holding the write end exited (embedded mode; docs/loaderd.md, 'Stopping')")
    p.add_argument("--parent-death-signal", action="store_true",
                   help="Linux: get SIGTERM when the thread that started this daemon exits (prctl "
                        "PR_SET_PDEATHSIG; embedded mode, started from the trainer's main thread)")


def demand_workers_arg(value: str) -> int:
    """`--demand-workers`: "auto" (demandpool.default_workers) or an integer in [0, 256]."""
    from sluice.loaderd.physical.demandpool import default_workers

    return _count_or_auto(value, "--demand-workers", 0, 256, default_workers)


def tokenizer_threads_arg(value: str) -> int:
    """`--tokenizer-threads`: "auto" (the CPUs this process may run on) or an integer in [1, 1024]."""
    from sluice.tokenize.encoder import available_cpus

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
    import os

    for flag, path in (("--cache", args.cache), ("--state-dir", args.state_dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise SpecError(f"loaderd: {flag} {path} exists and is not a folder")
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
    from sluice.wire import read_token_file

    token = read_token_file(args.token_file) if args.token_file else None
    return ServerConfig(
        manifest=manifest,
        spec=spec,
        cache_dir=args.cache,
        cache_budget_bytes=parse_size(args.cache_budget),
        replicas=args.replicas,
        serve=serve,
        endpoint=args.endpoint,
        state_dir=args.state_dir,
        metrics_port=args.metrics_port,
        metrics_ids=args.metrics_ids,
        memory_limit=args.memory_limit if args.memory_limit in ("auto", "off") else parse_size(args.memory_limit),
        workers=args.workers,
        worker_kind=args.worker_kind,
        demand_workers=demand_workers_arg(args.demand_workers),
        tokenizer_threads=threads,
        producer=args.producer, jit=args.jit,
        manifest_path=args.manifest,
        runspec_path=args.runspec,
        lead_steps=args.lead_steps,
        queue_bytes=parse_size(args.queue_bytes),
        decoded_bytes=parse_size(args.decoded_bytes),
        scrub_rate=parse_size(args.scrub_rate),
        request_ttl_s=args.request_ttl,
        verify_on_read=not args.no_verify_on_read,
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
        running = server.close() + _busy_threads()  # within Server.close's bound (docs/loaderd.md, "Stopping")
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
    import os

    logging.getLogger("sluice.loaderd").warning(
        "loaderd: stopped; leaving without waiting for work still running", extra={"running": running})
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _pid() -> int:
    import os

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
