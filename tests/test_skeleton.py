"""Canonical encoding and run spec invariants that everything else rests on."""

import pytest

from hypothesis import given
from hypothesis import strategies as st

from sluice import datastate
from sluice.datastate import RESUME_CONTRACTS, SourceCursor, check_resize
from sluice.errors import ManifestError, ResizeRefused, SpecError, StateError
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


def test_runspec_digest_changes_with_any_field_that_shapes_the_stream_but_not_with_resume():
    a = RunSpec(run_id="r1", seed=1, lanes=8, global_batch=16, micro_batch=4)
    b = RunSpec(run_id="r1", seed=2, lanes=8, global_batch=16, micro_batch=4)
    assert a.digest != b.digest and a.digest == RunSpec(**a.to_obj()).digest
    # the resume contract is how restores may go, not what the stream is
    assert RunSpec(**{**a.to_obj(), "resume": "exact-elastic"}).digest == a.digest


@given(resume=st.sampled_from(RESUME_CONTRACTS), saved=st.integers(1, 64), world=st.integers(1, 64))
def test_only_resume_exact_refuses_a_change_of_data_parallel_size(resume, saved, world):
    if resume == "exact" and saved != world:
        with pytest.raises(ResizeRefused) as err:
            check_resize(resume, saved, world, "client of replica 0")
        assert (err.value.resume, err.value.saved_world_size, err.value.world_size) == (resume, saved, world)
        assert str(err.value).startswith(f"client of replica 0: the checkpoint was saved by {saved} "
                                         f"data-parallel ranks and this run has {world}")
        assert 'set resume = "exact-elastic" in the run spec' in str(err.value)
    else:  # exact-elastic, coverage, distributional: sluice's exact stream keeps their promise
        check_resize(resume, saved, world, "client of replica 0")


def test_an_unknown_resume_contract_is_an_error_naming_it():
    with pytest.raises(StateError, match="resume contract 'bitwise' is not one of exact, exact-elastic"):
        check_resize("bitwise", 2, 2, "client of replica 0")


def test_the_cursor_column_names_are_the_source_cursor_fields_in_list_order():
    cursor = SourceCursor(epoch=1, taken=2, active=False, docs=4, tokens=5, loss_tokens=6, rows=7)
    columns = cursor.to_list()
    for name in ("epoch", "taken", "active", "docs", "tokens", "loss_tokens", "rows"):
        assert columns[getattr(datastate, f"CUR_{name.upper()}")] == int(getattr(cursor, name))
    assert SourceCursor.from_columns(columns) == cursor == SourceCursor.from_list(columns, "test")


def test_every_lazily_exported_name_resolves():
    """Each package's lazy exports (`sluice._lazy.lazy_exports`) name a module that defines them: a name
    moved to another module without its export entry fails here, not in a user's command."""
    import importlib
    import pkgutil

    import sluice

    packages = [sluice] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(sluice.__path__, "sluice.")
                           if m.ispkg]
    checked = 0
    for pkg in packages:
        for name in getattr(pkg, "__all__", ()):
            assert getattr(pkg, name) is not None, f"{pkg.__name__}.{name}"
            checked += 1
    assert checked > 10
