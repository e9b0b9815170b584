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

from typing import Any

import pytest

from loaderd_support import Daemon, build_corpus, reference, scrape, stream_digests
from sluice.cache import NodeCache
from sluice.cache.chunks import signature
from sluice.loaderd.logical import Plan
from sluice.loaderd.physical.docsource import DocSource
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec

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
def test_a_byte_flipped_in_every_cached_object_while_serving_changes_no_step(tmp_path, tokenizer_file):
    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file)
    cache = tmp_path / "cache"
    warm = subprocess.run([sys.executable, "-m", "sluice.cli", "cache", "warm", str(root / "manifest.json"),
                           str(cache), "--budget", "256MiB", "--tokens", "--json", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    manifest = json.loads((root / "manifest.json").read_text())
    raw_digests = {o["digest"] for src in manifest["sources"] for o in src["objects"]}
    expected = {step: digest for (step, _), (digest, _) in reference(root, STEPS, 1).items()}

    with Daemon(root, cache=cache, extra=("--metrics-port", "0")) as d:
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


def _flip(path: str) -> None:
    size = Path(path).stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 1)
        b = f.read(1)
        f.seek(size - 1)
        f.write(bytes([b[0] ^ 1]))


def _opened(root: Path) -> tuple[Any, Any, Any]:
    """(manifest, reference plan, its first source) of a corpus folder."""
    manifest = load_manifest(root / "manifest.json")
    return manifest, Plan(manifest, load_runspec(root / "run.toml")), manifest.sources[0]


@pytest.fixture(scope="module")
def sltok(tmp_path_factory, tokenizer_file):
    return build_corpus(tmp_path_factory.mktemp("verify"), "sltok", tokenizer_file, docs=60, objects=2)


def test_check_reads_finds_a_changed_map_drops_it_and_the_next_read_is_verified(sltok, tmp_path):
    manifest, plan, src = _opened(sltok)
    ref = plan.ref(0, 0, src.objects[1].start + 3)
    with NodeCache(tmp_path / "cache", 1 << 30, verify_on_read=False) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            want = docs(ref).copy()
            docs.begin_reads()
            shards = docs.mapped(0, [1])
            assert shards is not None
            assert docs.check_reads() is True  # nothing changed: one fstat, no hashing
            pin = docs._lru[(0, 1)].pin
            _flip(pin.path)
            docs.mapped(0, [1])
            assert docs.check_reads() is False  # changed: verified again, damaged: dropped and quarantined
            assert docs.damaged_objects == 1 and cache.stats().quarantined == 1
            assert docs.mapped_now(0, [1]) is None  # dropped: the next read fills it anew...
            assert docs(ref).tobytes() == want.tobytes()  # ... from the source, verified
            assert docs.check_reads() is True
            assert docs.damaged_objects == 1 and cache.stats().quarantined == 1  # (the new copy is intact)
        finally:
            docs.close()


def test_the_scrubber_finds_damage_whatever_the_timestamps_say(sltok, tmp_path):
    manifest, plan, src = _opened(sltok)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            for o in (0, 1):
                docs(plan.ref(0, 0, src.objects[o].start))
            assert docs.scrub(1 << 30) == sum(obj.size for obj in src.objects)  # both verified again, intact
            guard = docs._lru[(0, 0)].pin.guard()
            _flip(guard.path)
            # Bit rot changes bytes under unchanged timestamps; user space cannot write without moving ctime,
            # so the guard is told the new stamps are the verified ones: `check` then sees nothing ...
            guard._verified = signature(guard.fileno())
            assert guard.check() is True
            docs.scrub(1 << 30)  # ... and the scrub, which re-hashes regardless, finds it
            assert docs.damaged_objects == 1 and (0, 0) not in docs._lru and (0, 1) in docs._lru
        finally:
            docs.close()


class _Ref:
    def __init__(self, record: int) -> None:
        self.source, self.obj, self.record = 0, 0, record


def test_a_document_made_out_of_order_is_read_from_a_verified_raw_object(tmp_path, tokenizer_file):
    """The demand path tokenizes a record in place from the raw object while the in-order fill is still held:
    the raw object's chunks are verified before it reads them, so the step's check after the read passes at
    once (an unverified raw pin made every such step be made again, and four in a row failed the step in CI)."""
    from sluice.tokenize import encoder_for_manifest
    from test_out_of_order import HeldEncoder, _one_object

    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    enc = HeldEncoder(encoder_for_manifest(manifest), fill_free=1)  # the fill writes one chunk, then waits
    want = encoder_for_manifest(manifest).encode_batch(["doc 2000 " + "z" * (2000 % 17)])[0]
    with NodeCache(tmp_path / "cache", 1 << 30, verify_on_read=False) as cache:
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            docs.begin_reads()
            got = docs(_Ref(2000))  # far past the held fill: made by the demand path from the raw bytes
            assert not docs._lru[(0, 0)].done  # (still filling: the raw pin is the entry's)
            assert got.tolist() == want.tolist()
            assert docs.check_reads() is True  # verified before it was read: nothing to make again
            raw = docs._lru[(0, 0)].raw
            assert raw is not None and raw.guard().verified and raw.guard().verifications == 1
        finally:
            enc.release()
            docs.close()


def test_a_damaged_raw_object_is_quarantined_before_the_out_of_order_path_reads_it(tmp_path, tokenizer_file):
    """A raw object changed in the node cache before the demand path first pins it: named, quarantined, and
    filled anew from its source, so the document read is still the right one."""
    from sluice.tokenize import encoder_for_manifest
    from test_out_of_order import _one_object

    manifest = load_manifest(_one_object(tmp_path / "c", tokenizer_file, 3000))
    obj = manifest.sources[0].objects[0]
    enc = encoder_for_manifest(manifest)
    want = enc.encode_batch(["doc 2000 " + "z" * (2000 % 17)])[0]
    with NodeCache(tmp_path / "cache", 1 << 30, verify_on_read=False) as cache:
        pin = cache.fetch(obj, manifest.resolve(obj.location))
        path = pin.path
        pin.close()
        _flip(path)
        docs = DocSource(manifest, cache, enc, workers=1, chunk_bytes=2048)
        try:
            assert docs(_Ref(2000)).tolist() == want.tolist()  # filled again from the source, verified
            assert docs.damaged_objects == 1 and cache.stats().quarantined == 1
        finally:
            docs.close()



def test_a_damaged_raw_object_the_out_of_order_path_meets_first_is_filled_anew(tmp_path, tokenizer_file,
                                                                                monkeypatch):
    """The same damage, met first by the out-of-order path (its in-order fill starts 0.5 s late): that path
    quarantined the object and failed its entry, so the step ended with ObjectReadError (seen once in a full
    run, where the two raced); now it drops the entry as the fill does, and the read is filled anew."""
    from sluice.loaderd.physical import fills

    real = fills.Fills._fill_text

    def late(self, *args, **kwargs):
        time.sleep(0.5)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fills.Fills, "_fill_text", late)
    test_a_damaged_raw_object_is_quarantined_before_the_out_of_order_path_reads_it(tmp_path, tokenizer_file)

def test_a_raw_pin_closed_by_its_finished_fill_does_not_make_the_step_again(sltok, tmp_path):
    """A step read documents a fill made from a raw object; the fill finished meanwhile and its entry closed
    the raw pin (settled) while the check held it. The fill checked that file unchanged through every read
    before it published, so the step stands (counted a change, it was made again, and a step that met
    settling fills four times in a row failed: CI at two stops). A raw pin closed while its entry is not
    finished, or finished with an error, still makes the step again."""
    from sluice.loaderd.physical.entry import Entry

    manifest, _, src = _opened(sltok)
    with NodeCache(tmp_path / "cache", 1 << 30, verify_on_read=False) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            for done, error, stands in ((True, None, True), (False, None, False), (True, OSError("x"), False)):
                entry = Entry()
                entry.raw = cache.fetch(src.objects[0], manifest.resolve(src.objects[0].location))
                entry.raw.guard().ensure()
                docs.begin_reads()
                docs.served.reads.entries[(0, 0)] = entry  # (what `__call__` notes when it reads a document)
                # the state the check meets in the race: it holds the raw pin, which the settling entry closed
                entry.raw.close()
                entry.done, entry.error = done, error
                assert docs.check_reads() is stands, (done, error)
                entry.raw = None
        finally:
            docs.close()
