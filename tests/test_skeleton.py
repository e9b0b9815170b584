"""Canonical encoding and run spec invariants that everything else rests on."""

import pytest

from sluice.errors import ManifestError, SpecError
from sluice.manifest.canonical import canonical_bytes, digest_id, parse_json
from sluice.runspec import RunSpec


def test_canonical_bytes_sort_keys_and_escape_non_ascii():
    assert canonical_bytes({"b": 1, "a": ["é", None, True]}) == b'{"a":["\\u00e9",null,true],"b":1}'


def test_canonical_refuses_floats():
    with pytest.raises(ManifestError, match="float"):
        canonical_bytes({"weight": 0.7})
    with pytest.raises(ManifestError, match="float"):
        parse_json(b'{"w": 0.5}', "m")


def test_duplicate_keys_refused():
    with pytest.raises(ManifestError, match="duplicate key"):
        parse_json(b'{"a": 1, "a": 2}', "m")


def test_digest_id_golden():
    # BLAKE3 of the empty input (official test vector).
    assert digest_id(b"") == "b3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_runspec_requires_batch_multiple_of_lanes():
    with pytest.raises(SpecError, match="not a multiple of lanes"):
        RunSpec(run_id="r1", seed=1, lanes=8, global_batch=12, micro_batch=4)


def test_runspec_digest_changes_with_any_field():
    a = RunSpec(run_id="r1", seed=1, lanes=8, global_batch=16, micro_batch=4)
    b = RunSpec(run_id="r1", seed=2, lanes=8, global_batch=16, micro_batch=4)
    assert a.digest != b.digest and a.digest == RunSpec(**a.to_obj()).digest
