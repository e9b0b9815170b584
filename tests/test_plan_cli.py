"""`sluice plan`, `whence`, `ledger` on a real frozen corpus (jsonl.zst + parquet, real tokenizer)."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from support import stdlib_texts


def _chunks(limit: int) -> list[str]:
    out = []
    for text in stdlib_texts(40):
        lines = text.splitlines(keepends=True)
        out += ["".join(lines[i : i + 25]) for i in range(0, len(lines), 25)]
    return out[:limit]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory, tokenizer_file):
    from sluice.manifest.freeze import freeze

    root = tmp_path_factory.mktemp("plan")
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    (root / "shards").mkdir()
    texts = _chunks(400)
    cctx = zstandard.ZstdCompressor()
    for i in range(3):
        part = texts[i * 80 : (i + 1) * 80]
        data = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
        (root / "shards" / f"code-{i}.jsonl.zst").write_bytes(cctx.compress(data))
    pq.write_table(pa.table({"text": texts[240:400]}), root / "shards" / "docs-0.parquet")
    (root / "dataset.toml").write_text(
        'name = "plan-test"\ntokenizer = "tokenizer.json"\n'
        '[packing]\nseq_len = 64\nalgorithm = "concat"\neos = "<|endoftext|>"\npad = "<|pad|>"\n'
        '[mixture]\npolicy = "quota"\nunit = "tokens"\n'
        '[[sources]]\nname = "code"\npaths = ["shards/code-*.jsonl.zst"]\nformat = "jsonl"\nweight = "0.75"\nexhaustion = "repeat"\n'
        '[[sources]]\nname = "docs"\npaths = ["shards/docs-*.parquet"]\nformat = "parquet"\nweight = "0.25"\nexhaustion = "repeat"\n'
    )
    (root / "run.toml").write_text('run_id = "t"\nseed = 7\nlanes = 4\nglobal_batch = 8\nmicro_batch = 2\n')
    freeze(root / "dataset.toml", root / "manifest.json", progress=False)
    return root


def _plan(run_cli, root, steps, replicas):
    proc = run_cli("plan", root / "manifest.json", root / "run.toml", "--steps", steps, "--replicas", str(replicas), "--json", "--cache", root / "cache")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_plan_json_lines_and_replica_invariance(frozen, sluice_main):
    one = _plan(sluice_main, frozen, "0:6", 1)
    two = _plan(sluice_main, frozen, "0:6", 2)
    assert [(x["step"], x["replica"]) for x in one] == [(s, 0) for s in range(6)]
    assert all(len(x["digest"]) == 64 and x["samples"] for x in one)
    for step in range(6):
        halves = [x for x in two if x["step"] == step]
        assert [h["replica"] for h in halves] == [0, 1]
        assert halves[0]["samples"] + halves[1]["samples"] == one[step]["samples"]
    # a later window equals the same steps of a longer plan: pure function of the step
    assert _plan(sluice_main, frozen, "3:5", 1) == one[3:5]


@pytest.mark.slow
def test_a_window_after_steps_walked_by_the_fast_path_is_the_plans(tmp_path, tokenizer_file, sluice_main, aot_kernel,
                                                                    monkeypatch):
    """`sluice plan --steps A:B` walks the steps before A in calls of the fast path (pretokenized objects; the
    module compiled ahead of time is here, so the kernel loads at once); the window it prints (by `Plan.step`)
    equals the same steps of a plan from step 0."""
    from loaderd_support import build_corpus

    from sluice.loaderd.logical import fast

    root = build_corpus(tmp_path / "tok", "sltok", tokenizer_file, unit="tokens")
    whole = _plan(sluice_main, root, "0:40", 2)
    served, reasons = [], []
    real = fast.fast_steps

    def counted(*a):
        made = real(*a)
        served.append(0 if isinstance(made, str) else len(made.state_dicts))
        reasons.append(made if isinstance(made, str) else "")
        return made

    monkeypatch.setattr(fast, "fast_steps", counted)
    assert _plan(sluice_main, root, "37:40", 2) == whole[2 * 37:]
    assert sum(served) >= 30 and max(served) > 1, (served, reasons)  # (the prefix in calls of several steps)


def test_whence_agrees_with_plan(frozen, sluice_main):
    plan = _plan(sluice_main, frozen, "0:8", 2)
    sample = plan[-1]["samples"][-1]
    proc = sluice_main("whence", frozen / "manifest.json", frozen / "run.toml", sample, "--replicas", "2", "--json", "--cache", frozen / "cache")
    assert proc.returncode == 0, proc.stderr
    where = json.loads(proc.stdout.splitlines()[0])
    first = min(x["step"] for x in plan if sample in x["samples"])
    assert where["step"] == first
    assert where["replica"] == next(x["replica"] for x in plan if sample in x["samples"])


def test_ledger_reports_realized_vs_target(frozen, sluice_main):
    proc = sluice_main("ledger", frozen / "manifest.json", frozen / "run.toml", "--until-step", "9", "--json", "--cache", frozen / "cache")
    assert proc.returncode == 0, proc.stderr
    led = json.loads(proc.stdout)
    assert led["until_step"] == 9 and led["unit"] == "tokens"
    code, docs = led["sources"]
    assert code["docs"] > 0 and docs["docs"] > 0
    assert abs(float(code["realized_share"]) - 0.75) < 0.15


def test_unknown_sample_and_bad_steps_are_clear_errors(frozen, sluice_main):
    proc = sluice_main("whence", frozen / "manifest.json", frozen / "run.toml", "b3:" + "0" * 64 + ":3")
    assert proc.returncode == 2 and "no object with digest" in proc.stderr
    proc = sluice_main("plan", frozen / "manifest.json", frozen / "run.toml", "--steps", "5:2")
    assert proc.returncode == 2 and "--steps" in proc.stderr
    proc = sluice_main("plan", frozen / "manifest.json", frozen / "run.toml", "--steps", "0:1", "--replicas", "3")
    assert proc.returncode == 2 and "3 replicas do not divide lanes=4" in proc.stderr
    # whence answers from step 0 for every epoch: a state it would not use is refused, not ignored
    state = frozen / "state-for-whence.json"
    state.write_text("{}")
    proc = sluice_main("whence", frozen / "manifest.json", frozen / "run.toml", "b3:" + "0" * 64 + ":3", "--state",
                       state)
    assert proc.returncode == 2 and "unrecognized arguments: --state" in proc.stderr
    # a step bound below the first step is a mistake, not an empty answer
    proc = sluice_main("ledger", frozen / "manifest.json", frozen / "run.toml", "--until-step", "-1")
    assert proc.returncode == 2 and "--until-step '-1': expected a value in [0," in proc.stderr
    proc = sluice_main("whence", frozen / "manifest.json", frozen / "run.toml", "b3:" + "0" * 64 + ":3",
                       "--max-steps", "0")
    assert proc.returncode == 2 and "--max-steps '0': expected a value in [1," in proc.stderr


def test_the_dataset_spec_where_the_manifest_or_run_spec_goes_says_so(frozen, sluice_main):
    # the first mix-up of a new user: two TOML files and a JSON one, given in the wrong places
    proc = sluice_main("plan", frozen / "dataset.toml", frozen / "run.toml", "--steps", "0:1")
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"sluice: error: manifest {frozen / 'dataset.toml'} (a TOML file, a dataset or run spec? The manifest is "
        "the JSON file `sluice manifest freeze DATASET.toml -o manifest.json` writes): not valid JSON")
    proc = sluice_main("plan", frozen / "manifest.json", frozen / "dataset.toml", "--steps", "0:1")
    assert proc.returncode == 2 and proc.stderr.startswith(f"sluice: error: run spec {frozen / 'dataset.toml'}: ")
    assert "(this is a dataset spec; the run spec is its own file)" in proc.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_file):
    """12 short documents, 4 lanes, 4 rows of 16 tokens a step: an epoch lasts a few steps."""
    from sluice.manifest.freeze import freeze

    root = tmp_path_factory.mktemp("tiny")
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(): return {i} * x"}) + "\n" for i in range(12)))
    (root / "dataset.toml").write_text(
        'name = "tiny"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 16\neos = "<|endoftext|>"\n'
        '[[sources]]\nname = "a"\npaths = ["d.jsonl"]\nformat = "jsonl"\nexhaustion = "repeat"\n'
    )
    (root / "run.toml").write_text('run_id = "t"\nseed = 3\nlanes = 4\nglobal_batch = 4\nmicro_batch = 1\n')
    freeze(root / "dataset.toml", root / "manifest.json", progress=False)
    return root


def test_whence_epochs_after_the_first(tiny, sluice_main):
    """Every epoch's (step, lane) equals where the plan serves the sample's first tokens (issue 10 item 17)."""
    from sluice.loaderd.plan_cli import open_plan

    args = type("A", (), {"manifest": tiny / "manifest.json", "run": tiny / "run.toml", "cache": str(tiny / "cache"),
                          "cache_budget": 1 << 30})()
    epochs = 5
    with open_plan(args) as (plan, docs):
        # a sample whose lane changes between epochs (the case the old code got wrong)
        index = next(i for i in range(12) if len({plan.order(0, e).position_of(i) % 4 for e in range(epochs)}) > 1)
        sample = plan.ref(0, 0, index).sample_id
        where = {e: divmod(plan.order(0, e).position_of(index), 4) for e in range(epochs)}  # (ordinal, lane)
        # Oracle from the lane cursors: epoch e's copy is drawn in the step that
        # moves its lane's cursor (epoch, taken) past (e, ordinal); concat packs
        # a drawn document's first tokens into that same step.
        expected, served, state = {}, set(), plan.initial_state()
        while state.step < 60:
            batch, state = plan.step(state, docs)
            for e, (ordinal, lane) in where.items():
                c = state.lanes[lane].sources[0]
                if e not in expected and (c.epoch, c.taken) > (e, ordinal):
                    expected[e] = (batch.step, lane)
            for lane, rows in batch.rows.items():
                served |= {(batch.step, lane) for row in rows for sid, start, _ in row.segments
                           if sid == sample and start == 0}
        assert len(expected) == epochs and set(expected.values()) <= served
    r = sluice_main("whence", tiny / "manifest.json", tiny / "run.toml", sample, "--epochs", str(epochs), "--json",
                    "--cache", tiny / "cache")
    assert r.returncode == 0, r.stderr
    found = [json.loads(line) for line in r.stdout.splitlines()]
    assert [f["epoch"] for f in found] == list(range(epochs))
    assert all(f["step"] is not None and f["step"] < 60 for f in found), found
    assert {f["epoch"]: (f["step"], f["lane"]) for f in found} == expected
