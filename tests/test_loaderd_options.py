"""loaderd's options, declared once (sluice/loaderd/options.py): the command line, both configs and the docs table.

A new option is one `Option` plus its use; these tests hold the pieces made
from the declaration to it, and docs/loaderd.md's table to what it generates.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from loaderd_support import build_corpus
from sluice.errors import SpecError
from sluice.loaderd import options
from sluice.loaderd.config import ServerConfig
from sluice.loaderd.options import OPTIONS, REQUIRED, Option, declared_fields
from sluice.loaderd.physical.assemble import DataPathConfig

DOCS = Path(__file__).resolve().parent.parent / "docs" / "loaderd.md"


def _parser() -> argparse.ArgumentParser:
    from sluice.loaderd.cli import add_arguments

    p = argparse.ArgumentParser(prog="loaderd")
    add_arguments(p)
    return p


def test_the_docs_table_is_the_declaration() -> None:
    page = DOCS.read_text(encoding="utf-8")
    assert options.with_table(page) == page, (
        "docs/loaderd.md's option table differs from sluice/loaderd/options.py: "
        "run `python -m sluice.loaderd.options docs/loaderd.md`")
    for o in OPTIONS:
        assert f"| `{o.flag}` |" in page


def test_every_option_is_on_the_command_line_and_every_field_in_its_config() -> None:
    flags = {s for a in _parser()._actions for s in a.option_strings}
    assert {o.flag for o in OPTIONS} <= flags
    server = {f.name: f for f in dataclasses.fields(ServerConfig)}
    data = {f.name: f for f in dataclasses.fields(DataPathConfig)}
    for o in OPTIONS:
        if o.field:
            want = o.field_default()
            got = server[o.field].default
            assert (got is dataclasses.MISSING) if want is REQUIRED else got == want, o.flag
        if o.data_field:
            want = o.field_default(data_path=True)
            got = data[o.data_field].default
            assert (got is dataclasses.MISSING) if want is REQUIRED else got == want, o.flag


# What a command line with no option but --cache gave ServerConfig before the declaration.
_BEFORE = {
    "cache_dir": "c", "cache_budget_bytes": 8 << 30, "replicas": 1, "endpoint": None, "state_dir": None,
    "metrics_port": None, "metrics_ids": False, "workers": 2, "worker_kind": "thread", "demand_workers": 0,
    "jit": "auto", "lead_steps": 32, "queue_bytes": 256 << 20, "decoded_bytes": 256 << 20,
    "request_ttl_s": 60.0, "memory_limit": "auto", "verify_on_read": True, "scrub_rate": 32 << 20}


def test_the_defaults_are_those_of_before() -> None:
    """The defaults the daemon, an embedded Server and a lone data path had before the declaration."""
    server = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    assert {k: server[k] for k in ("replicas", "endpoint", "state_dir", "metrics_port", "metrics_ids",
                                   "memory_limit", "workers", "worker_kind", "demand_workers",
                                   "lead_steps", "queue_bytes", "decoded_bytes", "scrub_rate", "request_ttl_s",
                                   "verify_on_read", "jit")} == {
        "replicas": 1, "endpoint": None, "state_dir": None, "metrics_port": None, "metrics_ids": False,
        "memory_limit": "off", "workers": 2, "worker_kind": "thread", "demand_workers": 0,
        "lead_steps": 32, "queue_bytes": 256 << 20, "decoded_bytes": 256 << 20, "scrub_rate": 32 << 20,
        "request_ttl_s": 60.0, "verify_on_read": True, "jit": "auto"}
    data = {f.name: f.default for f in dataclasses.fields(DataPathConfig)}
    assert {k: data[k] for k in ("verify_on_read", "decoded_bytes", "workers", "worker_kind",
                                 "demand_workers", "window_steps", "allowed_roots", "jit", "scrub_rate")} == {
        "verify_on_read": True, "decoded_bytes": 256 << 20, "workers": 2, "worker_kind": "thread",
        "demand_workers": 0, "window_steps": 1, "allowed_roots": None, "jit": "auto", "scrub_rate": 0}
    args = _parser().parse_args(["m.json", "run.toml", "--cache", "c"])
    got = options.server_values(args, demand_workers=0)  # (an option added later adds its own field)
    assert {k: got[k] for k in _BEFORE} == _BEFORE



def test_a_command_line_reaches_the_server_config_and_the_data_path(tmp_path: Path, tokenizer_file) -> None:
    from sluice.loaderd.cli import config_from_args

    root = build_corpus(tmp_path / "corpus", "jsonl", tokenizer_file, docs=20, objects=1)
    args = _parser().parse_args([
        str(root / "manifest.json"), str(root / "run.toml"), "--cache", str(tmp_path / "cache"),
        "--cache-budget", "1GiB", "--workers", "3", "--worker-kind", "process", "--demand-workers", "2",
        "--jit", "off", "--lead-steps", "5", "--queue-bytes", "4MiB", "--decoded-bytes", "16MiB",
        "--request-ttl", "7.5", "--memory-limit", "off", "--no-verify-on-read", "--scrub-rate", "1MiB",
        "--metrics-ids"])
    config = config_from_args(args)
    assert (config.cache_budget_bytes, config.workers, config.worker_kind, config.demand_workers, config.jit,
            config.lead_steps, config.queue_bytes, config.decoded_bytes, config.request_ttl_s, config.memory_limit,
            config.verify_on_read, config.scrub_rate, config.metrics_ids) == (
        1 << 30, 3, "process", 2, "off", 5, 4 << 20, 16 << 20, 7.5, "off", False, 1 << 20, True)
    dp = config.data_path()
    assert (dp.cache_dir, dp.cache_budget, dp.workers, dp.worker_kind, dp.demand_workers, dp.jit, dp.decoded_bytes,
            dp.verify_on_read, dp.scrub_rate, dp.window_steps) == (
        str(tmp_path / "cache"), 1 << 30, 3, "process", 2, "off", 16 << 20, False, 1 << 20, 5)
    # Every data-path field, by its DataPathConfig name.
    handed = options.data_path_values(config)
    want = {"cache_dir": str(tmp_path / "cache"), "cache_budget": 1 << 30, "workers": 3, "worker_kind": "process",
            "demand_workers": 2, "jit": "off", "decoded_bytes": 16 << 20, "verify_on_read": False,
            "scrub_rate": 1 << 20}
    assert {k: handed[k] for k in want} == want
    assert set(options.data_path_fields()) == set(options.data_path_values(config))


def test_a_bad_size_names_itself_and_a_bound_names_the_flag(capsys) -> None:
    with pytest.raises(SpecError, match=r"size .12 parsecs. is not a number of bytes"):
        options.parse_size("12 parsecs")
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["m.json", "r.toml", "--cache", "c", "--workers", "0"])
    assert exc.value.code == 2
    assert "--workers '0': expected a value in [1, 1024]" in capsys.readouterr().err


def test_one_declaration_makes_a_new_option_everywhere(monkeypatch) -> None:
    """A new option: the flag, both config fields (with their defaults) and its docs row come from one entry."""
    new = Option("--example-threads", "threads of an example stage (default 4)", kind="int", default=4,
                 bounds=(1, 64), field="example_threads", type="int", data_field="example_threads")
    monkeypatch.setattr(options, "OPTIONS", (*OPTIONS, new))

    @dataclasses.dataclass(frozen=True, kw_only=True)
    @declared_fields("data_path")
    class Config:
        collect: bool = True

    assert Config(cache_dir="c", cache_budget=1).example_threads == 4
    assert Config(cache_dir="c", cache_budget=1, example_threads=2).example_threads == 2
    p = argparse.ArgumentParser()
    options.add_options(p)
    args = p.parse_args(["--cache", "c", "--example-threads", "8"])
    assert options.server_values(args, demand_workers=0)["example_threads"] == 8
    assert "| `--example-threads` | EXAMPLE_THREADS in [1, 64] | 4 | `example_threads` | " \
           "`example_threads` | threads of an example stage (default 4) |" in options.markdown_table()


def test_a_field_declared_by_an_option_is_not_declared_again() -> None:
    with pytest.raises(TypeError, match=r"Config.workers is declared by option --workers"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        @declared_fields("server")
        class Config:
            workers: int = 2


def test_the_docs_writer_replaces_only_the_table(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"intro\n\n{options.BEGIN}\nstale\n{options.END}\n\nrest\n")
    assert options.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n\n") and text.endswith(f"{options.END}\n\nrest\n") and "stale" not in text
    assert options.markdown_table() in text
    (tmp_path / "none.md").write_text("no markers\n")
    assert options.main([str(tmp_path / "none.md")]) == 2
