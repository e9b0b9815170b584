"""A zstd object cut anywhere inside a frame is refused by name, not read as a shorter one.

zstandard's stream reader returns b"" at a cut exactly as at a clean end; the
frame walk of the freeze's decoder (`sluice.manifest.decode`), which the
daemon's chunked reads go through too, is what tells them apart.
"""

from __future__ import annotations

import json

import pytest
import zstandard

from sluice.errors import SourceReadError
from sluice.tokenize.chunks import iter_text_chunks


def _frames(texts: list[str], frames: int, checksum: bool) -> tuple[bytes, list[int]]:
    """`texts` as jsonl in `frames` zstd frames plus one skippable frame; returns (blob, frame end offsets)."""
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    per = -(-len(lines) // frames)
    blob, ends = b"", []
    comp = zstandard.ZstdCompressor(level=3, write_checksum=checksum)
    for i in range(0, len(lines), per):
        blob += comp.compress(b"".join(lines[i : i + per]))
        ends.append(len(blob))
    blob += (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!"  # a skippable frame
    ends.append(len(blob))
    return blob, ends


def _texts(n: int) -> list[str]:
    # Varied, poorly compressible text, so the frames hold several blocks of each kind.
    return [" ".join(f"w{(i * 7919 + j * 104729) % 100003}" for j in range(40 + i % 300)) for i in range(n)]


def _check(path: str) -> None:
    """Read the object through the daemon's chunked decode path (as a token fill does)."""
    for _ in iter_text_chunks(path, "jsonl", "zstd", "text", "obj-z"):
        pass


@pytest.mark.parametrize("checksum", [False, True])
def test_only_cuts_at_frame_boundaries_read_as_whole(tmp_path, checksum):
    blob, ends = _frames(_texts(600), 3, checksum)
    path = tmp_path / "a.jsonl.zst"
    step = max(1, len(blob) // 400)  # about 400 cuts, plus every frame end and its neighbours
    cuts = set(range(0, len(blob) + 1, step)) | {e + d for e in ends for d in (-1, 0, 1)} | set(range(0, 20))
    for cut in sorted(c for c in cuts if 0 <= c <= len(blob)):
        path.write_bytes(blob[:cut])
        if cut in ends:
            _check(str(path))  # a valid, shorter stream: the record count in the manifest catches it
            continue
        with pytest.raises(SourceReadError, match=r"^obj-z: (truncated|corrupt) zstd stream"):
            _check(str(path))


def test_a_truncated_jsonl_zst_is_refused_naming_the_object(tmp_path):
    texts = _texts(300)
    blob, ends = _frames(texts, 2, False)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(blob)
    whole = [t for chunk in iter_text_chunks(str(path), "jsonl", "zstd", "text", "obj-z") for t in chunk]
    assert whole == texts  # several frames and a skippable one read through

    path.write_bytes(blob[: ends[0] + (ends[1] - ends[0]) // 2])  # inside the second frame
    # zstandard alone reads the cut stream as a shorter one, ending quietly:
    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while reader.read(1 << 16):
            pass
    with pytest.raises(SourceReadError, match=r"^cut-object: truncated zstd stream"):
        list(iter_text_chunks(str(path), "jsonl", "zstd", "text", "cut-object"))


def test_what_is_not_a_zstd_frame_is_refused_naming_the_object(tmp_path):
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n') + b"garbage!")
    with pytest.raises(SourceReadError, match=r"obj-z: corrupt zstd stream \(no frame magic"):
        _check(str(path))
    path.write_bytes(b"")
    with pytest.raises(SourceReadError, match="obj-z: truncated zstd stream"):
        _check(str(path))
