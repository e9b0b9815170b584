"""`sluice peek ENDPOINT --steps A:B --replica r [--replicas R] [--json]`.

Reads steps [A, B) of one replica from a live daemon and prints, per step, the
same line as `sluice plan`: with ``--json`` one object per line
``{"step", "replica", "digest", "samples"}`` where `digest` is the
micro-batches digest (docs/protocol.md, BLAKE3 over input_ids, labels,
position_ids, cu_seqlens of each micro-batch as little-endian int32) and
`samples` the sample IDs in order of first appearance.

peek is a client like any other: by default it consumes the steps it reads.
`--observe` reads without consuming (the daemon keeps the steps for the
trainer), which only reaches steps the daemon has prefetched or will prefetch.
The run ID, dataset ID and replica count come from the daemon (STATS) unless
given.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from sluice.cliargs import ranged, step_range
from sluice.errors import SpecError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("peek", help="print digests and sample IDs of steps read from a live loaderd",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("endpoint", help="daemon endpoint, e.g. ipc:///tmp/sluice-loaderd-x/loaderd.sock")
    p.add_argument("--steps", type=step_range("--steps"), required=True, metavar="A:B",
                   help="steps A (inclusive) to B (exclusive)")
    p.add_argument("--replica", type=int, default=0, help="replica r (default 0)")
    p.add_argument("--replicas", type=int, default=None, help="data-parallel size R (default: the daemon's)")
    p.add_argument("--run-id", default=None, help="run ID (default: the daemon's)")
    p.add_argument("--dataset-id", default=None, help="dataset ID (default: the daemon's)")
    p.add_argument("--observe", action="store_true", help="read without consuming the steps")
    # bounded: a negative poll timeout would wait forever
    p.add_argument("--timeout", type=ranged(float, 0, 86_400, "--timeout", low_open=True), default=30.0,
                   help="seconds to wait for the daemon (default 30)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the run token of a daemon started with --token-file "
                        "(default: $SLUICE_TOKEN)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=_peek)


def daemon_stats(endpoint: str, timeout_s: float, token: str | None = None) -> dict[str, Any]:
    """The STATS body of the daemon at `endpoint` (its ``stats`` object), asked once with `token`.

    Raises `DaemonUnavailable` when no daemon answers within `timeout_s` (at once when the OS says nothing
    listens there), `SpecError` for an endpoint libzmq does not understand, and the mapped wire error for an
    ERROR reply. `sluice peek` and `sluice top` (observe/scrape.py) ask through it.
    """
    import zmq

    from sluice.client.probe import nothing_listens
    from sluice.client.transport import close_dealer, dealer, poll_or_refused, send_or_refused
    from sluice.errors import DaemonUnavailable
    from sluice.wire import decoding, encoding, errorcodes, protocol

    try:
        sock = dealer(zmq.Context.instance(), endpoint, token=token)
    except zmq.ZMQError as exc:  # not an endpoint libzmq understands
        raise SpecError(f"peek: endpoint {endpoint!r:.200}: {exc}") from exc
    try:
        body = {"token": token} if token else {}
        frames = encoding.encode(protocol.Header(kind=protocol.STATS, request_id=1, body=body))
        if not send_or_refused(sock, frames, timeout_s, endpoint):
            raise DaemonUnavailable(f"no loaderd took a request at {endpoint} within {timeout_s} s")
        # Wait in slices: when the OS says nothing listens there, say so at once
        # rather than after the whole timeout (a slow daemon is waited for).
        deadline = time.monotonic() + timeout_s
        while not poll_or_refused(sock, max(0.0, min(0.5, deadline - time.monotonic())), endpoint):
            if time.monotonic() >= deadline:
                raise DaemonUnavailable(f"no loaderd answered at {endpoint} within {timeout_s} s")
            if nothing_listens(endpoint):
                raise DaemonUnavailable(f"nothing listens at {endpoint}: is loaderd running, and is this the "
                                        "endpoint it printed on start?")
        msg = decoding.decode(sock.recv_multipart(copy=False), protocol.Limits.for_client())
        if msg.kind == protocol.ERROR:
            errorcodes.raise_for(msg)
        return dict(msg.body["stats"])
    finally:
        close_dealer(sock)


def _peek(args: argparse.Namespace) -> int:
    import numpy as np

    from sluice.client.iterator import Client
    from sluice.wire.protocol import ARRAY_ORDER, arrays_digest
    from sluice.wire.runtoken import TOKEN_ENV, read_token_file

    start, stop = args.steps
    token = read_token_file(args.token_file) if args.token_file else os.environ.get(TOKEN_ENV) or None
    stats = daemon_stats(args.endpoint, args.timeout, token)
    replicas = args.replicas or int(stats["replicas_total"])
    if args.replica not in stats.get("served", [args.replica]):
        raise SpecError(f"peek: the daemon at {args.endpoint} serves replicas {stats.get('served')}, not {args.replica}")
    client = Client(args.endpoint, args.replica, replicas, run_id=args.run_id or stats["run_id"],
                    dataset_id=args.dataset_id or stats["dataset_id"], credits=4, samples=True,
                    observe=args.observe, start_step=start, end_step=stop, timeout_s=args.timeout, as_numpy=True,
                    token=token)
    try:
        micros: list[dict[str, Any]] = []
        samples: dict[str, None] = {}
        for mb in client:
            micros.append({k: np.asarray(mb[k]) for k in ARRAY_ORDER})
            for sid in mb["samples"]:
                samples.setdefault(sid, None)
            if mb["micro"] + 1 < int(client.info["micro_per_step"]):
                continue
            line = {"step": mb["step"], "replica": args.replica, "digest": arrays_digest(micros),
                    "samples": list(samples)}
            if args.json:
                print(json.dumps(line), flush=True)
            else:
                s = line["samples"]
                print(f"step {line['step']:>6} replica {args.replica}  {line['digest'][:16]}  {len(s)} samples  "
                      f"first {s[0] if s else '-'}", flush=True)
            micros, samples = [], {}
            if mb["step"] + 1 >= stop:
                break
    finally:
        client.close()
    return 0
