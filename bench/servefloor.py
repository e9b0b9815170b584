"""Benchmark: the serving floor from tokens: what a Python daemon/client pair costs per micro-batch (issue 9).

`bench/steady.py` measures the daemon with its producer at work. This bench
takes the producer away, step by step, to show how much of the steady rate is
the producer's and what the serving path alone costs (bench/results/peers-log.md,
"What limits the misses"). Four jobs, each a fresh consumer process
(``python -c``, run from the tree under test), interleaved in rounds, each
taking `--warm` micro-batches and then measuring `--mbs` of the bench's size
(a real micro-batch of the bench/peers corpus: 8 x 2048 ids, labels, position
ids, cu_seqlens; one per step, the data state on each):

* ``steady``  -- the real daemon and the real client (`bench/steady.py`'s job);
* ``premade`` -- the same, but every step made before the measured window
  (run spec ``max_steps`` = warm + mbs, ``--lead-steps`` past it, so the
  producer thread is idle while the client drains the queue): the IO loop
  and the client alone, every per-GET path the real one;
* ``wire``    -- the real `sluice.client.Client` against a minimal ROUTER
  loop in its own process that answers each GET with the same pre-built
  micro-batch: the GET's JSON parsed, the BATCH header from
  `encoding.BatchHeaders` with the data state (the bench's real one, its step
  set per reply), the arrays sent as the daemon sends them (the three
  planes back to back in one block, so packed in one frame for a client
  whose GET asks; `endpoint.send_frames`, frames under
  `stepqueue.COPY_BELOW` copied); no
  validation, queue, fencing or metrics: the floor of a Python daemon that
  speaks the protocol;
* ``raw``     -- a bare pyzmq DEALER loop (constant GET bytes; per reply
  ``recv_multipart(copy=False)``, ``np.frombuffer`` and the sum every
  consumer does) against a bare ROUTER loop replying constant frames of the
  same sizes: the interpreter and the socket per message, on both sides.
* ``shm``     -- ``raw`` with the arrays handed over through shared memory (not
  something sluice does: what it would cost): the server writes each reply's
  arrays into a slot of a mapped file of 16 slots and sends the header and
  the slot's number; the consumer copies the slot out into its own array
  before the next GET (so that a slot is never written while read). The
  difference to ``raw`` is what moving the bytes through the socket costs.

All with 8 GETs in flight (the client's default credits). CPU per
micro-batch is read per thread from ``/proc/PID/task/TID/schedstat``
(nanoseconds on a CPU): the server's main thread (the daemon's IO loop), its
other Python threads (the producer), libzmq's IO threads (``ZMQbg/*``), and
the consumer process's main thread and libzmq threads. ``--litdata`` also
runs bench/peers' LitData job (its venv and prepared data: `make
bench-peers`) in the same rounds, for the rate 3x is measured against.

Run: ``.venv/bin/python bench/servefloor.py [--rounds 3] [--mbs 4000] [--jobs steady,premade,wire,raw]
[--litdata] [--base DIR]``; prints one line per job, medians; writes bench/out/servefloor.json.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent

# The consumer of every job but LitData's. Prints one JSON line.
CONSUMER = r"""
import json, os, sys, time, subprocess
import numpy as np

cfg = json.loads(sys.argv[1])
mode, warm, n = cfg["mode"], cfg["warm"], cfg["mbs"]


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue
        out[(int(tid), name)] = ns / 1e9
    return out


def split(before, after, pid):
    # ms per micro-batch: main thread, libzmq's IO threads, the other threads largest first
    main = zmq_ms = 0.0
    others = []
    for (tid, name), v in after.items():
        ms = (v - before.get((tid, name), 0.0)) / n * 1e3
        if name.startswith("ZMQbg"):
            zmq_ms += ms
        elif tid == pid:
            main = ms
        else:
            others.append(ms)
    return {"main": main, "zmq": zmq_ms, "others": sorted(others, reverse=True)[:2]}


def measure(pid, take):
    me = os.getpid()
    b_srv, b_me, t0 = threads(pid), threads(me), time.perf_counter()
    tokens = take(n)
    wall = time.perf_counter() - t0
    a_srv, a_me = threads(pid), threads(me)
    return {"tokens_per_s": tokens / wall, "server": split(b_srv, a_srv, pid), "client": split(b_me, a_me, me)}


def settle(pid, timeout_s=180.0):
    # until the daemon's threads but its IO loop and libzmq's use < 2 ms of CPU in 0.25 s (the producer done)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        now = sum(v for (tid, name), v in threads(pid).items() if tid != pid and not name.startswith("ZMQbg"))
        if last is not None and now - last < 0.002:
            return
        last = now
        time.sleep(0.25)
    raise SystemExit(f"servefloor: the producer did not settle within {timeout_s:.0f} s")


if mode in ("steady", "premade"):
    from sluice.client import embedded_client

    c = embedded_client(cfg["manifest"], cfg["runspec"], cache_dir=cfg["cache"], as_numpy=True,
                        daemon_args=tuple(cfg["daemon_args"]))
    try:
        it = iter(c)
        for _ in range(warm):
            next(it)
        pid = c.daemon.proc.pid
        if mode == "premade":
            settle(pid)

        def take(k):
            tokens = 0
            for _ in range(k):
                ids = next(it)["input_ids"]
                int(ids.sum())
                tokens += ids.size
            return tokens

        out = measure(pid, take)
    finally:
        c.close()
else:
    import zmq

    ep = "ipc://" + os.path.join(cfg["tmp"], f"floor-{os.getpid()}.sock")
    srv = subprocess.Popen([sys.executable, "-c", cfg["server"], json.dumps({**cfg, "endpoint": ep})],
                           stdout=subprocess.PIPE)
    try:
        assert srv.stdout.readline().strip() == b"ready"
        if mode == "wire":
            from sluice.client import Client

            c = Client(ep, run_id=cfg["run_id"], dataset_id=cfg["dataset_id"], as_numpy=True)
            it = iter(c)

            def take(k):
                tokens = 0
                for _ in range(k):
                    ids = next(it)["input_ids"]
                    int(ids.sum())
                    tokens += ids.size
                return tokens
        else:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            get = open(cfg["get_path"], "rb").read()
            for _ in range(8):
                s.send(get, copy=False)
            shape = tuple(cfg["ids_shape"])

            def take(k):
                tokens = 0
                for _ in range(k):
                    frames = s.recv_multipart(copy=False)
                    ids = np.frombuffer(frames[1].buffer, dtype="<i4").reshape(shape)
                    int(ids.sum())
                    tokens += ids.size
                    s.send(get, copy=False)
                return tokens

            if mode == "shm":
                import mmap
                ring = None

                def take(k):
                    global ring
                    tokens, n = 0, int(np.prod(shape)) * 4
                    for _ in range(k):
                        frames = s.recv_multipart(copy=False)
                        if ring is None:  # (the server made the file before its first reply)
                            with open(cfg["ring_path"], "rb") as f:
                                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                            ring = np.frombuffer(m, np.uint8).reshape(16, -1)
                        mine = ring[int.from_bytes(frames[1].bytes, "little")].copy()
                        ids = mine[:n].view("<i4").reshape(shape)
                        int(ids.sum())
                        tokens += ids.size
                        s.send(get, copy=False)
                    return tokens
        take(warm)
        out = measure(srv.pid, take)
    finally:
        srv.terminate()
        srv.wait(10)
print(json.dumps(out))
"""

# The minimal ROUTER loop of the `wire` and `raw` jobs (its own process). Runs until terminated.
SERVER = r"""
import json, signal, sys
import numpy as np
import zmq
from sluice.wire import encoding, protocol
from sluice.loaderd.endpoint import send_frames
from sluice.loaderd.physical.stepqueue import COPY_BELOW

cfg = json.loads(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
data = np.load(cfg["batch_path"])
arrays = {k: np.ascontiguousarray(data[k]) for k in protocol.BATCH_ARRAYS}
# as the producer makes them: the three planes back to back in one block (packed for a client that asks)
block = np.stack([arrays["input_ids"], arrays["labels"], arrays["position_ids"]])
planes = {"input_ids": block[0], "labels": block[1], "position_ids": block[2], "cu_seqlens": arrays["cu_seqlens"]}
# what the tree under test's daemon does (a --base tree may predate packing)
import inspect
packs = "pack_below" in inspect.signature(encoding.BatchHeaders.frames).parameters
# The daemon's producer frees multi-MiB numpy blocks, which raises glibc's mmap and trim thresholds (its
# dynamic adjustment) above a copied frame; one such free here does the same. Without it a packed 192 KiB
# frame was mmapped, faulted and zeroed per reply (this loop's CPU per micro-batch 0.028 -> 0.059 ms).
np.ones(16 << 20, np.uint8)  # (freed at once)
pre, post = open(cfg["state_path"], "rb").read().split(b"@STEP@")
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.copy_threshold = COPY_BELOW  # as the daemon's ROUTER (sluice/loaderd/physical/stepqueue.py)
sock.bind(cfg["endpoint"])
print("ready", flush=True)
if cfg["mode"] == "raw":
    const = [open(cfg["header_path"], "rb").read(), *(a.reshape(-1).view(np.uint8) for a in arrays.values())]
    while True:
        frames = sock.recv_multipart(copy=False)
        send_frames(sock, [frames[0], *const])
if cfg["mode"] == "shm":
    import mmap
    payload = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays.values()])
    with open(cfg["ring_path"], "w+b") as f:
        f.truncate(16 * payload.size)
        ring = np.frombuffer(mmap.mmap(f.fileno(), 16 * payload.size), np.uint8).reshape(16, payload.size)
    header, i = open(cfg["header_path"], "rb").read(), 0
    while True:
        frames = sock.recv_multipart(copy=False)
        ring[i % 16] = payload
        send_frames(sock, [frames[0], header, (i % 16).to_bytes(8, "little")])
        i += 1
heads = encoding.BatchHeaders(run_id=cfg["run_id"], dataset_id=cfg["dataset_id"], generation=0, replica=0,
                              instance="floor")
loads = json.loads
while True:
    frames = sock.recv_multipart(copy=False)
    h = loads(frames[1].bytes)
    if h["kind"] == protocol.GET:
        step = h["step"]
        body = encoding.BatchHeaders.body(1, None, pre + str(step).encode() + post)
        send_frames(sock, [frames[0], *heads.frames(step=step, micro=h["micro"], request_id=h["request_id"],
                                                      body=body, arrays=planes,
                                                      **({"pack_below": COPY_BELOW if h["body"].get("packed") else 0}
                                                         if packs else {}))])
    elif h["kind"] == protocol.HELLO:
        reply = protocol.Header(kind=protocol.HELLO_OK, run_id=cfg["run_id"], dataset_id=cfg["dataset_id"], replica=0,
                                step=h["step"], request_id=h["request_id"], instance="floor",
                                body={"instance": "floor", "generation": 0, "floor_step": 0, "micro_per_step": 1})
        send_frames(sock, [frames[0], *encoding.encode(reply)])
"""

# One micro-batch of the bench's run and its data state, as the floor servers send them.
SAMPLE = r"""
import json, sys
import numpy as np
from sluice.wire import encoding, protocol
from sluice.client import embedded_client
from sluice.client.requests import GetFrames

cfg = json.loads(sys.argv[1])
c = embedded_client(cfg["manifest"], cfg["runspec"], cache_dir=cfg["cache"], as_numpy=True)
try:
    batch = next(iter(c))
    state = c._state  # the data state after that step, as its BATCH carried it
    run_id, dataset_id = c.run_id, c.dataset_id
finally:
    c.close()
np.savez(cfg["batch_path"], **{k: batch[k] for k in protocol.BATCH_ARRAYS})
marker = 987654321987
head, tail = encoding.json_bytes({**state, "step": marker}).split(str(marker).encode())
open(cfg["state_path"], "wb").write(head + b"@STEP@" + tail)
heads = encoding.BatchHeaders(run_id=run_id, dataset_id=dataset_id, generation=0, replica=0, instance="floor")
body = encoding.BatchHeaders.body(1, None, head + b"4000" + tail)
open(cfg["header_path"], "wb").write(heads.frames(step=4000, micro=0, request_id=4000, body=body,
                                                  arrays={k: batch[k] for k in protocol.BATCH_ARRAYS})[0])
get = GetFrames(run_id=run_id, dataset_id=dataset_id, generation=0, replica=0, instance="floor", token=None,
                samples=False, observe=False)
open(cfg["get_path"], "wb").write(get.frames(step=4000, micro=0, request_id=4000, input_wait_s=0.000123)[0])
print(json.dumps({"run_id": run_id, "dataset_id": dataset_id, "ids_shape": list(batch["input_ids"].shape),
                  "state_bytes": len(head) + len(tail) + 4}))
"""


def run_py(tree: Path, code: str, cfg: dict, timeout_s: float) -> dict:
    """`python -c code cfg` from `tree` (cwd and PYTHONPATH); its last JSON line, or {"error": ...}."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


def line(label: str, r: dict) -> str:
    if "error" in r:
        return f"{label:16s} error: {r['error']}"
    if "server" not in r:  # LitData
        return f"{label:16s} {r['tokens_per_s'] / 1e6:6.1f} M tok/s"
    s, c = r["server"], r["client"]
    mb_ms = 16384 / r["tokens_per_s"] * 1e3
    return (f"{label:16s} {r['tokens_per_s'] / 1e6:6.1f} M tok/s ({mb_ms:.3f} ms/mb)  server: main {s['main']:.3f}, "
            f"other {sum(s['others']):.3f}, libzmq {s['zmq']:.3f}  client: main {c['main']:.3f}, "
            f"libzmq {c['zmq']:.3f}, other {sum(c['others']):.3f} ms/mb")


def median_of(runs: list[dict]) -> dict | None:
    good = [r for r in runs if "error" not in r]
    if not good:
        return None
    med: dict = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in good)}
    for side in ("server", "client"):
        if side in good[0]:
            med[side] = {k: statistics.median(r[side][k] for r in good) for k in ("main", "zmq")}
            med[side]["others"] = [statistics.median(sum(r[side]["others"]) for r in good)]
    return med


def litdata_job(batches: int, timeout_s: float):
    """bench/peers' LitData job as a callable, or why it cannot run."""
    sys.path.insert(0, str(_REPO / "bench/peers"))
    import corpus  # noqa: PLC0415 - bench/peers' own modules
    import run as peers  # noqa: PLC0415
    import venvs  # noqa: PLC0415

    paths = corpus.prepare(peers.HERE / "work" / "full", mb=50, vocab=32000)
    why = venvs.status("litdata")
    if why is None and not (Path(paths["manifest"]).parent / "peerdata" / "litdata" / "index.json").exists():
        why = "LitData's data is not prepared (bench/peers/run.py --peers litdata once)"
    if why:
        return why
    extra = dict(next(spec[4] for spec in peers.LOADERS if spec[0] == "litdata"))

    def job(_tree: Path) -> dict:
        scratch = Path(tempfile.mkdtemp(prefix="servefloor-litdata-"))
        try:
            return peers.run_job(venvs.python_of("litdata"), "litdata_job.py",
                                 peers.job_config("litdata", extra, paths, batches, scratch), timeout_s)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/servefloor.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=str(_REPO / "bench/peers/work/full"), help="a prepared bench/peers corpus")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--mbs", type=int, default=4000, help="micro-batches measured per job (default 4000)")
    ap.add_argument("--warm", type=int, default=100, help="micro-batches taken before measuring (default 100)")
    ap.add_argument("--jobs", default="steady,premade,wire,raw", help="which jobs: steady, premade, wire, raw, shm "
                    "(default the first four)")
    ap.add_argument("--litdata", action="store_true", help="also bench/peers' LitData job, in the same rounds")
    ap.add_argument("--litdata-batches", type=int, default=150, help="LitData's micro-batches (bench/peers' 150)")
    ap.add_argument("--base", metavar="TREE", help="also run the sluice jobs from this source tree, interleaved")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    a = ap.parse_args(argv)
    corpus = Path(a.corpus)
    if not (corpus / "derived/manifest.json").exists():
        print(f"bench/servefloor.py: error: {corpus} holds no prepared corpus (derived/manifest.json); "
              "run `make bench-peers` (or bench/peers/run.py --peers 'sluice pretok') once", file=sys.stderr)
        return 2
    jobs = [j for j in a.jobs.split(",") if j]
    bad = [j for j in jobs if j not in ("steady", "premade", "wire", "raw", "shm")]
    if bad:
        ap.error(f"--jobs: unknown job(s) {bad}; choose from steady, premade, wire, raw, shm")
    tmp = Path(tempfile.mkdtemp(prefix="servefloor-"))
    try:
        runspec = corpus / "run.toml"
        premade_spec = tmp / "run-premade.toml"
        steps = a.warm + a.mbs + 16
        premade_spec.write_text(runspec.read_text() + f"\nmax_steps = {steps}\n")
        base = {"manifest": str(corpus / "derived/manifest.json"), "runspec": str(runspec),
                "cache": str(corpus / "cache-pretok"), "mbs": a.mbs, "warm": a.warm, "tmp": str(tmp),
                "batch_path": str(tmp / "batch.npz"), "state_path": str(tmp / "state.json"),
                "header_path": str(tmp / "header.bin"), "get_path": str(tmp / "get.bin")}
        sample = run_py(_REPO, SAMPLE, base, a.timeout)
        if "error" in sample:
            print(f"bench/servefloor.py: error: taking the sample micro-batch: {sample['error']}", file=sys.stderr)
            return 1
        print(f"sample micro-batch: input_ids {sample['ids_shape']}, data state {sample['state_bytes']} bytes",
              flush=True)
        cfgs = {
            "steady": {**base, "mode": "steady", "daemon_args": []},
            "premade": {**base, "mode": "premade", "runspec": str(premade_spec),
                        "daemon_args": ["--lead-steps", str(steps), "--queue-bytes", "8GiB"]},
            "wire": {**base, **sample, "mode": "wire", "server": SERVER},
            "raw": {**base, **sample, "mode": "raw", "server": SERVER},
            "shm": {**base, **sample, "mode": "shm", "server": SERVER, "ring_path": str(tmp / "ring.bin")},
        }
        trees = [("", _REPO)] + ([(" @base", Path(a.base).resolve())] if a.base else [])
        plan = [(f"{j}{suffix}", (lambda tree, j=j: run_py(tree, CONSUMER, cfgs[j], a.timeout)), tree)
                for j in jobs for suffix, tree in trees if not (suffix and j in ("raw", "shm"))]
        if a.litdata:
            job = litdata_job(a.litdata_batches, a.timeout)
            if isinstance(job, str):
                print(f"bench/servefloor.py: LitData not run: {job}", file=sys.stderr)
            else:
                plan.append(("litdata", job, _REPO))
        results: dict[str, list[dict]] = {label: [] for label, _, _ in plan}
        for rnd in range(a.rounds):
            for label, fn, tree in plan:
                r = fn(tree)
                r["load_avg"] = os.getloadavg()[0]
                results[label].append(r)
                print(f"round {rnd + 1}/{a.rounds} " + line(label, r) + f"  (load {r['load_avg']:.1f})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {label: median_of(runs) for label, runs in results.items()}
    for label, med in medians.items():
        if med is not None:
            print("median   " + line(label, med))
    lit = medians.get("litdata")
    if lit:
        for label, med in medians.items():
            if med is not None and label != "litdata":
                print(f"ratio    {label:16s} {med['tokens_per_s'] / lit['tokens_per_s']:.2f}x LitData")
    out = _REPO / "bench/out/servefloor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "servefloor", "mbs": a.mbs, "rounds": a.rounds, "base": a.base,
                               "sample": sample, "runs": results, "medians": medians}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
