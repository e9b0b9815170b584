"""Golden vectors: the canonical bytes and dataset ID of a fixed manifest.

If this test fails, the canonical encoding or the manifest schema changed:
that changes every dataset ID, so it needs a new schema/encoding version and a
deliberate update of tests/golden/manifest_small.json (see docs/manifest.md).
"""

from __future__ import annotations

from pathlib import Path

from sluice.manifest.canonical import digest_id
from sluice.manifest.model import (
    Manifest,
    MixturePolicy,
    ObjectRecord,
    PackingPolicy,
    Source,
    TokenizerRef,
    load_manifest,
)

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
