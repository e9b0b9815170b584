"""`pretokenize`: verified raw bytes in, content-addressed shards and a derived manifest out."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import blake3
import pytest

from sluice.errors import DigestMismatch, SourceReadError, TokenizerError
from sluice.manifest.model import Manifest, load_manifest
from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
from sluice.manifest.sources import ObjectRecord, Source
from sluice.manifest.token_shard import open_shard
from sluice.tokenize import load_tokenizer, tokenizer_digest
from sluice.tokenize.pretokenize import TRANSFORM, pretokenize


def _b3(data: bytes) -> str:
    return "b3:" + blake3.blake3(data).hexdigest()


def _docs(seed: int, n: int) -> list[str]:
    """Deterministic, varied documents: code, prose, unicode, empty, special-token text."""
    out = []
    for i in range(n):
        k = (seed * 31 + i) % 7
        if k == 0:
            out.append("")
        elif k == 1:
            out.append(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 4))
        elif k == 2:
            out.append(f"Ünïcödé {i} — ✓ 中文 <|endoftext|> after")
        else:
            out.append(" ".join(f"word{j}" for j in range(i % 40)))
    return out


def _write_object(folder: Path, name: str, texts: list[str], compression: str = "none") -> tuple[str, bytes]:
    body = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode("utf-8")
    if compression == "gzip":
        body = gzip.compress(body, mtime=0)
    (folder / name).write_bytes(body)
    return name, body


def _source(folder: Path, name: str, objects: list[tuple[str, list[str], str]], weight: str) -> Source:
    records, start = [], 0
    for filename, texts, compression in objects:
        _, body = _write_object(folder, filename, texts, compression)
        records.append(
            ObjectRecord(
                location=filename, digest=_b3(body), size=len(body), records=len(texts), start=start, compression=compression
            )
        )
        start += len(texts)
    return Source(
        name=name, format="jsonl", text_field="text", weight=weight, exhaustion="repeat",
        paths=(f"{name}/*.jsonl",), objects=tuple(records),
    )


@pytest.fixture
def raw_manifest(tmp_path: Path, tokenizer_file: Path) -> Path:
    """A frozen two-source manifest over generated jsonl (one object gzip-compressed)."""
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    enc = load_tokenizer(folder / "tokenizer.json")
    code = _source(
        folder, "code",
        [("code-0.jsonl", _docs(1, 40), "none"), ("code-1.jsonl", _docs(2, 25), "none"), ("code-2.jsonl.gz", _docs(3, 30), "gzip")],
        "0.7",
    )
    prose = _source(folder, "prose", [("prose-0.jsonl", _docs(4, 50), "none")], "0.3")
    manifest = Manifest(
        name="unit",
        tokenizer=TokenizerRef(location="tokenizer.json", digest=enc.digest, version=enc.version, vocab_size=enc.vocab_size),
        packing=PackingPolicy(seq_len=64, eos_id=0),
        mixture=MixturePolicy(),
        sources=(code, prose),
        notes={"origin": "generated for tests"},
    )
    path = folder / "manifest.json"
    path.write_bytes(manifest.canonical_bytes())
    return path


def _raw_texts(path: Path, compression: str) -> list[str]:
    data = path.read_bytes()
    if compression == "gzip":
        data = gzip.decompress(data)
    return [json.loads(line)["text"] for line in data.decode("utf-8").splitlines()]


def test_round_trip_lineage_and_worker_independence(raw_manifest: Path, tmp_path: Path) -> None:
    raw = load_manifest(raw_manifest)
    one = pretokenize(raw, tmp_path / "w1", workers=1)
    two = pretokenize(raw, tmp_path / "w2", workers=2)

    # Byte-identical output for 1 and 2 worker processes.
    files1 = sorted(p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*") if p.is_file())
    files2 = sorted(p.relative_to(tmp_path / "w2") for p in (tmp_path / "w2").rglob("*") if p.is_file())
    assert files1 == files2 and len(files1) == 4 + 2  # 4 shards + manifest.json + tokenizer.json
    for rel in files1:
        assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes(), rel
    assert one.dataset_id == two.dataset_id == _b3((tmp_path / "w1" / "manifest.json").read_bytes())
    assert (one.objects, one.documents) == (4, 145)

    derived = load_manifest(tmp_path / "w1" / "manifest.json")
    assert derived.dataset_id == one.dataset_id != raw.dataset_id
    assert derived.canonical_bytes() == (tmp_path / "w1" / "manifest.json").read_bytes()
    assert (derived.name, derived.packing, derived.mixture, derived.notes) == (raw.name, raw.packing, raw.mixture, raw.notes)
    assert derived.tokenizer.digest == raw.tokenizer.digest == tokenizer_digest(derived.resolve(derived.tokenizer.location))

    enc = load_tokenizer(raw.resolve(raw.tokenizer.location))
    tokens = 0
    for rsrc, dsrc in zip(raw.sources, derived.sources):
        assert dsrc.format == "tokens"
        assert (dsrc.name, dsrc.weight, dsrc.exhaustion, dsrc.records) == (rsrc.name, rsrc.weight, rsrc.exhaustion, rsrc.records)
        for robj, dobj in zip(rsrc.objects, dsrc.objects):
            assert dobj.lineage == {"raw": robj.digest, "tokenizer": enc.digest, "transform": TRANSFORM}
            assert (dobj.records, dobj.start, dobj.compression, dobj.alias) == (robj.records, robj.start, "none", "derived")
            assert dobj.sample_id(3) == robj.sample_id(3)  # sample IDs survive pre-tokenization
            shard_path = Path(derived.resolve(dobj.location))
            assert dobj.location.startswith("shards/") and robj.digest[3:] in dobj.location
            data = shard_path.read_bytes()
            assert (dobj.digest, dobj.size) == (_b3(data), len(data))
            shard = open_shard(shard_path)
            assert shard.header["raw"] == robj.digest and shard.header["tokenizer"] == enc.digest
            assert shard.header["transform"] == TRANSFORM
            texts = _raw_texts(Path(raw.resolve(robj.location)), robj.compression)
            expected = enc.encode_batch(texts)
            assert shard.n_docs == len(texts) == robj.records
            for i, ids in enumerate(expected):
                assert shard.doc(i).tolist() == ids.tolist()
                assert enc.decode(shard.doc(i)) == texts[i]
                tokens += len(ids)
    assert one.tokens == tokens


def test_a_raw_object_changed_after_freezing_is_refused(raw_manifest: Path, tmp_path: Path) -> None:
    raw = load_manifest(raw_manifest)
    victim = raw.sources[0].objects[1]
    path = Path(raw.resolve(victim.location))
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01  # same size, one bit flipped
    path.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch) as info:
        pretokenize(raw, tmp_path / "out", workers=2)
    message = str(info.value)
    assert victim.location in message and victim.digest in message and _b3(bytes(data)) in message
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_wrong_record_count_is_refused(raw_manifest: Path, tmp_path: Path) -> None:
    raw = load_manifest(raw_manifest)
    src = raw.sources[1]
    obj = src.objects[0]
    lying = Manifest(
        name=raw.name, tokenizer=raw.tokenizer, packing=raw.packing, mixture=raw.mixture, base_dir=raw.base_dir,
        sources=(Source(
            name=src.name, format=src.format, text_field=src.text_field, weight=src.weight, exhaustion=src.exhaustion,
            paths=src.paths, objects=(ObjectRecord(
                location=obj.location, digest=obj.digest, size=obj.size, records=obj.records + 1, start=0,
            ),),
        ),),
    )
    with pytest.raises(SourceReadError, match=r"prose-0\.jsonl.*50 documents read, the manifest records 51"):
        pretokenize(lying, tmp_path / "out", workers=1)


def test_a_changed_tokenizer_is_refused(raw_manifest: Path, tmp_path: Path) -> None:
    raw = load_manifest(raw_manifest)
    tok = Path(raw.resolve(raw.tokenizer.location))
    tok.write_bytes(tok.read_bytes() + b" ")
    with pytest.raises(TokenizerError, match="differs from the manifest"):
        pretokenize(raw, tmp_path / "out", workers=1)


def test_cli_prints_the_derived_dataset_id(raw_manifest: Path, tmp_path: Path, sluice_main) -> None:
    proc = sluice_main("tokenize", "pretokenize", raw_manifest, "-o", tmp_path / "d", "--workers", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["dataset_id"] == load_manifest(tmp_path / "d" / "manifest.json").dataset_id
    assert out["source_dataset_id"] == load_manifest(raw_manifest).dataset_id
    assert (out["shards"], out["documents"]) == (4, 145)
    assert "pretokenize" not in proc.stderr  # no progress bar when stderr is not a terminal
    proc = sluice_main("tokenize", "pretokenize", raw_manifest, "-o", tmp_path / "d2", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == out["dataset_id"]
    assert sorted(os.listdir(tmp_path / "d" / "shards")) == sorted(os.listdir(tmp_path / "d2" / "shards"))
    # Refuses to write the derived dataset over the raw one.
    proc = sluice_main("tokenize", "pretokenize", raw_manifest, "-o", raw_manifest.parent)
    assert proc.returncode == 2 and "needs its own folder" in proc.stderr


def test_s3_objects_are_hashed_while_streamed(raw_manifest: Path, tmp_path: Path, s3_bucket_factory) -> None:
    """Objects on a (loopback) S3 store give the same shards as the local copies, and are verified."""
    raw = load_manifest(raw_manifest)
    src = raw.sources[0]
    s3_bucket_factory("tok-raw", {o.location: Path(raw.resolve(o.location)).read_bytes() for o in src.objects})
    remote = Manifest(
        name=raw.name, tokenizer=raw.tokenizer, packing=raw.packing, mixture=raw.mixture, base_dir=raw.base_dir,
        sources=(Source(
            name=src.name, format=src.format, text_field=src.text_field, weight=src.weight, exhaustion=src.exhaustion,
            paths=src.paths,
            objects=tuple(
                ObjectRecord(location=f"s3://tok-raw/{o.location}", digest=o.digest, size=o.size, records=o.records,
                             start=o.start, compression=o.compression)
                for o in src.objects
            ),
        ),),
    )
    local = pretokenize(raw, tmp_path / "local", workers=1)
    result = pretokenize(remote, tmp_path / "remote", workers=2)
    for lobj, robj in zip(local.manifest.sources[0].objects, result.manifest.sources[0].objects):
        assert (lobj.location, lobj.digest, lobj.lineage) == (robj.location, robj.digest, robj.lineage)
    assert not [p for p in (tmp_path / "remote" / "shards").iterdir() if p.name.startswith(".")]  # temp files gone

    s3_bucket_factory("tok-raw", {src.objects[2].location: b"replaced after freezing\n"})
    with pytest.raises(DigestMismatch, match=r"s3://tok-raw/code-2\.jsonl\.gz of source 'code': expected b3:"):
        pretokenize(remote, tmp_path / "again", workers=1)


def test_encoder_for_manifest_checks_the_manifest_digest(raw_manifest: Path) -> None:
    from dataclasses import replace

    from sluice.tokenize import encoder_for_manifest

    raw = load_manifest(raw_manifest)
    enc = encoder_for_manifest(raw)
    assert enc.digest == raw.tokenizer.digest and enc.vocab_size == raw.tokenizer.vocab_size
    other = replace(raw, tokenizer=replace(raw.tokenizer, digest="b3:" + "ab" * 32))
    with pytest.raises(TokenizerError, match=f"differs from the manifest's b3:{'ab' * 32}"):
        encoder_for_manifest(other)
    with pytest.raises(TokenizerError, match="names no tokenizer"):
        encoder_for_manifest(replace(raw, tokenizer=None))


@pytest.mark.slow
def test_ctrl_c_during_pretokenize_exits_at_once_and_leaves_no_partial_files(tmp_path: Path, tokenizer_file) -> None:
    """Ctrl-C (SIGINT to the process group) while the workers tokenize: exit 130 within seconds, not after
    the running objects (before: 6-8 s here); no traceback; no temporary file of a killed worker left."""
    from support import ctrl_c_once_working, text_objects_manifest

    manifest = text_objects_manifest(tmp_path, tokenizer_file, objects=4, size=24 << 20)  # ~6 s per object
    out = tmp_path / "tokens"
    rc, waited, err = ctrl_c_once_working(["tokenize", "pretokenize", str(manifest), "-o", str(out), "--workers", "2",
                                           "--progress"], "pretokenize", tmp_path / "stderr")
    assert rc == 130 and err.strip().splitlines()[-1] == "sluice: interrupted", err
    assert waited < 3, f"exit {waited:.1f} s after SIGINT"
    assert "Traceback" not in err
    assert [p.name for p in (out / "shards").iterdir() if p.name.startswith(".")] == []
    assert not (out / "manifest.json").exists()


@pytest.mark.slow  # two pretokenize pools of worker processes
def test_http_objects_are_hashed_while_streamed(raw_manifest: Path, tmp_path: Path) -> None:
    """Objects served over http (Range requests, 127.0.0.1) give the same shards as the local copies, verified."""
    import dataclasses

    from http_objects import ObjectServer

    raw = load_manifest(raw_manifest)
    src = raw.sources[0]
    files = {f"/raw/{o.location}": Path(raw.resolve(o.location)).read_bytes() for o in src.objects}
    with ObjectServer(files) as srv:
        objs = tuple(dataclasses.replace(o, location=srv.url(f"/raw/{o.location}")) for o in src.objects)
        remote = dataclasses.replace(raw, sources=(dataclasses.replace(src, objects=objs),))
        local = pretokenize(raw, tmp_path / "local", workers=1)
        result = pretokenize(remote, tmp_path / "remote", workers=2)
        for lobj, robj in zip(local.manifest.sources[0].objects, result.manifest.sources[0].objects):
            assert (lobj.location, lobj.digest, lobj.lineage) == (robj.location, robj.digest, robj.lineage)
        assert srv.ranges  # read over http, in ranges
        srv.files[f"/raw/{src.objects[2].location}"] = b"replaced after freezing\n"
        changed = rf"{srv.url('/raw/code-2')}\.jsonl\.gz of source 'code': expected b3:"
        with pytest.raises(DigestMismatch, match=changed):
            pretokenize(remote, tmp_path / "again", workers=1)
