"""A fill's two copy paths publish the same bytes under the same digest.

Specification in brief: by default every chunk goes through user space
(read into a buffer, write, hash); with `kernel_copy=True` a local source with
the default temporary file is copied in the kernel (copy_file_range, then the
chunk read back from the temporary file is hashed), and any other
temporary-file opener (and a source the kernel cannot copy, such as a device)
still goes through user space. Both verify the same digest, publish the same bytes, stop one byte past
the recorded size, and quarantine a source whose bytes do not match.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest

from sluice.cache import NodeCache
from sluice.errors import DigestMismatch
from sluice.manifest.sources import ObjectRecord

MiB = 1 << 20


def _record(path: Path, data: bytes) -> ObjectRecord:
    path.write_bytes(data)
    return ObjectRecord(location=path.name, digest="b3:" + blake3.blake3(data).hexdigest(), size=len(data),
                        records=1, start=0)


def _through_user_space(path: str):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    return open(fd, "wb", buffering=0)


@pytest.mark.parametrize("hash_thread", [False, True])
@pytest.mark.parametrize("size", [0, 1, MiB, 3 * MiB + 123, 9 * MiB + 5])  # 9 MiB: a durable fill starts writeback
def test_kernel_and_user_space_copies_publish_the_same_bytes(tmp_path, size, hash_thread):
    data = os.urandom(size)
    obj = _record(tmp_path / "src.bin", data)
    got = []
    for name, opener in (("kernel", None), ("user", _through_user_space)):
        with NodeCache(tmp_path / name, 64 * MiB, open_tmp=opener, hash_thread=hash_thread, chunk_bytes=MiB,
                       kernel_copy=opener is None) as cache:
            with cache.fetch(obj, str(tmp_path / "src.bin")) as hit:
                got.append((Path(hit.path).read_bytes(), hit.digest))
            assert cache.stats().fills == 1
    assert got[0] == got[1] == (data, obj.digest)


def test_a_longer_or_different_source_is_refused_on_the_kernel_path(tmp_path):
    data = os.urandom(2 * MiB)
    obj = _record(tmp_path / "src.bin", data)
    (tmp_path / "src.bin").write_bytes(data + b"x")  # one byte longer than frozen
    with NodeCache(tmp_path / "c", 64 * MiB, retries=0, chunk_bytes=MiB, kernel_copy=True) as cache:
        with pytest.raises(DigestMismatch, match="the source is longer than the recorded size 2097152"):
            cache.fetch(obj, str(tmp_path / "src.bin"))
    flipped = bytearray(data)
    flipped[MiB + 7] ^= 1  # same size, one bit changed in the second chunk
    (tmp_path / "src.bin").write_bytes(bytes(flipped))
    with NodeCache(tmp_path / "d", 64 * MiB, retries=0, chunk_bytes=MiB, kernel_copy=True) as cache:
        with pytest.raises(DigestMismatch, match="got digest b3:"):
            cache.fetch(obj, str(tmp_path / "src.bin"))
        assert cache.stats().quarantined == 1
