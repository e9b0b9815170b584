"""The producer's announcement costs nearly nothing once every object it names is mapped, and still starts
every object before a step needs it (docs/tokenize.md, "Out of order").

Specifications:
* `DocSource.prefetch` returns True (settled) exactly when every object it was
  told about is done (its tokens mapped) and the calling thread had nothing to
  drop (no earlier announced records, no RESTORE's sweep pending); an object
  not started yet is started, and the call returns False.
* A producer whose last announcement was settled asks again only when its
  position nears the end of that announcement (`SETTLED_HORIZON` times the
  usual look-ahead, taken only if all of it is done): over a run through six
  objects whose tokens are in the node cache (block order, so the lanes move
  from object to object), it asks for at most a quarter of its calls once
  every object is mapped, and no step ever needs an object that an
  announcement did not start first (no miss in the callback).
* While some object is filling (another replica's, or one a RESTORE left
  behind), the producer asks at its next call, and after a RESTORE that call
  announces its window and runs the sweep, as before.
* `only_if_settled=True` starts nothing: a window naming an object not done
  changes nothing and returns False.
"""

from __future__ import annotations

import threading

import pytest

from loaderd_support import build_corpus
from sluice.cache import NodeCache
from sluice.loaderd.logical import Plan
from sluice.loaderd.logical.upcoming import upcoming_columns
from sluice.loaderd.physical.docsource import DocSource
from sluice.loaderd.physical.producer import StepMaker
from sluice.manifest.model import load_manifest
from sluice.runspec import load_runspec
from sluice.tokenize import encoder_for_manifest
from test_out_of_order import HeldEncoder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_file):
    root = build_corpus(tmp_path_factory.mktemp("settled"), "jsonl.zst", tokenizer_file, docs=600, objects=6)
    (root / "run.toml").write_text('run_id = "t"\nseed = 7\nlanes = 4\nglobal_batch = 8\nmicro_batch = 2\n'
                                   'order = "block"\nblock_window = 1\n')
    return root


class Ref:
    def __init__(self, obj: int, record: int) -> None:
        self.source, self.obj, self.record = 0, obj, record


class Counted(DocSource):
    """The real DocSource, counting the announcements it is given."""

    announcements = 0

    def prefetch(self, refs, **kw):
        self.announcements += 1
        return super().prefetch(refs, **kw)


def _warm(manifest, cache, encoder, objects=None) -> None:
    """The objects' tokens (default: every object's) into the node cache (as `sluice cache warm --tokens`)."""
    docs = DocSource(manifest, cache, encoder)
    try:
        docs.prefetch([Ref(o, 0) for o in (range(len(manifest.sources[0].objects)) if objects is None else objects)])
        assert docs.wait_filled(60), "the token objects were not made within 60 s"
    finally:
        docs.close()


def test_prefetch_is_settled_only_when_every_object_is_done(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    enc = encoder_for_manifest(manifest)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        _warm(manifest, cache, enc)
        docs = DocSource(manifest, cache, enc)
        try:
            assert docs.prefetch([Ref(0, 3), Ref(1, 0), Ref(0, 1)]) is False  # objects 0 and 1 start now
            assert docs.wait_filled(30)
            assert docs.prefetch([Ref(0, 3), Ref(1, 0), Ref(0, 1)]) is True  # both mapped: nothing to do
            assert docs.prefetch([Ref(1, 2), Ref(2, 0)], only_if_settled=True) is False
            assert (0, 2) not in docs._lru  # nothing started
            assert docs.prefetch([Ref(1, 2), Ref(2, 0)]) is False  # object 2 is started
            assert docs.wait_filled(30)
            docs.restored(threading.get_ident())
            assert docs.prefetch([Ref(2, 1)]) is False  # the RESTORE's sweep runs at this announcement
            assert docs.prefetch([Ref(2, 1)]) is True
            assert docs.misses == 0
        finally:
            docs.close()


def test_a_settled_producer_announces_seldom_and_never_lets_a_step_miss_an_object(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))
    enc = encoder_for_manifest(manifest)
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        _warm(manifest, cache, enc)
        docs = Counted(manifest, cache, enc)
        try:
            maker = StepMaker(plan, docs, replica=0, replicas=1)
            state, objects = plan.initial_state(), set()

            def run(steps: int) -> int:
                nonlocal state
                calls, until = 0, state.step + steps
                while state.step < until:
                    made = maker.produce_steps(state, 4)
                    assert made[-1][0].error is None, made[-1][0].error
                    state, calls = made[-1][1], calls + 1
                    objects.update(docs._lru)
                return calls

            run(250)  # through every object once: each is started by an announcement, then mapped
            assert len(objects) == 6, "the run must pass through every object"
            before = docs.announcements
            calls = run(150)  # every object mapped: the announcements are settled
            assert docs.announcements - before <= calls // 4, (docs.announcements - before, calls)
            assert docs.misses == 0, "a step needed an object no announcement had started"
        finally:
            docs.close()


def test_a_settled_producer_announces_again_as_soon_as_an_object_fills(corpus, tmp_path):
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))
    enc = encoder_for_manifest(manifest)
    state = plan.initial_state()
    near = set(upcoming_columns(plan, state, list(plan.lanes_of(1, 0)), 48).obj.tolist())
    far = min(set(range(6)) - near)  # an object the producer's windows below do not name
    held = HeldEncoder(enc, fill_free=0)  # its fill is held at its first chunk: it stays filling
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        _warm(manifest, cache, enc, sorted(set(range(6)) - {far}))
        docs = Counted(manifest, cache, held)
        try:
            maker = StepMaker(plan, docs, replica=0, replicas=1)
            maker._prefetch(state, 1)  # the first objects start
            assert docs.wait_filled(30) and maker._settled is None and docs.announcements == 1
            maker._prefetch(state, 1)  # every object named is mapped now: settled
            assert maker._settled is not None and docs.announcements == 2
            maker._prefetch(state, 1)  # within the settled announcement, nothing filling: nothing to say
            assert docs.announcements == 2
            other = threading.Thread(target=docs.prefetch, args=([Ref(far, 0)],))  # another replica's object
            other.start()
            other.join(30)
            assert docs.filling
            maker._prefetch(state, 1)  # an object fills (it could be a RESTORE's stale one): asked again
            assert docs.announcements == 4  # (the other thread's was the third)
            docs.restored(threading.get_ident())
            maker._prefetch(state, 1)  # a RESTORE's sweep pending: not settled, the window announced and swept
            assert docs.announcements == 6 and threading.get_ident() not in docs._restoring
        finally:
            held.release()
            docs.close()


def test_a_corpus_whose_every_object_is_done_is_not_announced_at_all(corpus, tmp_path):
    """Every object's tokens mapped (a corpus warmed into the node cache that fits the entry bound): the
    producer computes no announcement (`DocSource.all_done`) until a RESTORE's sweep is pending; a corpus
    whose entries the budget evicts is never all done."""
    manifest = load_manifest(corpus / "manifest.json")
    plan = Plan(manifest, load_runspec(corpus / "run.toml"))
    enc = encoder_for_manifest(manifest)
    state = plan.initial_state()
    with NodeCache(tmp_path / "cache", 1 << 30) as cache:
        _warm(manifest, cache, enc)
        docs = Counted(manifest, cache, enc)
        try:
            maker = StepMaker(plan, docs, replica=0, replicas=1)
            assert not docs.all_done()  # no entry yet
            docs.prefetch([Ref(o, 0) for o in range(5)])
            assert docs.wait_filled(30) and not docs.all_done()  # one object has no entry yet
            docs.prefetch([Ref(5, 0)])
            assert docs.wait_filled(30) and docs.all_done()
            before = docs.announcements
            for _ in range(3):
                maker._prefetch(state, 4)
            assert docs.announcements == before  # nothing computed, nothing announced
            docs.restored(threading.get_ident())
            assert not docs.all_done()
            maker._prefetch(state, 4)  # the sweep runs at this announcement, as before
            assert docs.announcements == before + 1 and docs.all_done()
        finally:
            docs.close()
        small = DocSource(manifest, cache, enc, budget_bytes=1)  # the budget evicts all but the newest entry
        try:
            for o in range(6):
                small.prefetch([Ref(o, 0)])
                assert small.wait_filled(30)
            assert len(small._lru) < 6 and not small.all_done()
        finally:
            small.close()
