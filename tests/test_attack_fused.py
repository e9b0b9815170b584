"""Attacks on the fast producer path (`fast.fast_steps`, taken first by `StepMaker.produce_steps`).

The producer's entries (micro-batch bytes, samples, state JSON, size, the
terminal error's code and message) made through `produce_steps` must be those
of the per-document reference plan (`Plan(reference=True)`), made one step at
a time with `produce_step`, for inputs the module's own property test
(tests/test_logical_fused.py) does not reach, all in one stream:

* calls of varying n (1 to 8), and a RESTORE from the JSON state of a random
  step of the last call (a client's checkpoint) between calls;
* several replicas (each its own lanes), micro-batches of 1 to all rows;
* token shards of uint16 and uint32 (also both in one source, as
  `write_shard` without a vocabulary picks per shard) with ids up to the
  dtype's (or MAX_TOKEN_ID's) top, and bos/eos ids at the vocabulary's top;
* objects not mapped at first and mapped mid-run (the calls switch between the
  fused and the per-lane path and must give one stream);
* a second source of weight 0, one that renormalizes out (listed before or
  after the live one), or a small live one; the live source's exhaustion
  `repeat`, `stop`, `fail` or `renormalize` (the terminal entry at the same
  step with the same message), `max_steps`, empty documents, objects of 0
  records;
* the fast path over lane subsets in any order.

Then on real pre-tokenized shards: a real `DocSource` (objects mapped as they
are first read, so the calls switch from one step to the fused path) under
the producer with RESTOREs, and (slow) a real daemon, whose clients must hold the reference plan's bytes, sample
IDs and data state after every step. A deliberately broken fused variant must
fail the same comparison (a loss-token count off by one in the fused states
also fails the real-shard and daemon tests: checked by hand).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from types import SimpleNamespace

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sluice.loaderd.logical.fast as fast_mod
import sluice.loaderd.logical.fused as fused_mod
import sluice.loaderd.physical.producer as producer_mod
from logical_helpers import StandIn, fast_kernel, make_manifest, make_spec, uncompiled_face
from sluice.errors import SluiceError
from sluice.loaderd.logical import Plan
from sluice.loaderd.physical.producer import StepMaker

FUSED = {"hit": 0, "cases": 0}


class Shards(StandIn):
    """DocTokens over synthetic token shards of `dtype` ("mixed": uint16 and uint32 objects alternate), with
    `DocSource`'s `mapped`, `count` and `prefetch`.

    Document lengths are 1..max_len (0..max_len with ``empty == -1``; every
    `empty`-th record empty for ``empty > 0``); ids are drawn from [0, top]
    with half the documents' ids within 7 of `top`. Objects in `unmapped`
    ((source, object) pairs) are not mapped until removed from the set.
    """

    def __init__(self, plan, max_len, dtype, top, empty, unmapped, seed):
        self.plan, self.max_len, self.dtype, self.top = plan, max_len, dtype, top
        self.empty, self.unmapped, self.seed, self.calls = empty, set(unmapped), seed, 0
        self.shards = {}

    def _shard(self, s, o):
        got = self.shards.get((s, o))
        if got is None:
            docs = []
            for rec in range(self.plan.manifest.sources[s].objects[o].records):
                h = blake3.blake3(f"{self.seed}:{s}:{o}:{rec}".encode()).digest(length=4 + 4 * self.max_len)
                n = 1 + int.from_bytes(h[:2], "little") % self.max_len
                if self.empty == -1:
                    n = h[0] % (self.max_len + 1)
                elif self.empty and rec % self.empty == self.empty - 1:
                    n = 0
                ids = np.frombuffer(h[4:4 + 4 * n], dtype="<u4").astype(np.int64)
                docs.append(((self.top - ids % 7) if h[2] % 2 else ids % (self.top + 1)))
            offsets = np.zeros(len(docs) + 1, dtype="<u8")
            offsets[1:] = np.cumsum([len(d) for d in docs])
            dtype = ("<u2", "<u4")[o % 2] if self.dtype == "mixed" else self.dtype  # mixed: as shards written
            got = self.shards[(s, o)] = (offsets, np.concatenate(docs).astype(dtype), len(docs))  # without a vocab
        return got

    def __call__(self, ref):
        self.calls += 1
        offsets, tokens, _ = self._shard(ref.source, ref.obj)
        return tokens[int(offsets[ref.record]):int(offsets[ref.record + 1])]

    def mapped(self, source, objs):
        if any((source, o) in self.unmapped for o in objs):
            return None
        return {o: self._shard(source, o) for o in set(objs)}

    def count(self, source, n):
        self.calls += n

    def prefetch(self, refs):
        pass


def entry_view(e):
    return (e.step, [{k: v.tobytes() for k, v in m.items()} for m in e.micros], e.samples, e.state_json, e.nbytes,
            e.error and e.error[:2])


def rows_view(rows):
    return [(lane, r.input_ids.tobytes(), r.labels.tobytes(), r.position_ids.tobytes(), r.seqlens, r.segments)
            for lane, rs in sorted(rows.items()) for r in rs]


@st.composite
def cases(draw):
    lanes = draw(st.sampled_from([1, 2, 3, 4, 6]))
    per_lane = draw(st.sampled_from([1, 1, 2, 3]))
    replicas = draw(st.sampled_from([r for r in range(1, lanes + 1) if lanes % r == 0]))
    rows = lanes * per_lane // replicas
    micro = draw(st.sampled_from([m for m in range(1, rows + 1) if rows % m == 0]))
    counts = draw(st.lists(st.integers(0, 30), min_size=1, max_size=3).filter(any))
    sources = [("a", counts, "1", draw(st.sampled_from(["repeat", "repeat", "stop", "fail", "renormalize"])))]
    other = draw(st.sampled_from([None, None, None, "weight0", "renormalizes", "renormalizes-first", "small"]))
    if other == "weight0":
        sources.append(("b", [3], "0", "fail"))
    elif other == "renormalizes":
        sources.append(("b", [lanes], "1", "renormalize"))
    elif other == "renormalizes-first":
        sources.insert(0, ("b", [lanes], "1", "renormalize"))
    elif other == "small":
        sources.append(("b", [2], "1", "repeat"))
    dtype = draw(st.sampled_from(["<u2", "<u4", "mixed"]))
    top = draw(st.sampled_from([996, 70000, 2**31 - 1] if dtype == "<u4" else [996, 65535]))
    return dict(
        lanes=lanes, per_lane=per_lane, replicas=replicas, micro=micro, sources=sources, dtype=dtype, top=top,
        separator=draw(st.sampled_from(["eos", "bos", "bos_eos", "none"])),
        loss_mask=draw(st.sampled_from(["all", "exclude_separator"])),
        seq_len=draw(st.sampled_from([2, 3, 4, 16, 37, 200])),
        policy=draw(st.sampled_from(["quota", "categorical"])),
        unit=draw(st.sampled_from(["documents", "tokens", "loss_tokens"])),
        order=draw(st.sampled_from(["global", "block", "none"])), window=draw(st.sampled_from([1, 2])),
        max_steps=draw(st.sampled_from([0, 0, 0, 3, 7])),
        eos=draw(st.sampled_from([0, top])), bos=draw(st.sampled_from([2, top - 1])),
        max_len=draw(st.sampled_from([1, 4, 40, 300])), empty=draw(st.sampled_from([0, 0, 3, -1])),
        unmapped=draw(st.sets(st.integers(0, 2), max_size=2)), seed=draw(st.integers(0, 2**32)),
        calls=draw(st.integers(0, 2**32)),
    )


def build(c):
    manifest = make_manifest(c["sources"], separator=c["separator"], loss_mask=c["loss_mask"], seq_len=c["seq_len"],
                             policy=c["policy"], unit=c["unit"])
    manifest = replace(manifest, tokenizer=replace(manifest.tokenizer, vocab_size=c["top"] + 1))
    manifest = replace(manifest, packing=replace(manifest.packing, eos_id=c["eos"], bos_id=c["bos"]))
    spec = make_spec(lanes=c["lanes"], global_batch=c["lanes"] * c["per_lane"], micro_batch=c["micro"],
                     order=c["order"], block_window=c["window"], max_steps=c["max_steps"], seed=c["seed"] % 997)
    return manifest, spec


def shards(plan, c, unmapped=True):
    a = [i for i, s in enumerate(c["sources"]) if s[0] == "a"][0]
    gone = {(a, o) for o in c["unmapped"] if o < len(c["sources"][a][1])} if unmapped else set()
    return Shards(plan, c["max_len"], c["dtype"], c["top"], c["empty"], gone, c["seed"])


def check_producer_stream(c, steps, kernel=None):
    """Every replica's `produce_steps` stream (random n, restores, objects mapped mid-run) equals the reference
    plan's `produce_step` stream. `kernel` (a loaded `jit.Kernel`): the producer's fast path runs in it (its
    entries cut from the kernel's blocks, `StepMaker._fused_entry`); else every step is `Plan.step`'s."""
    manifest, spec = build(c)
    reference, plan = Plan(manifest, spec, reference=True), Plan(manifest, spec)
    rng = random.Random(c["calls"])
    for r in range(c["replicas"]):
        single = StepMaker(reference, shards(reference, c, unmapped=False), replica=r, replicas=c["replicas"])
        want, state = [], reference.initial_state()
        while state is not None and len(want) < steps:
            e, state = single.produce_step(state)
            want.append(entry_view(e))
        docs = shards(plan, c)
        maker = StepMaker(plan, docs, replica=r, replicas=c["replicas"])
        if kernel is not None:
            maker.jit = SimpleNamespace(kernel=kernel)
        got, state = [], plan.initial_state()
        while len(got) < len(want) and (not got or got[-1][5] is None):
            if docs.unmapped and rng.random() < 0.2:
                docs.unmapped.pop()  # an object is mapped now
            made = maker.produce_steps(state, rng.choice([1, 2, 3, 4, 8]))
            got += [entry_view(e) for e, _ in made]
            state = made[-1][1]
            if made[-1][0].error is None and rng.random() < 0.3:  # a RESTORE to a checkpoint inside the call
                e, _ = rng.choice(made)
                state = plan.load_state(json.loads(e.state_json))
                got = got[:[g[0] for g in got].index(e.step) + 1]
        got = got[:len(want)]
        for g, w in zip(got, want):
            assert g == w, f"replica {r} step {w[0]}: " + ", ".join(
                name for name, a, b in zip(("step", "micros", "samples", "state", "nbytes", "error"), g, w) if a != b)
        assert len(got) == len(want)


def fast_or_one(plan, state, docs, lanes, n):
    """The fast path's steps as (rows per lane, state after), or one `Plan.step` where it stands aside."""
    got = fast_mod.fast_steps(plan, state, docs, lanes, n, fast_kernel())
    if isinstance(got, str):
        batch, after = plan.step(state, docs, lanes)
        return [(batch.step, batch.rows, after)]
    return [(after.step, got.rows(j), after) for j, after in enumerate(got.states)]


def check_plan_steps(c, calls):
    """The fast path over a lane subset in a random order equals `Plan.step` of the reference plan."""
    manifest, spec = build(c)
    reference, plan = Plan(manifest, spec, reference=True), Plan(manifest, spec)
    rng = random.Random(c["calls"] + 1)
    lanes = rng.sample(range(c["lanes"]), rng.randint(1, c["lanes"]))
    docs, ref_docs = shards(plan, c), shards(reference, c, unmapped=False)
    state = want_state = plan.initial_state()
    for _ in range(calls):
        if docs.unmapped and rng.random() < 0.3:
            docs.unmapped.pop()
        try:
            made = fast_or_one(plan, state, docs, lanes, rng.choice([2, 3, 4, 7]))
        except SluiceError as exc:
            with pytest.raises(type(exc)):
                reference.step(want_state, ref_docs, lanes)
            return
        for step, rows, after in made:
            want, want_state = reference.step(want_state, ref_docs, lanes)
            assert (step, rows_view(rows)) == (want.step, rows_view(want.rows))
            assert after == want_state and after.state_dict() == want_state.state_dict()
        state = made[-1][2]


@pytest.fixture
def count_fused(monkeypatch):
    real = fast_mod.fast_steps

    def counting(*args, **kw):
        got = real(*args, **kw)
        FUSED["hit"] += not isinstance(got, str)  # (a string: why it stood aside)
        return got

    monkeypatch.setattr(fast_mod, "fast_steps", counting)
    monkeypatch.setattr(producer_mod, "fast_steps", counting)


# Derandomized: the same 25 cases every run (the fast tier's time and the hit count below stay put); the slow
# variant explores.
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(c=cases())
def test_produce_steps_with_restores_and_late_mapping_equals_the_reference_plan(count_fused, c):
    FUSED["cases"] += 1
    check_producer_stream(c, steps=16)
    check_plan_steps(c, calls=3)


def test_the_attack_reaches_the_fused_path(count_fused):
    """The property above must run through the fused path, not only around it. Its 25 fixed cases ran just
    before, in this process, where the module's tests share a worker (`make test`: --dist loadfile); where
    they did not (deselected, or the module split between workers), they run here (about 1.4 s idle, 6 s
    on a loaded machine, which running them twice cost the fast tier)."""
    if FUSED["cases"] == 0:
        test_produce_steps_with_restores_and_late_mapping_equals_the_reference_plan(count_fused=None)
    assert FUSED["cases"] == 25 and FUSED["hit"] >= 25, FUSED


@pytest.mark.slow
# (the same 150 cases every run: drawn afresh, their cost went from 5 s to 234 s between runs of the slow tier,
# which must stay within 20 minutes; the fast tier's 25 cases above are fixed likewise)
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(c=cases())
def test_produce_steps_equals_the_reference_plan_long_streams(jit_kernel, c):
    """The same with longer streams, the producer's calls in the compiled kernel (numba's dispatchers): the
    entries a daemon serves, cut from the kernel's blocks, equal the reference's step for step."""
    before = jit_kernel.calls
    check_producer_stream(c, steps=40, kernel=jit_kernel)
    LONG["kernel_calls"] += jit_kernel.calls - before
    check_plan_steps(c, calls=8)


LONG = {"kernel_calls": 0}


@pytest.mark.slow
def test_the_long_streams_ran_the_compiled_kernel(jit_kernel):
    """Most of the long streams' calls ran in the kernel (the rest: `Plan.step` where the fast path stands
    aside, or an object not mapped yet)."""
    if LONG["kernel_calls"] == 0:
        test_produce_steps_equals_the_reference_plan_long_streams(jit_kernel=jit_kernel)
    assert LONG["kernel_calls"] >= 150, LONG


def test_a_broken_fused_variant_fails_the_attack(monkeypatch):
    """The comparison is sharp: a fused path whose loss tokens are off by one in one lane is caught."""
    real = fused_mod._lane_state

    def off_by_one(draws, rows, sources, packers):
        return real(draws, rows, (replace(sources[0], loss_tokens=sources[0].loss_tokens + 1), *sources[1:]),
                    packers)

    monkeypatch.setattr(fused_mod, "_lane_state", off_by_one)
    c = dict(lanes=2, per_lane=1, replicas=1, micro=1, sources=[("a", [40, 30], "1", "repeat")], dtype="<u2",
             top=65535, separator="eos", loss_mask="all", seq_len=16, policy="quota", unit="documents",
             order="block", window=2, max_steps=0, eos=0, bos=2, max_len=40, empty=0, unmapped=set(), seed=1,
             calls=3)
    with pytest.raises(AssertionError):
        check_plan_steps(c, calls=4)


@pytest.fixture(scope="module")
def sltok_corpus(tmp_path_factory, tokenizer_file):
    from loaderd_support import build_corpus

    return build_corpus(tmp_path_factory.mktemp("attack-fused"), "sltok", tokenizer_file, docs=90, objects=3,
                        seq_len=32)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_real_docsource_on_token_shards_serves_the_reference_plan_through_the_fused_path(
        sltok_corpus, tmp_path, count_fused, replicas):
    """A real `DocSource` over pre-tokenized shards (memory-mapped as each object is first read): the producer's
    calls of several steps (one step a call while an object is filling, then the fused path) with a RESTORE
    from a checkpoint every few calls give the reference plan's entries, and the fused path really ran."""
    from sluice.cache import NodeCache
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    manifest = load_manifest(sltok_corpus / "manifest.json")
    spec = load_runspec(sltok_corpus / "run.toml")
    reference, plan = Plan(manifest, spec, reference=True), Plan(manifest, spec)
    before = FUSED["hit"]
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        docs = DocSource(manifest, cache, None)
        try:
            for r in range(replicas):
                single = StepMaker(reference, docs, replica=r, replicas=replicas)
                want, state = [], reference.initial_state()
                for _ in range(60):
                    e, state = single.produce_step(state)
                    want.append(entry_view(e))
                maker, rng = StepMaker(plan, docs, replica=r, replicas=replicas), random.Random(r)
                maker.jit = uncompiled_face()  # (the kernels' source, uncompiled: the fast path without a compile)
                got, state = [], plan.initial_state()
                while len(got) < len(want):
                    made = maker.produce_steps(state, rng.choice([2, 3, 4]))
                    got += [entry_view(e) for e, _ in made]
                    state = made[-1][1]
                    if rng.random() < 0.25:
                        e, _ = rng.choice(made)
                        state = plan.load_state(json.loads(e.state_json))
                        got = got[:[g[0] for g in got].index(e.step) + 1]
                assert got[:len(want)] == want
        finally:
            docs.close()
    assert FUSED["hit"] - before >= 10


@pytest.mark.slow
def test_a_daemon_serves_the_reference_plans_bytes_samples_and_states(sltok_corpus, tmp_path):
    """A real daemon on pre-tokenized shards (the fused path once they are mapped), two replicas:
    every step's micro-batch digest, sample IDs and the data state the client holds after it are the reference
    plan's (tests/test_loaderd.py compares digests only), also after a RESTORE to a step inside a call."""
    from loaderd_support import Daemon, reference, stream_digests
    from sluice.cache import NodeCache
    from sluice.loaderd.physical.docsource import DocSource
    from sluice.manifest.model import load_manifest
    from sluice.runspec import load_runspec

    steps = 24
    ref = reference(sltok_corpus, steps, 2)
    plan = Plan(load_manifest(sltok_corpus / "manifest.json"), load_runspec(sltok_corpus / "run.toml"),
                reference=True)
    states = {}
    with NodeCache(tmp_path / "ref-cache", 1 << 30) as cache:
        source = DocSource(plan.manifest, cache, None)
        try:
            state = plan.initial_state()
            for _ in range(steps):
                _, state = plan.step(state, source)
                states[state.step] = state
        finally:
            source.close()
    with Daemon(sltok_corpus, replicas=2, cache=tmp_path / "cache") as d:
        for r in (0, 1):
            lanes = list(plan.lanes_of(2, r))
            c = d.client(r, 2, samples=True)
            for first in (0, 7):  # from the start, then after a RESTORE to the state after step 6
                batches = []
                for mb in c:
                    batches.append({k: (np.asarray(v).copy() if k not in ("step", "micro", "samples") else v)
                                    for k, v in mb.items()})
                    mps = c.info["micro_per_step"]
                    if mb["step"] == steps - 1 and mb["micro"] + 1 == mps:
                        break
                got = stream_digests(batches, mps)
                assert sorted(got) == list(range(first, steps))
                for step, digest in got.items():
                    want_digest, want_samples = ref[(step, r)]
                    assert digest == want_digest, f"replica {r} step {step}: bytes"
                    samples = [s for b in batches if b["step"] == step for s in b["samples"]]
                    assert list(dict.fromkeys(samples)) == want_samples, f"replica {r} step {step}: samples"
                    assert c.state_dict_at(step) == states[step].subset(lanes).state_dict(), \
                        f"replica {r} step {step}: state"
                c.load_state_dict(c.state_dict_at(6))
            c.close()
