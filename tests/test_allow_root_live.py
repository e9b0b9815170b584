"""`loaderd --allow-root` holds while the daemon runs, not only at its start.

The start check (`check_manifest`) resolves every location once. A folder link
inside an allowed root can be re-pointed out of it afterwards; the daemon's
node cache checks each miss again (after resolving links), so such a location
is refused before a byte is read, in the daemon and its worker processes
alike (they get the same roots).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import pytest

from loaderd_support import build_corpus
from sluice.errors import LocationRefused


def test_a_link_re_pointed_out_of_the_root_after_the_start_is_refused_at_the_miss(tmp_path, tokenizer_file):
    from sluice.loaderd.cli import add_arguments, config_from_args
    from sluice.loaderd.physical.assemble import open_data_path

    root = build_corpus(tmp_path / "corpus", "jsonl.zst", tokenizer_file, docs=30, objects=1)
    (root / "shards").rename(root / "real-shards")
    (root / "shards").symlink_to("real-shards")  # a link inside the root: allowed at the start
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([str(root / "manifest.json"), str(root / "run.toml"),
                                                 "--cache", str(tmp_path / "cache")]))
    assert config.allowed_roots is not None and config.data_path().allowed_roots == config.allowed_roots

    outside = tmp_path / "outside"
    shutil.copytree(root / "real-shards", outside)  # the very same bytes, outside the root
    (root / "shards").unlink()
    (root / "shards").symlink_to(outside)  # re-pointed while the daemon runs
    manifest = config.manifest
    obj = manifest.sources[0].objects[0]
    with open_data_path(manifest, config.spec, dataclasses.replace(config.data_path(), window_steps=0)) as data:
        with pytest.raises(LocationRefused, match=r"c-0\.jsonl\.zst' is outside the allowed roots"):
            data.cache.fetch(obj, manifest.resolve(obj.location))
        assert data.cache.stats().fills == 0
