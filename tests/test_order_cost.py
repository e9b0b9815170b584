"""A global order over raw objects that would thrash the decode budget is refused at start, with numbers.

The estimate (sluice/loaderd/physical/ordercost.py) reads the epoch-0 order
itself: which objects the documents of a window of steps live in. The refusal
names the objects, the bytes, the budget and both ways out; block order,
pre-tokenized sources and objects whose tokens are already cached pass.
"""

from __future__ import annotations

import pytest

from loaderd_support import build_corpus
from logical_helpers import make_manifest, make_spec
from sluice.loaderd.logical import Plan
from sluice.errors import OrderCostError
from sluice.loaderd.physical.ordercost import check, estimate

# 40 objects of 50 records, 5,000 bytes each (100 bytes per record: ~25 tokens per document)
MANY = [("web", [50] * 40, "1", "repeat")]


def plan_for(order: str = "global", **kw) -> Plan:
    return Plan(make_manifest(MANY, seq_len=256, **kw), make_spec(lanes=4, global_batch=8, micro_batch=2,
                                                                     order=order))


def test_global_order_touches_many_objects_and_the_estimate_grows_with_the_window():
    plan = plan_for()
    one, eight = estimate(plan, 1), estimate(plan, 8)
    # a step needs ~(2 rows x 256 tokens / 25 + 1) x 4 lanes ~ 88 documents, spread over the 40 objects
    assert 20 <= one.objects <= 40
    assert one.objects <= eight.objects == 40
    assert eight.bytes == 40 * 5000
    assert eight.per_source == (("web", 40, 40),)


def test_refusal_names_the_numbers_and_both_ways_out():
    with pytest.raises(OrderCostError) as info:
        check(plan_for(), 8, budget=64 << 10)
    msg = str(info.value)
    for part in ('order = "global"', "8 step(s)", "40 objects", "'web' 40 of 40", "195.3 KiB", "64.0 KiB",
                 "sluice cache warm --tokens", "sluice tokenize pretokenize", 'order = "block"',
                 "a smaller loaderd --lead-steps (the window; now 8)"):
        assert part in msg, (part, msg)
    assert info.value.exit_code == 2
    with pytest.raises(OrderCostError) as one:  # (`sluice plan`'s window, one step: no lead to shorten)
        check(plan_for(), 1, budget=1)
    assert "--lead-steps" not in str(one.value)


def test_within_budget_block_order_and_cached_tokens_pass():
    assert check(plan_for(), 8, budget=1 << 20).objects == 40
    assert check(plan_for(order="block"), 8, budget=1) is None
    assert check(plan_for(order="none"), 8, budget=1) is None
    every = check(plan_for(), 8, budget=1, cached=lambda s, o: True)  # tokens cached: nothing to decode
    assert every is not None and every.objects == 0 and every.bytes == 0
    half = estimate(plan_for(), 8, cached=lambda s, o: o % 2 == 0)
    assert half.objects == 20


def test_loaderd_refuses_at_start_with_exit_2(tmp_path, tokenizer_file, capsys):
    from sluice.loaderd.cli import main

    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file)
    argv = [str(root / "manifest.json"), str(root / "run.toml"), "--cache", str(tmp_path / "cache"),
            "--decoded-bytes", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("loaderd: error: ") and 'order = "block"' in err and "--decoded-bytes" in err
