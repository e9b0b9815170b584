"""bench/peers reports what it claims: the mixture workload's spec, the fast-path warning, the jobs' CPU.

Specification: `--workload mixture`'s dataset spec is five sources weighted by
tokens with the default piece draws (concat 2048); a sluice row whose fast
path served under 99% of its steps gets a warning line naming the fall-back
reasons (and `fast_path_under_99`), one at or over 99% none; a job's CPU
figure counts its live child processes (sluice's daemon is one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "bench" / "peers"
sys.path.insert(0, str(PEERS))

import corpus  # noqa: E402
import run  # noqa: E402

from sluice.manifest.spec import load_dataset_spec  # noqa: E402


def test_the_mixture_spec_is_five_sources_by_tokens_with_default_pieces(tmp_path):
    (tmp_path / "dataset.toml").write_text(corpus.spec("m", "unused", corpus.MIXTURE))
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = load_dataset_spec(tmp_path / "dataset.toml")
    assert [(s.name, s.weight) for s in spec.sources] == list(corpus.MIXTURE)
    assert spec.mixture.unit == "tokens" and spec.mixture.piece_tokens == spec.packing.seq_len == 2048
    assert spec.packing.algorithm == "concat"
    single = corpus.spec("s", "shards/code-*.jsonl.zst")
    (tmp_path / "dataset.toml").write_text(single)
    assert [s.name for s in load_dataset_spec(tmp_path / "dataset.toml").sources] == ["code"]


def job(by_path: dict[str, int], fallbacks: dict[str, int]) -> dict:
    return {"tokens_per_s": 1.0, "fast_path": {"steps_by_path": by_path, "fallbacks": fallbacks,
                                               "kernel_loaded": 0}}


def test_a_fast_path_under_99_percent_is_warned_with_its_reasons():
    slow = [job({"fused-numpy": 0, "multistep": 50, "plan": 10}, {"pieces": 60}),
            job({"fused-numpy": 0, "multistep": 40, "plan": 20}, {"pieces": 59, "mapped": 1})]
    fast = [job({"fused-numpy": 990, "fused-kernel": 9, "plan": 1}, {"mapped": 1})]
    loaders = [("sluice pretok", "pre-tokenized", None, "sluice_job.py", {}),
               ("sluice tokcache", "pre-tokenized", None, "sluice_job.py", {})]
    rows = run.summarize({"sluice pretok": slow, "sluice tokcache": fast}, {}, loaders, "mixture")
    assert [r["fast_path_under_99"] for r in rows] == [True, False]
    assert rows[0]["fast_path"]["steps_by_path"] == {"fused-numpy": 0, "multistep": 90, "plan": 30}
    lines = run.fast_path_warnings(rows)
    assert len(lines) == 1 and lines[0].startswith("WARNING: sluice pretok (mixture): the fast path served 0.0%")
    assert "pieces 119, mapped 1" in lines[0]
    assert "fast %" in run.table(rows) and " 99.9" in run.table(rows)
    # a peer (no fast_path block) is neither warned nor flagged
    peer = run.summarize({"litdata": [{"tokens_per_s": 1.0}]}, {}, [("litdata", "pre-tokenized", "litdata",
                                                                     "litdata_job.py", {})])
    assert peer[0]["fast_path_under_99"] is None and not run.fast_path_warnings(peer)


@pytest.mark.slow
def test_a_jobs_cpu_counts_its_live_children():
    sys.path.insert(0, str(PEERS / "jobs"))
    import common  # (imports torch, as every job does)

    before = common.tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\nprint('done', flush=True)\n"
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # its 0.5 s of CPU are spent; it still lives
        got = common.tree_cpu_s() - before
    finally:
        child.kill()
        child.wait()
    assert got >= 0.45, got


def test_a_run_whose_fast_path_served_under_99_percent_from_tokens_fails(capsys):
    def rows(by_path, group="pre-tokenized"):
        return run.summarize({"sluice pretok": [job(by_path, {"mixture": by_path.get("plan", 0)})]}, {},
                             [("sluice pretok", group, None, "sluice_job.py", {})], "mixture")

    assert run.verdict(rows({"fused-numpy": 98, "plan": 2})) == 1
    assert "FAILED: the fast path served under 99% of the steps of sluice pretok (mixture)" in capsys.readouterr().err
    assert run.verdict(rows({"fused-numpy": 99, "plan": 1})) == 0
    # on the fly the objects fill during the run: warned, not failed
    onfly = rows({"plan": 100}, "on the fly")
    assert run.fast_path_warnings(onfly) and run.verdict(onfly) == 0


def test_sluice_rows_from_tokens_get_end_to_end_and_cpu_ratios_to_the_best_peer():
    # The pre-tokenized group has no raw loop; its end-to-end and CPU ratios to LitData were left out.
    loaders = [("sluice pretok", "pre-tokenized", None, "sluice_job.py", {}),
               ("litdata", "pre-tokenized", "litdata", "litdata_job.py", {})]
    got = {"sluice pretok": [{"tokens_per_s": 30.0, "e2e_tokens_per_s": 6.0, "cpu_s_per_mtok": 0.02,
                              "first_batch_s": 1.0}],
           "litdata": [{"tokens_per_s": 10.0, "e2e_tokens_per_s": 3.0, "cpu_s_per_mtok": 0.08, "first_batch_s": 2.0}]}
    rows = run.summarize(got, {}, loaders, "single")
    mix = run.summarize({k: [{**v[0], "tokens_per_s": v[0]["tokens_per_s"] * 0.9}] for k, v in got.items()}, {},
                        loaders, "mixture")
    run.mixture_to_single(rows + mix)
    r = rows[0]
    assert (r["ratio_tokens_per_s"], r["ratio_e2e"], r["ratio_cpu_s_per_mtok"], r["ratio_first_batch"]) == \
        (3.0, 2.0, 0.25, 2.0)
    assert mix[0]["ratio_mixture_to_single"] == pytest.approx(0.9)
    text = run.table(rows + mix)
    assert "3.00x litdata / 2.00x litdata / 0.25x" in text and "mixture / single steady tokens/s: sluice pretok 0.90x" \
        in text


def test_the_corpus_is_rebuilt_when_the_token_or_cache_code_changes(tmp_path, monkeypatch):
    # A prepared corpus's key digests the code that decides its token arrays and warmed caches, not only the
    # manifest package: a change to the tokenizer's or the cache's code must not reuse stale arrays.
    for pkg in ("manifest", "tokenize", "cache"):
        (tmp_path / "sluice" / pkg).mkdir(parents=True)
        (tmp_path / "sluice" / pkg / "m.py").write_text("A = 1\n")
    monkeypatch.setattr(corpus, "REPO", tmp_path)
    seen = {corpus.code_digest()}
    for pkg in ("manifest", "tokenize", "cache"):
        (tmp_path / "sluice" / pkg / "m.py").write_text(f"A = 2  # {pkg}\n")
        seen.add(corpus.code_digest())
    assert len(seen) == 4


def test_the_output_names_the_repositorys_folders_relative_to_it(tmp_path):
    """What the bench prints (and a kept log shows) names no machine's folders inside the repository."""
    assert run.shown(run.REPO / "bench" / "out" / "peers.json") == "bench/out/peers.json"
    assert run.shown(tmp_path) == str(tmp_path.resolve())


@pytest.mark.parametrize("label,field,value", [("sluice tokcache bestfit", ("packing", "algorithm"), "bestfit"),
                                               ("sluice tokcache sequences", ("mixture", "unit"), "sequences")])
def test_the_variant_rows_read_the_corpus_frozen_with_their_packer_or_unit(tmp_path, tokenizer_file, label, field,
                                                                           value):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "code-000.jsonl").write_text('{"text": "def f():\\n    return 1\\n"}\n')
    (tmp_path / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())
    (tmp_path / "dataset.toml").write_text(corpus.spec("p", "shards/code-*.jsonl"))
    assert value not in (tmp_path / "dataset.toml").read_text()
    label, _, _, _, extra = next(spec for spec in run.LOADERS if spec[0] == label)
    paths = {"manifest": str(tmp_path / "manifest.json"), "cache_tok": str(tmp_path / "cache-tok")}
    cfg = run.job_config(label, extra, paths, 10, tmp_path)
    assert cfg["cache"] == paths["cache_tok"]  # the token cache of the concat manifest: tokens ignore the packer
    assert json.loads(Path(cfg["manifest"]).read_text())[field[0]][field[1]] == value


def test_the_e2e_ceiling_and_bound_follow_the_start_floor(tmp_path):
    """A row's ceiling is its tokens at its steady rate after the floor; the bound is the tokens over the floor
    alone, for any loader; a sluice job's run spec declares the run's length."""
    rows = [{"loader": "sluice pretok", "workload": "single", "tokens_per_s": 2e6, "e2e_tokens_per_s": 1e6,
             "best_peer_e2e": "litdata"},
            {"loader": "litdata", "workload": "single", "tokens_per_s": 1e6, "e2e_tokens_per_s": 0.5e6}]
    run.add_ceilings(rows, [1.0, 3.0, 2.0], batches=100)  # median floor 2 s; 100 x 8 x 2048 tokens
    tokens = 100 * 8 * 2048
    assert rows[0]["e2e_ceiling_tokens_per_s"] == pytest.approx(tokens / (2.0 + tokens / 2e6))
    lines = run.ceiling_lines(rows)
    bound = tokens / 2.0
    assert lines[0].startswith(f"e2e bound (single): {bound / 1e6:.2f} M tok/s")
    assert f"{bound / 0.5e6:.2f}x litdata" in lines[0]
    assert lines[1].startswith("e2e ceiling sluice pretok (single)") and len(lines) == 2
    (tmp_path / "run.toml").write_text('run_id = "x"\n')
    cfg = run.job_config("sluice pretok", {"variant": "pretok"},
                         {"runspec": str(tmp_path / "run.toml"), "manifest": str(tmp_path / "m.json"),
                          "derived": "d", "cache_pretok": "c"}, 100, tmp_path)
    assert Path(cfg["runspec"]).read_text().endswith(f"max_steps = {100 + run.STEPS_MARGIN}\n")


def test_quick_is_the_command_of_the_standing_table_from_tokens_it_checks():
    # docs/performance.md states the ratios `--quick` gives against those of table 2: the same loaders and length
    doc = (PEERS.parent.parent / "docs" / "performance.md").read_text()
    table2 = next(line for line in doc.splitlines() if "bench/peers/run.py --workload both --batches 1" in line)
    assert f"--batches {run.QUICK_BATCHES} " in table2 and f'--peers "{run.QUICK_PEERS}"' in table2
    assert set(run.QUICK_PEERS.split(",")) <= {spec[0] for spec in run.LOADERS}
    # and in as many rounds as the docs say (a median of 3: one cold or busy round does not move it)
    assert f"table 2 below in {run.QUICK_ROUNDS} rounds" in doc and run.QUICK_ROUNDS >= 3
