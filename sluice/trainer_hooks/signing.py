"""An HMAC over the checkpoint manifest, keyed by a secret kept outside the checkpoint folder.

Shard digests prove a shard is the one the manifest lists; they cannot prove
the manifest itself is the writer's: whoever can write the folder can swap a
shard and fix up its digest. With a key file, the writer stores
``manifest.mac`` = ``hmac-sha256:<hex>`` of the exact manifest bytes, and
restore and `sluice ckpt verify --key-file` refuse a checkpoint whose MAC is
missing or differs. The key file must lie outside the checkpoint folder (a key
next to the data it protects protects nothing), be private (no group or other
permission bits) and hold 16 to 4096 bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from sluice.errors import CheckpointError
from sluice.trainer_hooks.durable import read_small, write_atomic

MAC_NAME = "manifest.mac"
_PREFIX = "hmac-sha256:"


class Signer:
    """Signs and checks manifest bytes with one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_file(cls, key_file: str | os.PathLike[str], root: str | os.PathLike[str]) -> Signer:
        """Read the key; refuse one inside `root`, readable by others, or of an implausible size."""
        path = Path(key_file)
        where = f"checkpoint key file {path}"
        try:
            st = path.stat()
            resolved, root_resolved = path.resolve(), Path(root).resolve()
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot be read ({exc.strerror})") from exc
        if resolved == root_resolved or root_resolved in resolved.parents:
            raise CheckpointError(f"{where}: lies inside the checkpoint folder {root}; keep the key elsewhere")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: not a regular file")
        if st.st_mode & 0o077:
            raise CheckpointError(f"{where}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; chmod 600 it")
        if not 16 <= st.st_size <= 4096:
            raise CheckpointError(f"{where}: {st.st_size} bytes; a key holds 16 to 4096 bytes")
        return cls(path.read_bytes())

    def mac(self, manifest_bytes: bytes) -> str:
        return _PREFIX + hmac.new(self._key, manifest_bytes, hashlib.sha256).hexdigest()

    def sign_into(self, folder: Path, manifest_bytes: bytes) -> None:
        write_atomic(folder / MAC_NAME, (self.mac(manifest_bytes) + "\n").encode("ascii"))

    def check(self, folder: Path, manifest_bytes: bytes) -> None:
        """CheckpointError unless folder/manifest.mac is this key's MAC of `manifest_bytes`."""
        where = f"checkpoint {folder}"
        data = read_small(folder / MAC_NAME, 256, f"{where}:")
        if data is None:
            raise CheckpointError(f"{where}: no {MAC_NAME}, and a key is configured (an unsigned manifest)")
        found = data.decode("ascii", "replace").strip()
        if not hmac.compare_digest(found.encode("ascii", "replace"), self.mac(manifest_bytes).encode("ascii")):
            raise CheckpointError(f"{where}: {MAC_NAME} does not match the manifest under this key "
                                  "(the manifest was changed, or signed with another key)")
