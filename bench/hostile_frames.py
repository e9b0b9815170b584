"""Benchmark (issue 10 item 7): loaderd's memory while peers send huge multipart messages.

A daemon with a run token on a small corpus; first a stranger (no token, so no
PLAIN credentials) sends 3 messages of 250 frames x 4 MiB, then a token holder
sends the same. Prints the daemon's VmHWM (peak RSS, /proc/PID/status) before,
after the stranger and after the token holder, and the replies.

The stranger's frames are never accepted (its handshake is refused); a token
holder is trusted, and libzmq assembles one whole multipart message before
the daemon sees its first frame, so its peak is about one message
(docs/hardening.md). Run: ``.venv/bin/python bench/hostile_frames.py`` (about
half a minute; sends 6 GiB over an ipc socket).
"""

from __future__ import annotations

import sys

_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))

import zmq  # noqa: E402

from loaderd_support import Daemon, build_corpus, chunks  # noqa: E402
from sluice import wire  # noqa: E402

TOKEN = "bench-token-" + "7" * 24
FRAMES, FRAME_BYTES, MESSAGES = 250, 4 << 20, 3


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return 0


def blast(endpoint: str, password: str | None) -> list[str]:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if password is not None:
        s.plain_username = wire.TOKEN_USER.encode()
        s.plain_password = password.encode()
    s.connect(endpoint)
    header = wire.encode_header(wire.Header(kind=wire.STATS, body={"token": password or ""}))
    big = b"\1" * FRAME_BYTES
    for _ in range(MESSAGES):
        s.send_multipart([header] + [big] * FRAMES, copy=False)
    replies = []
    while len(replies) < MESSAGES and s.poll(20_000 if password else 3_000):
        replies.append(wire.decode(s.recv_multipart(), wire.Limits.for_client()).body.get("code", "?"))
    s.close(0)
    return replies


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "texts.txt").write_text("".join(chunks(200)))
        subprocess.run([sys.executable, "-m", "sluice.cli", "tokenize", "train", str(root / "texts.txt"), "-o",
                        str(root / "tok.json"), "--vocab-size", "1024", "--special", "<|endoftext|>",
                        "--special", "<|pad|>"], check=True, capture_output=True)
        build_corpus(root / "corpus", "jsonl.zst", root / "tok.json")
        d = Daemon(root / "corpus", token=TOKEN).start()
        try:
            start = peak_rss(d.pid)
            stranger = blast(d.endpoint, None)
            after_stranger = peak_rss(d.pid)
            holder = blast(d.endpoint, TOKEN)
            after_holder = peak_rss(d.pid)
        finally:
            d.stop()
    mib = 1 << 20
    print(f"{MESSAGES} messages of {FRAMES} x {FRAME_BYTES // mib} MiB frames")
    print(f"daemon peak RSS at start          {start / mib:8.0f} MiB")
    print(f"after a stranger (no token)       {after_stranger / mib:8.0f} MiB   replies: {stranger or 'none'}")
    print(f"after a token holder              {after_holder / mib:8.0f} MiB   replies: {holder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
