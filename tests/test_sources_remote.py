"""Sources through fsspec: http(s) against a real server on 127.0.0.1, gs/az/hf plumbing, allowed roots.

http(s) is tested end to end here (freeze, verify, cache fills and their failures) and through a
real daemon in test_sources_http_daemon.py. gs://, az:// and hf:// have no server that runs here
without the network: their listing, globbing and reads are tested through fsspec's common interface
(fsspec's own in-memory filesystem registered for `gs`), and their plumbing (URL checks, the
missing-extra error, allowed roots) directly.
"""

from __future__ import annotations

import gzip
import io
import json
import sys

import blake3
import pytest

from http_objects import ObjectServer
from sluice.cache import NodeCache
from sluice.cache.roots import AllowedRoots, check_manifest, default_roots
from sluice.errors import (FillMismatch, FillReadError, LocationRefused, ManifestError, MissingExtra, SourceReadError,
                           SpecError)
from sluice.manifest import remote
from sluice.manifest.freeze import freeze
from sluice.manifest.model import load_manifest
from sluice.manifest.spec import load_dataset_spec

MiB = 1 << 20


def _jsonl(prefix: str, n: int) -> bytes:
    return "".join(json.dumps({"text": f"{prefix} document {i} " * (1 + i % 7)}) + "\n" for i in range(n)).encode()


def _parquet(prefix: str, n: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"{prefix} row {i}" for i in range(n)]}), buf)
    return buf.getvalue()


def _spec(path, sources: dict[str, tuple[list[str], str]]) -> None:
    text = 'name = "remote"\n[packing]\nseq_len = 16\neos_id = 0\n'
    for name, (paths, fmt) in sources.items():
        text += f'[[sources]]\nname = "{name}"\npaths = {json.dumps(paths)}\nformat = "{fmt}"\n'
    path.write_text(text)


@pytest.fixture
def files() -> dict[str, bytes]:
    # big: several ranged reads of SMALL_BLOCK
    return {"/data/a.jsonl": _jsonl("a", 40), "/data/b.jsonl.gz": gzip.compress(_jsonl("b", 30), mtime=0),
            "/data/t.parquet": _parquet("t", 25), "/data/big.jsonl": _jsonl("big", 3000)}


def test_freeze_over_http_records_the_same_objects_as_local_files(tmp_path, files):
    (tmp_path / "local").mkdir()
    for path, data in files.items():
        (tmp_path / "local" / path.rsplit("/", 1)[1]).write_bytes(data)
    with ObjectServer(files) as srv:
        _spec(tmp_path / "http.toml", {"text": ([srv.url(p) for p in ("/data/b.jsonl.gz", "/data/a.jsonl")], "jsonl"),
                                        "tab": ([srv.url("/data/t.parquet")], "parquet")})
        m = freeze(tmp_path / "http.toml", tmp_path / "http.json", progress=False)
        ranged = list(srv.ranges)
    _spec(tmp_path / "local.toml", {"text": (["local/b.jsonl.gz", "local/a.jsonl"], "jsonl"),
                                    "tab": (["local/t.parquet"], "parquet")})
    local = freeze(tmp_path / "local.toml", tmp_path / "local.json", progress=False)

    def identity(man):
        return [(o.location.rsplit("/", 1)[1], o.digest, o.size, o.records, o.compression)
                for s in man.sources for o in s.objects]

    assert identity(m) == identity(local)
    objs = [o for s in m.sources for o in s.objects]
    assert all(o.location.startswith(srv.base + "/data/") for o in objs)
    import hashlib
    assert [o.etag for o in objs] == [hashlib.md5(files["/data/" + o.location.rsplit("/", 1)[1]]).hexdigest()
                                      for o in objs]
    assert ranged and all(r.startswith("bytes=") for _, r in ranged)  # reads are Range requests


def test_verify_and_a_cache_fill_over_http_check_every_byte(tmp_path, files, sluice_main, monkeypatch):
    monkeypatch.setattr(remote, "BLOCK_BYTES", 64 << 10)  # a small object read in several ranges
    with ObjectServer(files) as srv:
        _spec(tmp_path / "d.toml", {"big": ([srv.url("/data/big.jsonl")], "jsonl")})
        m = freeze(tmp_path / "d.toml", tmp_path / "m.json", progress=False)
        obj = m.sources[0].objects[0]
        assert obj.size > remote.BLOCK_BYTES
        srv.ranges.clear()
        with NodeCache(tmp_path / "cache", 64 * MiB, retries=0, chunk_bytes=16 << 10) as cache:
            with cache.fetch(obj, obj.location) as got:
                assert open(got.path, "rb").read() == files["/data/big.jsonl"]
        assert len(srv.ranges) >= 3  # the fill read the object in ranges of BLOCK_BYTES
        spans = [tuple(int(x) for x in r.removeprefix("bytes=").split("-")) for _, r in srv.ranges]
        assert sum(min(b, obj.size - 1) - a + 1 for a, b in spans) == obj.size  # each byte fetched once
        assert sluice_main("manifest", "verify", tmp_path / "m.json").returncode == 0
        srv.files["/data/big.jsonl"] = files["/data/big.jsonl"][:-1] + b" "  # changed after freezing
        r = sluice_main("manifest", "verify", tmp_path / "m.json")
        assert r.returncode == 1 and srv.url("/data/big.jsonl") in r.stdout and "digest" in r.stdout, r.stdout
        srv.faults["/data/big.jsonl"] = "404"
        r = sluice_main("manifest", "verify", tmp_path / "m.json", "--json")
        assert r.returncode == 1 and json.loads(r.stdout)["problems"][0]["kind"] == "missing", r.stdout


@pytest.mark.parametrize("fault, error, cause", [
    ("wrong", FillMismatch, r"got digest b3:\w+ size \d+"),
    ("404", FillReadError, r"not found in the store .*HTTP 404"),
    ("truncate", FillReadError, r"read\w* at byte 0 failed .*ContentLengthError|Not enough data"),
    ("hang", FillReadError, r"timed out: the store sent nothing for 0.5 s \(SLUICE_REMOTE_TIMEOUT_S\)"),
])
def test_a_bad_server_gives_a_clear_fill_error_naming_the_object(tmp_path, files, monkeypatch, fault, error, cause):
    # the hang must end after 0.5 s, not the 120 s the server holds it (the others: room for a loaded machine)
    monkeypatch.setenv("SLUICE_REMOTE_TIMEOUT_S", "0.5" if fault == "hang" else "20")
    data = files["/data/a.jsonl"]
    with ObjectServer({"/x/a.jsonl": data}, {"/x/a.jsonl": fault}) as srv:
        url = srv.url("/x/a.jsonl")
        from sluice.manifest.sources import ObjectRecord

        obj = ObjectRecord(location=url, digest="b3:" + blake3.blake3(data).hexdigest(), size=len(data),
                           records=40, start=0)
        with NodeCache(tmp_path / "cache", 16 * MiB, retries=1, backoff_s=0.001) as cache:
            with pytest.raises(error, match=cause) as info:
                cache.fetch(obj, url)
            assert f"object {url}" in str(info.value) or f"'{url}'" in str(info.value)
            assert "fill failed after 2 tries" in str(info.value)
            assert cache.stats().objects == 0


def test_http_cannot_be_listed_and_a_missing_object_is_named_at_freeze(tmp_path, files, sluice_main):
    with ObjectServer(files) as srv:
        for alias in (srv.url("/data/*.jsonl"), srv.url("/data/")):
            _spec(tmp_path / "d.toml", {"w": ([alias], "jsonl")})
            r = sluice_main("manifest", "freeze", tmp_path / "d.toml", "-o", tmp_path / "m.json", "--no-progress")
            assert r.returncode == 2 and "cannot be listed" in r.stderr and "name each object" in r.stderr, r.stderr
        _spec(tmp_path / "d.toml", {"w": ([srv.url("/data/gone.jsonl")], "jsonl")})
        r = sluice_main("manifest", "freeze", tmp_path / "d.toml", "-o", tmp_path / "m.json", "--no-progress")
        assert r.returncode == 2 and f"object {srv.url('/data/gone.jsonl')}: not found" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "m.json").exists()


def test_cache_warm_over_http_needs_an_explicit_url_root(tmp_path, files, sluice_main):
    with ObjectServer(files) as srv:
        _spec(tmp_path / "d.toml", {"a": ([srv.url("/data/a.jsonl")], "jsonl")})
        freeze(tmp_path / "d.toml", tmp_path / "m.json", progress=False)
        warm = ("cache", "warm", tmp_path / "m.json", tmp_path / "cache", "--budget", "64MiB", "--no-progress")
        r = sluice_main(*warm)
        assert r.returncode == 2 and "outside the allowed roots" in r.stderr and srv.url("/data/a.jsonl") in r.stderr
        assert "https://host/path/" in r.stderr  # says what kind of root to pass
        r = sluice_main(*warm, "--allow-root", srv.url("/other/"))
        assert r.returncode == 2, r.stderr
        r = sluice_main(*warm, "--allow-root", srv.url("/data"))
        assert r.returncode == 0, r.stderr


def test_allowed_url_roots_are_prefixes_that_cannot_be_escaped():
    roots = AllowedRoots.of(["https://data.example.org/corpus", "gs://bkt/a/", "hf://datasets/org/name/",
                             "abfs://cont/x/"])
    assert roots.allows("https://data.example.org/corpus/part-0.jsonl")
    assert roots.allows("gs://bkt/a/b/c.parquet") and roots.allows("hf://datasets/org/name/train/x.parquet")
    assert roots.allows("abfs://cont/x/y.jsonl") and not roots.allows("az://cont/x/y.jsonl")  # another scheme
    for bad in ("https://data.example.org/corpusX/a.jsonl", "https://data.example.org.evil.net/corpus/a",
                "https://data.example.org/corpus/../secret", "https://data.example.org/corpus/%2E%2E/secret",
                "https://data.example.org/corpus/a\\..\\b", "http://data.example.org/corpus/a.jsonl",
                "gs://bkt/ab/c", "gs://bkt/a/./../x", "hf://datasets/org/name2/x"):
        assert not roots.allows(bad), bad
    man = _manifest_of("https://data.example.org/corpus/a.jsonl")
    assert default_roots(man).prefixes == ()  # never what the manifest itself names
    with pytest.raises(LocationRefused, match="https://data.example.org/corpus/a.jsonl"):
        check_manifest(man, default_roots(man))


def _manifest_of(url: str):
    from sluice.manifest.model import Manifest
    from sluice.manifest.policies import MixturePolicy, PackingPolicy

    return Manifest(name="x", tokenizer=None, packing=PackingPolicy(seq_len=8, eos_id=0), mixture=MixturePolicy(),
                    sources=(_source_at(url),), base_dir="/tmp")


@pytest.mark.parametrize("raw, why", [
    ("gs:///key.jsonl", "names no host"),
    ("https://h/a/../b.jsonl", "'..' path segment"),
    ("https://h/a/%2e%2e/b.jsonl", "'..' path segment"),
    ("az://c/a b.jsonl", "space"),
    ("hf://datasets/o/n/x.jsonl#frag", "#fragment"),
])
def test_malformed_urls_in_a_dataset_spec_name_the_field(tmp_path, raw, why):
    _spec(tmp_path / "d.toml", {"s": ([raw], "jsonl")})
    with pytest.raises(SpecError, match=rf"d\.toml: sources\[0\]\(s\)\.paths: .* {why}"):
        load_dataset_spec(tmp_path / "d.toml")


def test_a_tokenizer_url_is_refused(tmp_path):
    (tmp_path / "d.toml").write_text('name = "x"\ntokenizer = "https://h/tok.json"\n[packing]\nseq_len = 8\n'
                                     '[[sources]]\nname = "s"\npaths = ["a.jsonl"]\nformat = "jsonl"\n')
    with pytest.raises(SpecError, match="tokenizer: 'https://h/tok.json' is a URL; the tokenizer must be a local"):
        load_dataset_spec(tmp_path / "d.toml")


@pytest.mark.parametrize("scheme, package, extra", [("gs", "gcsfs", "gcs"), ("az", "adlfs", "azure"),
                                                    ("abfs", "adlfs", "azure"), ("hf", "huggingface_hub", "hfhub"),
                                                    ("https", "aiohttp", "http")])
def test_a_missing_extra_names_the_scheme_and_what_to_install(tmp_path, monkeypatch, scheme, package, extra):
    from fsspec.registry import _registry

    # As on a machine without the package: imports of it fail, and fsspec has no class cached for it.
    monkeypatch.setitem(sys.modules, package, None)
    for proto in (scheme, "gcs", "abfs", "az", "http", "https", "hf"):
        monkeypatch.delitem(_registry, proto, raising=False)
    url = f"{scheme}://bucket/corpus/a.jsonl"
    want = rf"reading {scheme}:// locations needs the optional package '{package}'.*pip install 'sluice\[{extra}\]'"
    with pytest.raises(MissingExtra, match=want):
        remote.filesystem(scheme, f"object {url}")
    # at the start of a warm or a daemon, before anything is read
    man = _manifest_of(url)
    with pytest.raises(MissingExtra, match=want):
        check_manifest(man, AllowedRoots.of([f"{scheme}://bucket/"]))
    # and a fill does not retry it
    with NodeCache(tmp_path / "cache", 16 * MiB, retries=3, backoff_s=5.0) as cache:
        with pytest.raises(MissingExtra, match=want):
            cache.fetch(man.sources[0].objects[0], url)
        assert cache.stats().retries == 0


def _source_at(url: str):
    from sluice.manifest.sources import ObjectRecord, Source

    obj = ObjectRecord(location=url, digest="b3:" + "0" * 64, size=3, records=1, start=0)
    return Source(name="s", format="jsonl", text_field="text", weight="1", exhaustion="stop", paths=(url,),
                  objects=(obj,))


@pytest.fixture
def memory_gs(monkeypatch):
    """fsspec's in-memory filesystem answering `gs://` in this process (a stand-in for gcsfs: the same
    fsspec interface, listing, globbing and reads, no network)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.registry import _registry

    class MemoryGS(MemoryFileSystem):
        protocol = ("gs",)
        store: dict = {}
        pseudo_dirs = [""]

        @classmethod
        def _strip_protocol(cls, path):
            return MemoryFileSystem._strip_protocol(path.removeprefix("gs://"))

    monkeypatch.setitem(_registry, "gs", MemoryGS)
    fs = fsspec.filesystem("gs", requests_timeout=remote.timeout_s())
    yield fs
    MemoryGS.store.clear()


def test_listable_schemes_freeze_folders_and_globs_through_fsspec(tmp_path, memory_gs):
    objs = {"gs://bkt/corpus/p-0.jsonl": _jsonl("p0", 5), "gs://bkt/corpus/sub/p-1.jsonl": _jsonl("p1", 6),
            "gs://bkt/corpus/readme.txt": b"not data", "gs://bkt/tables/t.parquet": _parquet("t", 4)}
    for url, data in objs.items():
        memory_gs.pipe(url, data)
    _spec(tmp_path / "d.toml", {"folder": (["gs://bkt/corpus"], "jsonl"),
                                "glob": (["gs://bkt/tables/*.parquet"], "parquet")})
    m = freeze(tmp_path / "d.toml", tmp_path / "m.json", progress=False)
    got = [(o.location, o.records, o.digest) for s in m.sources for o in s.objects]
    assert got == [(u, r, "b3:" + blake3.blake3(objs[u]).hexdigest()) for u, r in
                   (("gs://bkt/corpus/p-0.jsonl", 5), ("gs://bkt/corpus/sub/p-1.jsonl", 6),
                    ("gs://bkt/tables/t.parquet", 4))]
    loaded = load_manifest(tmp_path / "m.json")
    assert loaded.resolve("gs://bkt/tables/t.parquet") == "gs://bkt/tables/t.parquet"
    check_manifest(loaded, AllowedRoots.of(["gs://bkt/"]))
    with pytest.raises(LocationRefused):
        check_manifest(loaded, default_roots(loaded))
    obj = loaded.sources[0].objects[1]
    with NodeCache(tmp_path / "cache", 16 * MiB, retries=0) as cache:
        with cache.fetch(obj, obj.location) as pin:
            assert open(pin.path, "rb").read() == objs[obj.location]
        memory_gs.pipe(obj.location, objs[obj.location].replace(b"p1", b"P1"))  # replaced after freezing
        other = loaded.sources[0].objects[0]
        memory_gs.pipe(other.location, b"{}\n")
        with pytest.raises(FillMismatch, match="gs://bkt/corpus/p-0.jsonl"):
            cache.fetch(other, other.location)
    for alias, msg in (("gs://bkt/nothing/*.jsonl", "matches no objects"), ("gs://bkt/empty", "no such object"),
                       ("gs://bkt/tables", "holds no jsonl objects")):
        _spec(tmp_path / "e.toml", {"x": ([alias], "jsonl")})
        with pytest.raises(ManifestError, match=msg):
            freeze(tmp_path / "e.toml", tmp_path / "e.json", progress=False)


def test_a_bad_timeout_setting_is_named(monkeypatch):
    monkeypatch.setenv("SLUICE_REMOTE_TIMEOUT_S", "soon")
    with pytest.raises(ManifestError, match="SLUICE_REMOTE_TIMEOUT_S='soon'"):
        remote.timeout_s()


def test_reader_errors_are_source_read_errors_naming_the_object(files):
    with ObjectServer(files) as srv:
        with pytest.raises(SourceReadError, match=f"object {srv.url('/nope.jsonl')}: not found"):
            remote.open_remote(srv.url("/nope.jsonl"))


@pytest.mark.parametrize("fault, cause", [
    ("404", "not found in the store"),
    ("truncate", "reading at byte 0 failed"),
    ("hang", "timed out: the store sent nothing for 0.5 s"),
])
def test_a_bad_server_at_freeze_names_the_object_and_leaves_no_manifest(tmp_path, files, monkeypatch, sluice_main,
                                                                         fault, cause):
    monkeypatch.setenv("SLUICE_REMOTE_TIMEOUT_S", "0.5" if fault == "hang" else "20")
    with ObjectServer(files, {"/data/b.jsonl.gz": fault}) as srv:
        _spec(tmp_path / "d.toml", {"t": ([srv.url("/data/a.jsonl"), srv.url("/data/b.jsonl.gz")], "jsonl")})
        r = sluice_main("manifest", "freeze", tmp_path / "d.toml", "-o", tmp_path / "m.json", "--no-progress")
    assert r.returncode == 2, r.stderr
    assert f"object {srv.url('/data/b.jsonl.gz')}" in r.stderr and cause in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "m.json").exists()


def test_a_redirect_is_never_followed_out_of_the_url_named(tmp_path, files, sluice_main):
    """--allow-root is checked on the URL named: following a redirect would read from anywhere."""
    data = files["/data/a.jsonl"]
    with ObjectServer({"/ok/a.jsonl": data, "/elsewhere": data}, {"/ok/a.jsonl": "redirect"}) as srv:
        srv.redirect_to = srv.url("/elsewhere")
        _spec(tmp_path / "d.toml", {"r": ([srv.url("/ok/a.jsonl")], "jsonl")})
        r = sluice_main("manifest", "freeze", tmp_path / "d.toml", "-o", tmp_path / "m.json", "--no-progress")
        assert r.returncode == 2, r.stderr
        assert f"object {srv.url('/ok/a.jsonl')}: the server redirects it to {srv.url('/elsewhere')}" in r.stderr
        assert "GET /elsewhere" not in srv.requested  # the HEAD saw where it leads; nothing was read from there
        from sluice.manifest.sources import ObjectRecord

        obj = ObjectRecord(location=srv.url("/ok/a.jsonl"), digest="b3:" + blake3.blake3(data).hexdigest(),
                           size=len(data), records=40, start=0)
        srv.faults["/ok/a.jsonl"] = "redirect-get"  # HEAD says "here", GET says "over there"
        srv.requested.clear()
        with NodeCache(tmp_path / "cache", 16 * MiB, retries=0) as cache:
            with pytest.raises(FillMismatch, match=srv.url("/ok/a.jsonl")):
                cache.fetch(obj, obj.location)
        assert "GET /elsewhere" not in srv.requested  # the GET's redirect was not followed
