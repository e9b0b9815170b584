"""Piece draws (`mixture.piece_tokens` = B): token-unit quota within B tokens of every share, at every prefix.

With a token unit, a draw takes at most B framed tokens: the next piece of the
source's open document, else its next document. The quota's largest-deficit
rule draws a source only while it is at or behind its target, so with p_s =
w_s / W, T the tokens drawn and c_s a source's tokens, at every prefix::

    c_s - p_s T  <=  B (1 - p_s)          (ahead: less than one piece)
    p_s T - c_s  <=  B (k - 2 + p_s)      (behind: the others' lead, deficits summing to 0)

(docs/logical.md). Without piece draws the same holds with B = the longest
document, which is what the issue's example broke (0.30/0.68/0.02 against
0.6/0.3/0.1 after 30 steps).
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support import examples

from logical_helpers import fake_docs, fast_kernel, make_manifest, make_spec
from sluice.datastate import CUR_LOSS_TOKENS, CUR_TOKENS, DataState, check_bounds
from sluice.errors import ExhaustedError, ManifestError, SpecError, StateError
from sluice.loaderd.gate import bounds_of
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.lanemachine import LaneMachine
from sluice.manifest.model import Manifest
from sluice.manifest.policies import MixturePolicy
from sluice.manifest.spec import load_dataset_spec

SEQ_LEN = 16


def bound_violations(counts: list[int], weights: list[int], b: int) -> list[str]:
    """Sources outside the documented bound for pieces of at most `b` units (empty: all within)."""
    W, T, k = sum(weights), sum(counts), len(weights)
    out = []
    for s, (c, w) in enumerate(zip(counts, weights)):
        p = Fraction(w, W)
        ahead = c - p * T
        if ahead > b * (1 - p) or -ahead > b * (k - 2 + p):
            out.append(f"source {s}: {c} of {T} tokens, target {float(p * T):.1f}, bound B={b}")
    return out


def lengths_docs(lengths: list[list[int]]):
    """DocTokens: document i of source s has lengths[s][i] token ids (values irrelevant to the mixture)."""

    def docs(ref) -> np.ndarray:
        n = lengths[ref.source][ref.index]
        return (np.arange(n, dtype=np.uint32) % 997) + 3

    return docs


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.lists(st.integers(0, 100 * SEQ_LEN), min_size=1, max_size=4), min_size=1, max_size=5),
    weights=st.lists(st.integers(1, 20), min_size=5, max_size=5),
    pieces=st.sampled_from([None, 1, 7, SEQ_LEN, 3 * SEQ_LEN]),
    unit=st.sampled_from(["tokens", "loss_tokens"]),
    separator=st.sampled_from(["eos", "bos_eos", "none"]),
    draws=st.integers(1, 150),
)
# empty documents, no separator: the lane ends with ExhaustedError instead of drawing forever
@example(lengths=[[0]], weights=[1] * 5, pieces=None, unit="tokens", separator="none", draws=3)
@example(lengths=[[5, 9], [0, 0]], weights=[1] * 5, pieces=None, unit="tokens", separator="none", draws=40)
def test_quota_tokens_within_the_bound_at_every_prefix_of_draws(lengths, weights, pieces, unit, separator, draws):
    k = len(lengths)
    weights = weights[:k]
    sources = [(f"s{i}", [len(ls)], str(w), "repeat") for i, (ls, w) in enumerate(zip(lengths, weights))]
    manifest = make_manifest(sources, seq_len=SEQ_LEN, unit=unit, piece_tokens=pieces, separator=separator)
    plan = Plan(manifest, make_spec(lanes=1, global_batch=1, micro_batch=1), reference=True)
    frame = {"eos": 1, "bos_eos": 2, "none": 0}[separator]
    b = pieces if pieces is not None else max(n for ls in lengths for n in ls) + frame  # whole documents
    machine = LaneMachine(plan, 0, plan.initial_state().lanes[0], lengths_docs(lengths), {})
    col = CUR_TOKENS if unit == "tokens" else CUR_LOSS_TOKENS
    for d in range(draws):  # the lane's draws as its packer pulls them, the state checked after each
        try:
            got = machine._pull_mixed()
        except ExhaustedError:
            # A repeat source ends only when a whole epoch of it weighs nothing: every document
            # empty and no separator (docs/logical.md); the bound held at every prefix before.
            assert separator == "none" and any(not any(ls) for ls in lengths), f"draw {d}"
            break
        assert got is not None and got[4] - got[3] <= b
        counts = [c[col] for c in machine.cursors]
        assert not bound_violations(counts, weights, b), f"after draw {d}"
        machine.cache.clear()  # framed documents are per step; keep memory flat over many draws


# The issue's example: a 98k-token document against seq_len 256, weights 0.6/0.3/0.1.
ISSUE_SOURCES = [("web", [400], "0.6", "repeat"), ("books", [3], "0.3", "repeat"), ("code", [400], "0.1", "repeat")]
ISSUE_LENGTHS = [[300] * 400, [98_000] * 3, [120] * 400]


def test_issue_example_shares_after_30_steps_within_one_piece():
    def counts_after_30(pieces):
        manifest = make_manifest(ISSUE_SOURCES, seq_len=256, unit="tokens", piece_tokens=pieces)
        plan = Plan(manifest, make_spec(lanes=1, global_batch=8, micro_batch=8))
        state, docs = plan.initial_state(), lengths_docs(ISSUE_LENGTHS)
        for _ in range(30):
            _, state = plan.step(state, docs)
        return [c.tokens for c in state.lanes[0].sources]

    weights = [6, 3, 1]
    with_pieces = counts_after_30(256)
    assert not bound_violations(with_pieces, weights, 256)
    total = sum(with_pieces)
    shares = [c / total for c in with_pieces]
    assert all(abs(s - w / 10) < 256 * 1.6 / total for s, w in zip(shares, weights)), shares
    # whole documents: one 98k-token draw throws the shares far outside the same bound
    whole = counts_after_30(None)
    assert bound_violations(whole, weights, 256)
    assert whole[1] / sum(whole) > 0.6  # "books" (weight 0.3) holds most of the tokens, as the issue saw


class LengthShards:
    """`lengths_docs` as mapped token shards (one per object, as `DocSource.mapped` gives), so the fused path
    (`fast.fast_steps` -> `fusedmix`) takes the steps."""

    def __init__(self, plan, lengths: list[list[int]]) -> None:
        self.plan, self.lengths, self.calls = plan, lengths, 0
        self.docs = lengths_docs(lengths)

    def __call__(self, ref) -> np.ndarray:
        self.calls += 1
        return self.docs(ref)

    def mapped(self, source: int, objs: list[int]):
        out = {}
        for o in set(objs):
            obj = self.plan.manifest.sources[source].objects[o]
            ls = self.lengths[source][obj.start:obj.start + obj.records]
            offsets = np.zeros(len(ls) + 1, dtype="<u8")
            offsets[1:] = np.cumsum(ls)
            tokens = np.concatenate([self.docs_of(source, obj.start + r) for r in range(obj.records)])
            out[o] = (offsets, tokens, obj.records)
        return out

    def docs_of(self, source: int, index: int) -> np.ndarray:
        return (np.arange(self.lengths[source][index], dtype=np.uint32) % 997) + 3

    def count(self, source: int, n: int) -> None:
        self.calls += n


def test_issue_example_through_the_fused_path_equals_plan_step_and_keeps_the_bound():
    """The issue's mixture (a 98k-token document among short ones) with pieces of 256, 4 steps a call on the
    fused path: every step `Plan.step`'s (rows, block, state), and the shares within the bound after 32 steps."""
    from test_logical_fused import compare

    from sluice.loaderd.logical.fast import fast_steps

    manifest = make_manifest(ISSUE_SOURCES, seq_len=256, unit="tokens", piece_tokens=256)
    plan = Plan(manifest, make_spec(lanes=2, global_batch=8, micro_batch=8))
    docs = LengthShards(plan, ISSUE_LENGTHS)
    state = plan.initial_state()
    for _ in range(8):
        assert compare(plan, state, docs, [0, 1], 4, calls=1) == 1
        state = fast_steps(plan, state, docs, [0, 1], 4, fast_kernel()).states[-1]
    assert state.step == 31
    for lane in state.lanes.values():
        assert not bound_violations([c.tokens for c in lane.sources], [6, 3, 1], 256)
        assert lane.sources[1].open  # the long document is open: drawn piece by piece


def test_lanes_realized_tokens_of_a_source_stay_close_at_every_step():
    # Every lane serves the same tokens per step and draws less than one piece beyond them, so with the
    # per-lane bound two lanes' tokens of source s differ by less than B (k - 1 + p_s): the most by which
    # one lane's epoch of a source can run ahead of another's, in tokens (docs/logical.md, "Epochs").
    b, weights = 12, [5, 3, 2]
    lengths = [[7, 300, 40, 2, 95] * 8, [1, 60, 13] * 10, [90, 3] * 4]
    sources = [(f"s{i}", [len(ls)], str(w), "repeat") for i, (ls, w) in enumerate(zip(lengths, weights))]
    plan = Plan(make_manifest(sources, seq_len=SEQ_LEN, unit="tokens", piece_tokens=b), make_spec(lanes=4, global_batch=8))
    state, docs = plan.initial_state(), lengths_docs(lengths)
    for _ in range(60):
        _, state = plan.step(state, docs)
        for s, w in enumerate(weights):
            c = [lane.sources[s].tokens for lane in state.lanes.values()]
            assert max(c) - min(c) < b * (len(weights) - 1 + Fraction(w, sum(weights))), (state.step, s, c)
    assert max(lane.sources[2].epoch for lane in state.lanes.values()) >= 2, "the run must cross epochs"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=st.lists(st.integers(1, 9), min_size=1, max_size=4), replicas=st.sampled_from([1, 2, 4]),
       pieces=st.sampled_from([1, 5, 16]))
def test_exported_quota_debt_in_tokens_stays_within_the_exported_bound(weights, replicas, pieces):
    """The SluiceQuotaDebtBeyondBound alert's premise for token units: with piece draws the daemon exports
    a finite bound (lanes x B x max(k-1, 1)) and the debt it exports stays within it; whole documents: +Inf."""
    from sluice.loaderd.metrics import Metrics

    sources = [(f"s{i}", [40, 9], str(w), "repeat") for i, w in enumerate(weights)]
    manifest = make_manifest(sources, unit="tokens", piece_tokens=pieces)
    plan = Plan(manifest, make_spec())
    names, floats = [s[0] for s in sources], [float(w) for w in weights]
    metrics = Metrics("r1", manifest.dataset_id, names, floats, unit="tokens", piece_tokens=pieces)
    whole = Metrics("r1", manifest.dataset_id, names, floats, unit="tokens")
    docs, state = fake_docs(150), plan.initial_state()
    per = plan.spec.lanes // replicas
    for _ in range(8):
        _, state = plan.step(state, docs)
        for r in range(replicas):
            served = state.subset(range(r * per, (r + 1) * per)).state_dict()
            metrics.observe_state(r, served)
            whole.observe_state(r, served)
            labels = {"run_id": "r1", "dataset_id": manifest.dataset_id, "replica": str(r)}
            bound = metrics.registry.get_sample_value("sluice_quota_debt_bound_units", labels)
            assert bound == per * pieces * max(len(weights) - 1, 1)
            assert whole.registry.get_sample_value("sluice_quota_debt_bound_units", labels) == float("inf")
            debts = [metrics.registry.get_sample_value("sluice_source_quota_debt_units", {**labels, "source": n})
                     for n in names]
            assert all(abs(d) < bound for d in debts), (debts, bound)


def framed_pieces_cover_documents(algorithm: str, pieces: int) -> None:
    """Every piece served is its document's framed tokens at its range; pieces are disjoint, and the
    pieces of a document served whole concatenate to its framed tokens."""
    seen: dict[str, np.ndarray] = {}
    base = fake_docs(150)

    def docs(ref):
        ids = base(ref)
        seen[ref.sample_id] = ids
        return ids

    manifest = make_manifest([("a", [200], "0.7", "stop"), ("b", [200], "0.3", "stop")], algorithm=algorithm,
                             unit="tokens", piece_tokens=pieces, separator="bos_eos")
    plan = Plan(manifest, make_spec(lanes=2, global_batch=4, micro_batch=2))
    state = plan.initial_state()
    got: dict[str, list[tuple[int, np.ndarray]]] = {}
    for _ in range(40):
        batch, state = plan.step(state, docs)
        for rows in batch.rows.values():
            for row in rows:
                at = 0
                for (sid, a, b), n in zip(row.segments, row.seqlens):
                    assert b - a == n and b - a <= pieces
                    got.setdefault(sid, []).append((a, row.input_ids[at : at + n].copy()))
                    at += n
    whole = 0
    for sid, parts in got.items():
        parts.sort(key=lambda p: p[0])
        framed = plan.framing.frame(seen[sid])
        at = 0
        for a, tokens in parts:  # disjoint, each the framed tokens of its range
            assert a >= at and np.array_equal(tokens, framed[a : a + len(tokens)])
            at = a + len(tokens)
        # served whole (best-fit may still hold some pieces in open bins when the steps end)
        whole += sum(len(t) for _, t in parts) == len(framed)
    assert whole > 20


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_a_documents_pieces_concatenate_to_its_framed_tokens(algorithm):
    framed_pieces_cover_documents(algorithm, 11)


# -- the manifest field ----------------------------------------------------------------------------


def test_piece_tokens_reaches_the_canonical_bytes_and_absent_keeps_them():
    srcs = [("a", [5], "1", "repeat")]
    whole, b256, b128 = (make_manifest(srcs, unit="tokens", piece_tokens=b) for b in (None, 256, 128))
    assert b"piece_tokens" not in whole.canonical_bytes()  # older manifests keep their bytes and dataset IDs
    assert len({whole.dataset_id, b256.dataset_id, b128.dataset_id}) == 3
    assert Manifest.from_bytes(b256.canonical_bytes()) == b256


@pytest.mark.parametrize("bad, words", [
    (0, "must be an integer in [1, "), (-3, "got -3"), (True, "got True"), ("256", "got '256'"),
    (1 << 60, "must be an integer in [1, "),
])
def test_bad_piece_tokens_is_refused_naming_field_and_value(bad, words):
    with pytest.raises(ManifestError, match=r"mixture\.piece_tokens") as exc:
        MixturePolicy(policy="quota", unit="tokens", piece_tokens=bad)
    assert words in str(exc.value)


@pytest.mark.parametrize("unit", ["documents", "sequences"])
def test_piece_tokens_needs_a_token_unit(unit):
    with pytest.raises(ManifestError, match=f"mixture.piece_tokens: 64 needs a token unit.*'{unit}'"):
        MixturePolicy(policy="quota", unit=unit, piece_tokens=64)


def test_manifest_reader_refuses_null_and_names_the_place():
    obj = json.loads(make_manifest([("a", [5], "1", "repeat")], unit="tokens", piece_tokens=8).canonical_bytes())
    obj["mixture"]["piece_tokens"] = None
    with pytest.raises(ManifestError, match=r"manifest\.mixture\.piece_tokens: null"):
        Manifest.from_obj(obj)
    obj["mixture"]["piece_tokens"] = 0
    with pytest.raises(ManifestError, match=r"manifest: mixture\.piece_tokens: must be an integer in \[1, .*got 0"):
        Manifest.from_obj(obj)


def _spec(tmp_path, mixture: str):
    (tmp_path / "d.toml").write_text(
        f'name = "x"\n[packing]\nseq_len = 128\neos_id = 0\npad_id = 1\n[mixture]\n{mixture}\n'
        '[[sources]]\nname = "a"\npaths = ["a/*.jsonl"]\nformat = "jsonl"\nweight = "1"\nexhaustion = "repeat"\n')
    return load_dataset_spec(tmp_path / "d.toml")


def test_dataset_spec_defaults_token_units_to_pieces_of_seq_len(tmp_path):
    assert _spec(tmp_path, 'unit = "tokens"').mixture.piece_tokens == 128
    assert _spec(tmp_path, 'unit = "loss_tokens"\npiece_tokens = 40').mixture.piece_tokens == 40
    assert _spec(tmp_path, 'unit = "tokens"\npiece_tokens = 0').mixture.piece_tokens is None  # whole documents
    assert _spec(tmp_path, 'unit = "documents"').mixture.piece_tokens is None
    with pytest.raises(SpecError, match=r"d\.toml: mixture\.piece_tokens: 8 needs a token unit"):
        _spec(tmp_path, 'unit = "documents"\npiece_tokens = 8')


# -- the data state --------------------------------------------------------------------------------


def _run(plan, state, docs, steps):
    digests = []
    for _ in range(steps):
        batch, state = plan.step(state, docs)
        digests.append([(r.input_ids.tobytes(), r.labels.tobytes(), r.segments) for rs in batch.rows.values() for r in rs])
    return digests, state


def test_schema_1_states_load_as_no_open_document_and_resume_the_same_stream():
    manifest = make_manifest([("a", [30], "0.7", "repeat"), ("b", [30], "0.3", "repeat")], unit="tokens")
    plan, docs = Plan(manifest, make_spec(lanes=2, global_batch=4)), fake_docs()
    _, state = _run(plan, plan.initial_state(), docs, 5)
    want, _ = _run(plan, state, docs, 5)
    old = state.state_dict()
    old["schema"] = 1
    for lane in old["lanes"].values():
        lane["sources"] = [c[:7] for c in lane["sources"]]  # schema 1 cursors: no `open` column
    loaded = plan.load_state(json.loads(json.dumps(old)))
    assert loaded.lanes == state.lanes
    assert _run(plan, loaded, docs, 5)[0] == want
    old["lanes"]["0"]["sources"][0].append(0)  # 8 columns under schema 1
    with pytest.raises(StateError, match=r"lanes\[0\]\.sources\[0\]: source cursor .* is not 7 integers"):
        plan.load_state(old)
    with pytest.raises(StateError, match="schema 3, this sluice reads schemas 1, 2"):
        plan.load_state({**old, "schema": 3})


def _with_open(state: DataState, s: int, open_: int, taken: int | None = None) -> dict:
    d = state.state_dict()
    c = d["lanes"]["0"]["sources"][s]
    c[7] = open_
    if taken is not None:
        c[1] = taken
    return d


def test_open_documents_are_bounded_at_restore():
    srcs = [("a", [30], "0.7", "repeat"), ("b", [30], "0.3", "repeat")]
    whole = Plan(make_manifest(srcs, unit="tokens"), make_spec(lanes=2, global_batch=4))
    with pytest.raises(StateError, match=r"sources\[1\]\.open: 5, but this manifest draws whole documents"):
        check_bounds(whole.load_state(_with_open(whole.initial_state(), 1, 5, taken=1)), bounds_of(whole))
    plan = Plan(make_manifest(srcs, unit="tokens", piece_tokens=4), make_spec(lanes=2, global_batch=4))
    st0 = plan.initial_state()
    with pytest.raises(StateError, match=r"sources\[0\]\.open: 5, but no document of epoch 0 was taken"):
        check_bounds(plan.load_state(_with_open(st0, 0, 5)), bounds_of(plan))
    with pytest.raises(StateError, match=r"sources\[0\]\.open: offset 1000000 is not below"):
        check_bounds(plan.load_state(_with_open(st0, 0, 10**6, taken=1)), bounds_of(plan))
    inactive = _with_open(st0, 0, 4, taken=1)
    inactive["lanes"]["0"]["sources"][0][2] = 0
    with pytest.raises(StateError, match=r"sources\[0\]\.open: 4, but the source is inactive"):
        check_bounds(plan.load_state(inactive), bounds_of(plan))
    for off in (1, 3, 6):  # pieces start at multiples of piece_tokens = 4
        with pytest.raises(StateError, match=rf"sources\[0\]\.open: offset {off} is not a piece boundary: a "
                                             r"document's pieces start at multiples of mixture.piece_tokens = 4"):
            check_bounds(plan.load_state(_with_open(st0, 0, off, taken=1)), bounds_of(plan))
    ok = plan.load_state(_with_open(st0, 0, 4, taken=1))
    check_bounds(ok, bounds_of(plan))
    # within the bound but past the real document (fake_docs: at most 41 framed tokens): refused at the draw
    far = plan.load_state(_with_open(st0, 0, 5000, taken=1))
    with pytest.raises(StateError, match=r"lane 0: source 'a': the open document \(sample index \d+\) has \d+ "
                                         r"framed tokens, but the data state continues it at offset 5000"):
        plan.step(far, fake_docs())


@pytest.mark.parametrize("algorithm", ["concat", "bestfit"])
def test_every_produced_state_passes_the_piece_checks_and_a_crossing_piece_does_not(algorithm):
    """Every state a plan with piece draws produces passes `check_bounds` (open offsets at multiples of
    piece_tokens, every residual or bin piece inside one piece); a piece moved across a boundary is refused."""
    srcs = [("a", [30], "0.7", "repeat"), ("b", [30], "0.3", "repeat")]
    plan = Plan(make_manifest(srcs, unit="tokens", piece_tokens=5, algorithm=algorithm),
                make_spec(lanes=2, global_batch=4))
    state, docs, bounds = plan.initial_state(), fake_docs(), bounds_of(plan)
    crossed = None
    for _ in range(40):
        _, state = plan.step(state, docs)
        check_bounds(state, bounds)
        d = json.loads(json.dumps(state.state_dict()))  # (a copy: the packer states are the live state's)
        for lane in d["lanes"].values():
            for pst in lane["packers"].values():
                pieces = [pst["cur"]] if pst.get("cur") else [p for b in pst.get("open", []) for p in b]
                for piece in pieces:
                    if crossed is None:
                        piece[4] = (piece[3] // 5 + 1) * 5 + 1  # one token past the piece's end
                        crossed = d
    assert crossed is not None, "the run must leave a piece to move"
    with pytest.raises(StateError, match=r"crosses a piece boundary \(a multiple of mixture.piece_tokens = 5\)"):
        check_bounds(plan.load_state(crossed), bounds)


def test_upcoming_lists_the_open_document_first():
    plan = Plan(make_manifest([("a", [30], "1", "repeat")], unit="tokens", piece_tokens=3),
                make_spec(lanes=1, global_batch=1, micro_batch=1))
    _, state = _run(plan, plan.initial_state(), fake_docs(), 1)
    c = state.lanes[0].sources[0]
    assert c.open, "the fixture must leave a document open"
    nxt = plan.upcoming(state, 0, 2)
    assert nxt[1].index == plan.lane_sample(0, c.epoch, 0, c.taken - 1)


# -- the daemon serves the same stream as `sluice plan` -----------------------------------------------


TWO_SOURCES = ('[[sources]]\nname = "a"\npaths = ["shards/c-0.jsonl.zst"]\nformat = "jsonl"\n'
               'weight = "0.7"\nexhaustion = "repeat"\n'
               '[[sources]]\nname = "b"\npaths = ["shards/c-1.jsonl.zst", "shards/c-2.jsonl.zst"]\n'
               'format = "jsonl"\nweight = "0.3"\nexhaustion = "repeat"\n')


def _piece_corpus(tmp_path, tokenizer_file, sluice_cli, sources: str):
    """A real jsonl.zst corpus (3 objects, 120 documents) frozen by tokens in pieces of 16 with `sources`
    (the [[sources]] tables); its root."""
    from loaderd_support import build_corpus

    root = build_corpus(tmp_path / "c", "jsonl.zst", tokenizer_file, docs=120)
    (root / "dataset.toml").write_text(
        'name = "pieces"\ntokenizer = "tokenizer.json"\n'
        '[packing]\nseq_len = 64\nalgorithm = "concat"\neos = "<|endoftext|>"\npad = "<|pad|>"\n'
        '[mixture]\npolicy = "quota"\nunit = "tokens"\npiece_tokens = 16\n' + sources)
    frozen = sluice_cli("manifest", "freeze", root / "dataset.toml", "-o", root / "manifest.json", "--no-progress")
    assert frozen.returncode == 0, frozen.stderr
    return root


def _take(client, steps):
    """The micro-batches of the client's next `steps` whole steps."""
    out, target = [], None
    for mb in client:
        out.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v) for k, v in mb.items()})
        target = mb["step"] + steps - 1 if target is None else target
        if mb["step"] == target and mb["micro"] + 1 == client.info["micro_per_step"]:
            return out
    raise AssertionError("the stream ended early")


@pytest.mark.slow
def test_daemon_stream_equals_sluice_plan_with_piece_draws(tmp_path, tokenizer_file, sluice_cli):
    """Real corpus and tokenizer, two sources by tokens in pieces of 16 (documents are hundreds of tokens):
    a `loaderd` process serves two replicas exactly what `sluice plan` prints, also after a client
    restores a state taken while documents were open."""
    from loaderd_support import Daemon, reference, stream_digests

    root = _piece_corpus(tmp_path, tokenizer_file, sluice_cli, TWO_SOURCES)
    assert json.loads((root / "manifest.json").read_text())["mixture"]["piece_tokens"] == 16
    planned = sluice_cli("plan", root / "manifest.json", root / "run.toml", "--steps", "0:10", "--replicas", "2",
                         "--json", "--no-progress", "--cache", tmp_path / "plan-cache")
    assert planned.returncode == 0, planned.stderr
    want = {(x["step"], x["replica"]): x["digest"] for x in map(json.loads, planned.stdout.splitlines())}
    assert len(want) == 20
    assert want == {key: digest for key, (digest, _) in reference(root, 10, 2).items()}  # the per-document oracle

    with Daemon(root, replicas=2, cache=tmp_path / "cache") as d:
        for r in (0, 1):
            c = d.client(r, 2)
            first = _take(c, 6)
            mps = c.info["micro_per_step"]
            got = stream_digests(first, mps)
            assert got == {s: want[(s, r)] for s in range(6)}
            saved = c.state_dict_at(3)
            assert saved["schema"] == 2 and any(c[7] for lane in saved["lanes"].values() for c in lane["sources"])
            c.load_state_dict(saved)  # back to after step 3: documents open there resume mid-document
            again = stream_digests(_take(c, 6), mps)
            assert again == {s: want[(s, r)] for s in range(4, 10)}
            c.close()


@pytest.mark.slow
def test_the_producer_on_the_daemons_data_path_walks_piece_draws_in_the_kernel(tmp_path, tokenizer_file, sluice_cli,
                                                                              jit_kernel):
    """The daemon's own data path (node cache, mapped token shards) and producer with the compiled kernel: a
    two-source mixture in pieces of 16 is walked and assembled in the kernel, and every step is the
    per-document reference plan's."""
    pytest.importorskip("numba")
    from loaderd_support import reference

    from sluice.loaderd.logical.batch import arrays_digest
    from sluice.loaderd.physical.assemble import DataPathConfig, open_data_path
    from sluice.loaderd.physical.jitload import load
    from sluice.loaderd.physical.producer import StepMaker
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    root = _piece_corpus(tmp_path, tokenizer_file, sluice_cli, TWO_SOURCES)
    kernel = load(None)  # loaded in this process already by conftest's jit_kernel (its cache: NUMBA_CACHE_DIR)
    walks = kernel.walk.calls
    config = DataPathConfig(cache_dir=str(tmp_path / "cache"), cache_budget=1 << 30)
    entries = []
    with open_data_path(load_manifest(root / "manifest.json"), load_runspec(root / "run.toml"), config) as data:
        maker = StepMaker(data.plan(), data.docs, replica=0, replicas=1)
        maker.jit.kernel = kernel  # as the loader sets it
        state = maker.plan.initial_state()
        while len(entries) < 40:
            made = maker.produce_steps(state, 4)
            entries += [e for e, _ in made]
            state = made[-1][1]
            data.docs.wait_filled(30)  # (the first steps start the fills; the later ones read mapped shards)
    want = reference(root, 40, 1)
    for e in entries[:40]:
        got = arrays_digest([{k: m[k] for k in ("input_ids", "labels", "position_ids", "cu_seqlens")}
                             for m in e.micros])
        assert got == want[(e.step, 0)][0], f"step {e.step} differs from the reference plan"
    assert kernel.walk.calls - walks >= 5


@pytest.mark.slow
def test_restore_refuses_impossible_piece_positions(tmp_path, tokenizer_file, sluice_cli):
    """Issue 27 item 5: an open offset of 1 or 255 (not a piece boundary) or 2**20 (past its document) in a
    RESTORE is refused BAD_STATE naming lane, field, value and rule, and the daemon keeps serving the
    previous state; a valid RESTORE still serves what `sluice plan` prints. On main all three were accepted:
    1 and 255 served batches no plan makes, 2**20 failed every request of the replica."""
    from loaderd_support import Daemon, stream_digests

    root = _piece_corpus(tmp_path, tokenizer_file, sluice_cli,
                         '[[sources]]\nname = "a"\npaths = ["shards/c-*.jsonl.zst"]\nformat = "jsonl"\nweight = "1"\n'
                         'exhaustion = "repeat"\n')
    cache = tmp_path / "cache"  # every object's tokens in the node cache: the document lengths are known
    warmed = sluice_cli("cache", "warm", root / "manifest.json", cache, "--budget", "1GiB", "--tokens",
                        "--no-progress")
    assert warmed.returncode == 0, warmed.stderr
    planned = sluice_cli("plan", root / "manifest.json", root / "run.toml", "--steps", "0:12", "--json",
                         "--no-progress", "--cache", tmp_path / "plan-cache")
    assert planned.returncode == 0, planned.stderr
    want = {x["step"]: x["digest"] for x in map(json.loads, planned.stdout.splitlines())}

    def take(client, steps):
        return stream_digests(_take(client, steps), client.info["micro_per_step"])

    with Daemon(root, cache=cache) as d:
        c = d.client(0, 1, credits=2)
        assert take(c, 4) == {s: want[s] for s in range(4)}
        saved = c.state_dict_at(3)
        lane, s = next((lane, s) for lane, ls in saved["lanes"].items()
                       for s, cur in enumerate(ls["sources"]) if cur[7])  # a document open after step 3
        for bad, rule in ((1, "is not a piece boundary: a document's pieces start at multiples of "
                              "mixture.piece_tokens = 16"),
                          (255, "is not a piece boundary"),
                          (2**20, r"of the open document \(sample index \d+\): the document has \d+ framed tokens")):
            forged = json.loads(json.dumps(saved))
            forged["lanes"][lane]["sources"][s][7] = bad
            other = d.client(0, 1)
            with pytest.raises(StateError, match=rf"data state\.lanes\[{lane}\]\.sources\[{s}\]\.open: offset "
                                                 rf"{bad} {rule}"):
                other.load_state_dict(forged)
            other.close()
        assert take(c, 4) == {s: want[s] for s in range(4, 8)}  # the previous state is served on
        c.load_state_dict(saved)  # a valid restore: resumes mid-document
        assert take(c, 8) == {s: want[s] for s in range(4, 12)}
        c.close()
