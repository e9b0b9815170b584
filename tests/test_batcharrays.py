"""The batch arrays, declared once (sluice/batcharrays.py), reach the trainer by every path, whatever they are.

Nothing here names an array beyond the packer's: every declared array,
today's and any added later, is checked to be made by both producer paths
(`Plan.step` and the fast path) with equal bytes and its declared dtype and
shape, to cross the wire (packed frames or not) unchanged, and to reach the
client's batch dict under its name; the docs' table is the declaration's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sluice import batcharrays
from sluice.wire import decoding, encoding, protocol
from sluice.errors import InternalError
from sluice.loaderd.physical.producer import StepMaker

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def test_the_docs_table_is_the_declaration():
    page = DOCS.read_text(encoding="utf-8")
    assert batcharrays.with_table(page) == page, (
        "docs/protocol.md's batch array table differs from sluice/batcharrays.py: "
        "run `python -m sluice.batcharrays docs/protocol.md`")


def test_writing_the_table_into_a_page_without_its_markers_exits_2(tmp_path, capsys):
    page = tmp_path / "p.md"
    page.write_text("# no table here\n")
    assert batcharrays.main([str(page)]) == 2
    assert "no batch array table" in capsys.readouterr().err and page.read_text() == "# no table here\n"


def test_the_declaration_fits_the_wire_and_its_order():
    assert all(a.dtype in protocol.DTYPES for a in batcharrays.ARRAYS)
    assert protocol.BATCH_ARRAYS == batcharrays.NAMES and set(protocol.ARRAY_ORDER) <= set(protocol.BATCH_ARRAYS)
    # a BATCH's frames: the header and one per array at most (a client refuses more than its limit)
    assert len(batcharrays.NAMES) + 1 <= protocol.Limits.for_client().max_frames
    assert protocol.ARRAY_ORDER[:4] == ("input_ids", "labels", "position_ids", "cu_seqlens")  # digests recorded so far
    bad = (batcharrays.BatchArray("m", "|u1", batcharrays.ROWS, "", derive=lambda m: 0), *batcharrays.ARRAYS)
    with pytest.raises(InternalError, match="after the packer's"):
        batcharrays.check_declaration(bad)
    with pytest.raises(InternalError, match="explicit little-endian"):
        batcharrays.check_declaration(tuple(replace(a, dtype="int32") for a in batcharrays.ARRAYS))
    packer = [a for a in batcharrays.ARRAYS if a.derive is None]
    with pytest.raises(InternalError, match="then cu_seqlens"):
        batcharrays.check_declaration((packer[-1], *packer[:-1]))


def _makers(algorithm: str):
    from logical_helpers import MappedDocs, make_manifest, make_spec

    from sluice.loaderd.logical import Plan

    manifest = make_manifest([("a", [50, 40, 60], "1", "repeat"), ("b", [30], "2", "repeat")], seq_len=16,
                             algorithm=algorithm)
    plan = Plan(manifest, make_spec(lanes=2, global_batch=4, micro_batch=2))
    return plan, [StepMaker(plan, MappedDocs(plan, 40), replica=0, replicas=1) for _ in range(2)]


def check_declared(micro: dict) -> None:
    """`micro` holds exactly the declared arrays, in order, each of its dtype and shape rule."""
    assert list(micro) == list(batcharrays.NAMES)
    rows = np.asarray(micro["input_ids"]).shape
    for a in batcharrays.ARRAYS:
        got = np.asarray(micro[a.name])
        assert got.dtype == np.dtype(a.dtype), a.name
        assert got.shape == rows if a.shape == batcharrays.ROWS else got.ndim == 1, a.name


@pytest.mark.parametrize("algorithm", ["bestfit", "concat"])
def test_both_producer_paths_make_every_declared_array_alike(algorithm):
    plan, (fast, single) = _makers(algorithm)
    state = plan.initial_state()
    for _ in range(3):
        for entry, after in fast.produce_steps(state, 4):  # the fast path (the kernels' source, uncompiled)
            want, _ = single.produce_step(state)  # Plan.step
            for got, ref in zip(entry.micros, want.micros, strict=True):
                check_declared(got)
                assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in ref.items()}
            assert entry.nbytes == want.nbytes == sum(a.nbytes for m in want.micros for a in m.values())
            state = after


def test_every_declared_array_crosses_the_wire():
    plan, (maker, _) = _makers("bestfit")
    entry, _ = maker.produce_step(plan.initial_state())
    heads = encoding.BatchHeaders(run_id="r", dataset_id="d", generation=0, replica=0, instance="i")
    for want in entry.micros:
        check_declared(want)
        for pack in (0, 1 << 19):
            frames = heads.frames(step=0, micro=0, request_id=1, body=b"{}", arrays=want, pack_below=pack)
            msg = decoding.decode([bytes(memoryview(f)) for f in frames], protocol.Limits.for_client())
            check_declared(msg.arrays)
            assert {k: v.tobytes() for k, v in msg.arrays.items()} == {k: v.tobytes() for k, v in want.items()}


@pytest.mark.slow
def test_a_daemon_serves_every_declared_array(tmp_path, tokenizer_file):
    from loaderd_support import Daemon, build_corpus

    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file)
    with Daemon(root, cache=tmp_path / "cache") as d:
        c = d.client(0, 1)
        for mb in c:
            check_declared({k: mb[k] for k in batcharrays.NAMES})
            assert list(mb)[:len(batcharrays.NAMES)] == list(batcharrays.NAMES)
            if mb["step"] == 2:
                break
        c.close()
