"""Golden vectors: the canonical bytes and dataset ID of a fixed manifest.

If this test fails, the canonical encoding or the manifest schema changed:
that changes every dataset ID, so it needs a new schema/encoding version and a
deliberate update of tests/golden/manifest_small.json (see docs/manifest.md).
"""

from __future__ import annotations

from pathlib import Path

from sluice.manifest.canonical import digest_id
from sluice.manifest.model import Manifest, load_manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source

GOLDEN = Path(__file__).resolve().parent / "golden" / "manifest_small.json"
GOLDEN_ID = "b3:322d5bcc594a0edb2aebb9c6681c6545ca1ac9f185152dab75d1e4127e7062b9"


def small_manifest() -> Manifest:
    return Manifest(
        name="golden-é",
        tokenizer=TokenizerRef(location="tok/tokenizer.json", digest="b3:" + "ab" * 32, version="1.0", vocab_size=1024),
        packing=PackingPolicy(seq_len=512, algorithm="concat", eos_id=0, pad_id=1, separator="eos"),
        mixture=MixturePolicy(policy="quota", unit="tokens"),
        sources=(
            Source(
                name="code",
                format="jsonl",
                text_field="text",
                weight="0.7",
                exhaustion="repeat",
                paths=("shards/code-*.jsonl.zst",),
                objects=(
                    ObjectRecord(location="shards/code-0.jsonl.zst", digest="b3:" + "01" * 32, size=1000,
                                 records=10, start=0, compression="zstd", alias="shards/code-*.jsonl.zst"),
                    ObjectRecord(location="shards/code-1.jsonl.zst", digest="b3:" + "02" * 32, size=2000,
                                 records=20, start=10, compression="zstd", alias="shards/code-*.jsonl.zst"),
                ),
                notes="tab\there \"quoted\" \u2603",
            ),
            Source(
                name="web",
                format="parquet",
                text_field="body",
                weight="0.3",
                exhaustion="stop",
                paths=("s3://bucket/web/",),
                objects=(
                    ObjectRecord(location="s3://bucket/web/p0.parquet", digest="b3:" + "03" * 32, size=3000,
                                 records=5, start=0, alias="s3://bucket/web/", etag="0123456789abcdef0123456789abcdef"),
                ),
                split="train",
                filters=("lang=en",),
                dedup="minhash",
            ),
        ),
        access="internal",
        notes={"origin": "golden", "ticket": "2"},
    )


def test_golden_canonical_bytes_and_dataset_id():
    m = small_manifest()
    assert m.canonical_bytes() == GOLDEN.read_bytes()
    assert m.dataset_id == GOLDEN_ID == digest_id(GOLDEN.read_bytes())


def test_golden_file_loads_back_to_the_same_manifest():
    loaded = load_manifest(GOLDEN)
    assert loaded == small_manifest() and loaded.dataset_id == GOLDEN_ID
    assert loaded.source("code").objects[1].sample_id(3) == "b3:" + "02" * 32 + ":3"
    assert loaded.source("code").locate(12) == (loaded.source("code").objects[1], 2)


def _independent_encode(value) -> str:
    """The canonical encoding re-implemented from docs/manifest.md alone (no json module)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        out = ['"']
        short = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
        for ch in value:
            cp = ord(ch)
            if ch in short:
                out.append(short[ch])
            elif 0x20 <= cp <= 0x7E:
                out.append(ch)
            elif cp > 0xFFFF:
                v = cp - 0x10000
                out.append(f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04x}")
            else:
                out.append(f"\\u{cp:04x}")
        out.append('"')
        return "".join(out)
    if isinstance(value, list):
        return "[" + ",".join(_independent_encode(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(_independent_encode(k) + ":" + _independent_encode(value[k]) for k in sorted(value)) + "}"
    raise TypeError(value)


def test_docs_are_enough_to_recompute_the_id():
    import blake3

    from sluice.manifest.canonical import canonical_bytes

    m = small_manifest()
    text = _independent_encode(m.to_obj())
    assert text.encode("ascii") == GOLDEN.read_bytes()
    assert "b3:" + blake3.blake3(text.encode("ascii")).hexdigest() == GOLDEN_ID
    tricky = {"s": "\x7f/\x01é😀\b\f\"\\", "n": [-5, 0, 2**53], "e": {}, "z": [None, True, False]}
    assert _independent_encode(tricky).encode("ascii") == canonical_bytes(tricky)
