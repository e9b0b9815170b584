"""Verified on the way out (issue 27, item 1): a damaged node cache never serves a wrong byte.

A real daemon serves from a real warmed node cache (raw objects and their
token objects, made by `sluice cache warm --tokens`). While it serves, one
byte is flipped in place in every object file of that cache (what bit rot
surfacing through the page cache, a bad disk or a stray writer leaves).
Every step read afterwards must equal `sluice plan`'s, every damaged object
must be named in the daemon's log and in its metrics, and the cache must end
with verified copies of every object again.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loaderd_support import Daemon, build_corpus, reference, stream_digests
from test_producer_metrics import scrape

STEPS = 1500
FLIP_AT = 200


def flip_every_object(cache: Path) -> list[str]:
    """Flip one byte in the middle of every published object file, in place; their 64-hex names."""
    names = []
    for path in sorted((cache / "objects").glob("*/*")):
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x5A]))
        names.append(path.name)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("producer", ["thread", "process"])
def test_a_byte_flipped_in_every_cached_object_while_serving_changes_no_step(tmp_path, tokenizer_file, producer):
    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file)
    cache = tmp_path / "cache"
    warm = subprocess.run([sys.executable, "-m", "sluice.cli", "cache", "warm", str(root / "manifest.json"),
                           str(cache), "--budget", "256MiB", "--tokens", "--json", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    manifest = json.loads((root / "manifest.json").read_text())
    raw_digests = {o["digest"] for src in manifest["sources"] for o in src["objects"]}
    expected = {step: digest for (step, _), (digest, _) in reference(root, STEPS, 1).items()}

    with Daemon(root, cache=cache, extra=("--metrics-port", "0", "--producer", producer)) as d:
        c = d.client(0, 1)
        per_step = 4  # build_corpus's run: global batch 8, micro batch 2, one replica
        batches = []
        flipped: list[str] = []
        for mb in c:
            batches.append({k: mb[k] for k in ("step", "input_ids", "labels", "position_ids", "cu_seqlens")})
            if mb["step"] == FLIP_AT and mb["micro"] == 0:
                flipped = flip_every_object(cache)
            if mb["step"] == STEPS - 1 and mb["micro"] + 1 == per_step:
                break
        assert c.info["micro_per_step"] == per_step
        c.close()
        assert len(flipped) >= 2 * len(raw_digests), flipped  # raw objects and their tokens at least
        got = stream_digests(batches, per_step)
        assert sorted(got) == list(range(STEPS))
        wrong = [s for s in range(STEPS) if got[s] != expected[s]]
        assert not wrong, f"steps that differ from the plan: {wrong[:20]}"
        # every damaged object the daemon read again is named: in its metrics...
        deadline = time.monotonic() + 20
        named: set[str] = set()
        while time.monotonic() < deadline:
            scraped = scrape(d.info["metrics_port"])
            named = {dict(k)["object"] for k in scraped.get("sluice_damaged_objects_total", {})}
            if raw_digests <= named:
                break
            time.sleep(0.5)
    log = d.log.read_text()
    # ... and its log: the token objects found changed while serving, and the raw objects re-fetched for them
    assert named == raw_digests, (named, log[-3000:])
    for digest in raw_digests:
        assert re.search(rf"damaged cached object: tokens of source 'code' object \S+ \({digest}\)", log), log[-3000:]
        assert re.search(rf"damaged cached object: raw source 'code' object \S+ \({digest}\)", log), log[-3000:]
    # the cache holds verified copies again: `sluice cache verify` finds nothing damaged
    check = subprocess.run([sys.executable, "-m", "sluice.cli", "cache", "verify", str(cache), "--json"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["damaged"] == []
