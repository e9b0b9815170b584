"""The peer loaders' virtualenvs: one per peer under bench/peers/.venvs/<peer>.

Each is created with ``python -m venv`` and filled by pip from PyPI wheels
(``--only-binary :all:``), torch pinned as in the repo's constraints.txt (every
job hands its micro-batches to the same consumer loop as torch tensors). A
stamp file (.installed) records success and the packages; a venv whose stamp
lists other packages than `PEERS` is filled again (pip adds what is new). A failed
install leaves ``.failed`` holding pip's last lines, so the driver reports
"not installed: <reason>" instead of crashing, and does not retry every run
(delete the folder to retry).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENVS = HERE / ".venvs"

# Packages of each peer's job (the loader itself, plus the same tokenizer
# library sluice uses, what the job reads with, and torch: the consumer loop's tensors, jobs/common.py).
PEERS: dict[str, list[str]] = {
    "webdataset": ["webdataset", "torch", "tokenizers", "numpy"],
    "hf_datasets": ["datasets", "torch", "tokenizers", "numpy", "zstandard"],
    "grain": ["grain", "torch", "tokenizers", "numpy", "zstandard"],
    "litdata": ["litdata", "torch", "tokenizers", "numpy", "zstandard"],
    "streaming": ["mosaicml-streaming", "torch", "tokenizers", "numpy", "zstandard"],
}


def python_of(peer: str) -> Path:
    return VENVS / peer / "bin" / "python"


def status(peer: str) -> str | None:
    """None when the peer's venv is ready, else why it is not."""
    root = VENVS / peer
    if (root / ".installed").exists():
        return None
    failed = root / ".failed"
    if failed.exists():
        return "not installed: " + failed.read_text().strip().splitlines()[-1][:160]
    return "not installed: venv missing"


def install(peer: str, *, timeout_s: float = 900.0) -> str | None:
    """Create and fill the peer's venv if absent; return None or the reason it failed."""
    root = VENVS / peer
    stamp = root / ".installed"
    if (stamp.exists() and stamp.read_text().split() == PEERS[peer]) or (root / ".failed").exists():
        return status(peer)
    root.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # (a stale one: filled again below)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--only-binary", ":all:",
           "-c", str(REPO / "constraints.txt"), *PEERS[peer]]
    try:
        if not python_of(peer).exists():
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=120)
        proc = subprocess.run(pip, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            (root / ".failed").write_text("\n".join(tail) or f"pip exit {proc.returncode}")
            return status(peer)
    except (subprocess.SubprocessError, OSError) as exc:
        root.mkdir(parents=True, exist_ok=True)
        (root / ".failed").write_text(f"{type(exc).__name__}: {exc}")
        return status(peer)
    (root / ".installed").write_text(" ".join(PEERS[peer]) + "\n")
    return None


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="bench/peers/venvs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("peers", nargs="*", metavar="PEER", help=f"peers to install (default: all of {', '.join(PEERS)})")
    chosen = ap.parse_args().peers
    for name in chosen:
        if name not in PEERS:
            ap.error(f"{name!r} is not a peer (choose from {', '.join(PEERS)})")
    for name in chosen or list(PEERS):
        print(name, install(name) or "ready", flush=True)
