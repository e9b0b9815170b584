"""Benchmark: the IO thread's socket calls beside a busy Python thread, through pyzmq and through heldzmq.

What sluice/loaderd/heldzmq.py changes, alone: a ROUTER in this process answers
GETs from a DEALER in another process (a request of one frame, a reply of
identity + header + one 64-byte reference frame, as a ring's BATCH is) while a
second thread of this process runs Python without pause (a producer between
its compiled calls). Each round runs both ways, interleaved: the ROUTER's
receives and sends through pyzmq (which releases the GIL around each frame)
and through `heldzmq` (which keeps it). Reported per GET, medians over
rounds: wall time of the round trip, CPU of this process (both threads), and
how many times the busy thread ran during the IO thread's calls.

Run: ``.venv/bin/python bench/gil_handoff.py [--rounds 7] [--gets 3000]``; prints a table and one JSON
line, writes bench/out/gil_handoff.json.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import zmq  # noqa: E402

from sluice.loaderd import endpoint, heldzmq  # noqa: E402
from sluice.wire import protocol  # noqa: E402

ASKER = r"""
import sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.connect(sys.argv[1]); n = int(sys.argv[2])
get = b'{"kind":"GET","body":{"ring":true}}' + b" " * 180
t0 = time.perf_counter()
for _ in range(n):
    s.send(get)
    s.recv_multipart()
print(time.perf_counter() - t0, flush=True)
s.send(b"end"); s.close(0); ctx.term()
"""


def _round(held: bool, gets: int, where: str) -> dict:
    """One ROUTER serving `gets` GETs beside a busy thread; held: through heldzmq, else pyzmq."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{where}/r.sock")
    asker = subprocess.Popen([sys.executable, "-c", ASKER, f"ipc://{where}/r.sock", str(gets)], stdout=subprocess.PIPE)
    ticks, stop = [0], threading.Event()

    def busy() -> None:
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=busy)
    t.start()
    header, ref, limits, inside = b'{"kind":"BATCH"}' + b" " * 200, b"r" * 64, protocol.Limits(), 0
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    c0 = time.process_time()
    try:
        while True:
            if not poller.poll(1000):
                if asker.poll() is not None:
                    raise SystemExit(f"bench/gil_handoff.py: the asking process exited ({asker.returncode})")
                continue
            before = ticks[0]
            if held:
                frames = heldzmq.receive_bounded(router, limits)[0]
            else:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            if bytes(frames[1]) == b"end":
                break
            if held:
                heldzmq.send(router, [frames[0], header, ref], endpoint.COPY_BELOW)
            else:
                router.send_multipart([frames[0], header, ref], zmq.NOBLOCK)
            inside += ticks[0] != before
    finally:
        stop.set()
        t.join()
    cpu = time.process_time() - c0
    assert asker.stdout is not None
    wall = float(asker.stdout.readline())
    asker.wait(30)
    router.close(0)
    ctx.term()
    return {"us_per_get": 1e6 * wall / gets, "cpu_us_per_get": 1e6 * cpu / gets, "busy_ran_in_calls": inside / gets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gets", type=int, default=3000)
    a = ap.parse_args()
    if not heldzmq.available():
        print("bench/gil_handoff.py: heldzmq is not available here (libzmq not found in /proc/self/maps)",
              file=sys.stderr)
        return 1
    sys.setswitchinterval(0.0002)  # (the daemon's: config.switch_interval_s)
    runs: dict[str, list[dict]] = {"pyzmq": [], "heldzmq": []}
    with tempfile.TemporaryDirectory(prefix="sluice-gil-") as d:
        for r in range(a.rounds):
            for name in (("pyzmq", "heldzmq") if r % 2 == 0 else ("heldzmq", "pyzmq")):
                got = _round(name == "heldzmq", a.gets, d)
                runs[name].append(got)
                print(f"round {r + 1}/{a.rounds} {name:8} {got['us_per_get']:7.1f} us a GET, CPU "
                      f"{got['cpu_us_per_get']:6.1f} us, busy thread ran in {100 * got['busy_ran_in_calls']:.0f}% "
                      "of the calls", flush=True)
    med = {name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in runs.items()}
    print(f"{'median':8} {'us a GET':>9} {'CPU us':>7} {'busy ran in calls':>18}")
    for name, m in med.items():
        print(f"{name:8} {m['us_per_get']:9.1f} {m['cpu_us_per_get']:7.1f} {100 * m['busy_ran_in_calls']:17.0f}%")
    out = {"bench": "gil_handoff", "rounds": a.rounds, "gets": a.gets, "median": med, "runs": runs}
    print(json.dumps(out))
    path = Path(__file__).resolve().parent / "out" / "gil_handoff.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
