"""Benchmark (issue 10 item 7, issue 27 item 7): loaderd's memory while peers send huge multipart messages.

A daemon with a run token on a small corpus and a good client reading steps
all along. First a stranger (no token, so no PLAIN credentials) sends 3
messages of 250 frames x 4 MiB; then three token holders send one such
message each, at once, on three connections. Prints the daemon's VmHWM (peak
RSS, /proc/PID/status) before, after the stranger and after the token
holders, their replies, and the good client's longest wait for a micro-batch.

The stranger's frames are never accepted (its handshake is refused). libzmq
assembles a whole multipart message before the daemon sees its first frame and
bounds only each frame, so the token holders' bytes are held by libzmq until
the memory guard (`--memory-limit`, sluice/loaderd/memguard.py) drops every
connection; the good client then finds the new instance after its `timeout_s`
and restores (docs/hardening.md). Run: ``.venv/bin/python bench/hostile_frames.py``
(under a minute; sends 6 GiB over an ipc socket). Extra arguments go to loaderd.
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))

import zmq  # noqa: E402

from loaderd_support import Daemon, build_corpus, chunks  # noqa: E402
from sluice.client.transport import close_dealer, dealer  # noqa: E402
from sluice.wire import decoding, encoding, protocol  # noqa: E402

TOKEN = "bench-token-" + "7" * 24
FRAMES, FRAME_BYTES, MESSAGES = 250, 4 << 20, 3


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return 0


def blast(endpoint: str, password: str | None, senders: int) -> list[str]:
    """`senders` connections at once, each sending MESSAGES // senders messages; the replies' codes."""
    header = encoding.encode_header(protocol.Header(kind=protocol.STATS, body={"token": password or ""}))
    big = b"\1" * FRAME_BYTES
    replies: list[str] = []

    def one() -> None:
        s = dealer(zmq.Context.instance(), endpoint, token=password)  # PLAIN with a token, else NULL
        n = MESSAGES // senders
        for _ in range(n):
            try:  # not blocking: a refused handshake leaves the DEALER no pipe to send on (transport.py)
                s.send_multipart([header] + [big] * FRAMES, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
        got = 0
        while got < n and s.poll(15_000 if password else 3_000):
            replies.append(decoding.decode(s.recv_multipart(), protocol.Limits.for_client()).body.get("code", "?"))
            got += 1
        replies.extend(["none"] * (n - got))
        close_dealer(s)

    threads = [threading.Thread(target=one) for _ in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "texts.txt").write_text("".join(chunks(200)))
        subprocess.run([sys.executable, "-m", "sluice.cli", "tokenize", "train", str(root / "texts.txt"), "-o",
                        str(root / "tok.json"), "--vocab-size", "1024", "--special", "<|endoftext|>",
                        "--special", "<|pad|>"], check=True, capture_output=True)
        build_corpus(root / "corpus", "jsonl.zst", root / "tok.json")
        d = Daemon(root / "corpus", token=TOKEN, extra=tuple(sys.argv[1:])).start()
        client = d.client(token=TOKEN, timeout_s=10)
        gaps: list[float] = []
        stop = threading.Event()

        def read() -> None:  # the good client: one micro-batch every 10 ms, its waits noted
            last = time.monotonic()
            for _ in client:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if stop.wait(0.01):
                    return

        reader = threading.Thread(target=read, daemon=True)
        try:
            reader.start()
            start = peak_rss(d.pid)
            stranger = blast(d.endpoint, None, 1)
            after_stranger = peak_rss(d.pid)
            holder = blast(d.endpoint, TOKEN, MESSAGES)
            after_holder = peak_rss(d.pid)
            stop.set()
            reader.join(30)
            client.close()
        finally:
            d.stop()
    mib = 1 << 20
    print(f"{MESSAGES} messages of {FRAMES} x {FRAME_BYTES // mib} MiB frames ({' '.join(sys.argv[1:]) or 'defaults'})")
    print(f"daemon peak RSS at start          {start / mib:8.0f} MiB")
    print(f"after a stranger (no token)       {after_stranger / mib:8.0f} MiB   replies: {stranger or 'none'}")
    print(f"after 3 token holders at once     {after_holder / mib:8.0f} MiB   replies: {holder}")
    print(f"good client: {len(gaps)} micro-batches, longest wait {max(gaps, default=0):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
