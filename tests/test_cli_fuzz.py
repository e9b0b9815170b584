"""Every `sluice` command, and `loaderd`'s argument handling, fed hostile input.

The promise under test (issue 10 item 18): no command ends in a traceback on
any input. Bad input gets exit 2 and a `... error: ...` line naming it; an
unexpected exception would be exit 3 ("bug in sluice") and fails here.

Two kinds of input:
* a seeded corpus of hostile files (missing, empty, a folder, a FIFO,
  /dev/zero, binary junk, not UTF-8, JSON nested 100k deep, 5000-digit
  integers, TOML of the wrong types, mutated manifests) slotted into every
  file argument of every command, the other arguments valid;
* hypothesis-generated run specs, dataset specs and manifests (random values
  of random types in every field).

All of it runs in-process through `main(argv)` (`sluice_main`); a few
representative cases also run as real subprocesses, where a traceback would
be printed by the interpreter itself.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import examples

GOLDEN = Path(__file__).resolve().parent / "golden" / "manifest_small.json"
SAMPLE = "b3:" + "0" * 64 + ":0"


# -- the hostile corpus ----------------------------------------------------------------
def _hostile_files(root: Path) -> dict[str, Path]:
    rng = random.Random(10)
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {
        "empty": b"",
        "binary": bytes(rng.randrange(256) for _ in range(4096)),
        "not-utf8": b'name = "\xff\xfe"\nrun_id = "\xc0"\n',
        "deep-json": b"[" * 100_000 + b"]" * 100_000,
        "huge-int-json": b'{"schema": ' + b"9" * 5000 + b"}",
        "json-array": b"[]",
        "json-null": b"null",
        "deep-toml": b"x = " + b"[" * 5000 + b"]" * 5000,
        "huge-int-toml": b"seed = " + b"9" * 5000 + b"\n",
        "wrong-types-toml": b'run_id = 5\nseed = "x"\nlanes = true\nglobal_batch = 1.5\nmicro_batch = []\n'
                            b'name = 3\n[packing]\nseq_len = true\n[[sources]]\npaths = 7\n',
        "bounds-toml": b'run_id = "r"\nseed = 1\nlanes = 1000000000\nglobal_batch = 1000000000\nmicro_batch = 1\n',
    }
    out = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        out[name] = root / name
    golden = json.loads(GOLDEN.read_bytes())
    mutations = {
        "manifest-paths-ints": lambda m: m["sources"][0].update(paths=[1, 2]),
        "manifest-unknown-key": lambda m: m["sources"][0]["objects"][0].update(colour="red"),
        "manifest-spaced-digest": lambda m: m["sources"][0]["objects"][0].update(digest="b3: " + "0" * 63 + " "),
        "manifest-eos-out-of-vocab": lambda m: m["packing"].update(eos_id=100_000),
        "manifest-objects-dict": lambda m: m["sources"][0].update(objects={"a": 1}),
        "manifest-sources-string": lambda m: m.update(sources="x"),
    }
    for name, mutate in mutations.items():
        m = json.loads(json.dumps(golden))
        mutate(m)
        (root / name).write_text(json.dumps(m))
        out[name] = root / name
    out["missing"] = root / "absent" / "nothing.json"
    (root / "folder").mkdir(exist_ok=True)
    out["folder"] = root / "folder"
    if not (root / "fifo").exists():
        os.mkfifo(root / "fifo")
    out["fifo"] = root / "fifo"
    out["dev-zero"] = Path("/dev/zero")
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_file):
    """A valid tiny dataset (manifest, run spec, tokenizer) and the hostile corpus."""
    from sluice.manifest.freeze import freeze

    root = tmp_path_factory.mktemp("fuzz")
    shutil.copy(tokenizer_file, root / "tokenizer.json")
    (root / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(8)))
    (root / "dataset.toml").write_text(
        'name = "fuzz"\ntokenizer = "tokenizer.json"\n[packing]\nseq_len = 16\neos = "<|endoftext|>"\n'
        '[[sources]]\nname = "a"\npaths = ["d.jsonl"]\nformat = "jsonl"\nexhaustion = "repeat"\n'
    )
    (root / "run.toml").write_text('run_id = "f"\nseed = 1\nlanes = 2\nglobal_batch = 2\nmicro_batch = 1\n')
    freeze(root / "dataset.toml", root / "manifest.json", progress=False)
    return {"root": root, "M": root / "manifest.json", "R": root / "run.toml", "S": root / "dataset.toml",
            "T": root / "tokenizer.json", "hostile": _hostile_files(root / "hostile")}


# Every command, with {F} where the hostile file goes; the rest is valid. `strict`:
# the argument is a file that must hold something specific, so any hostile file
# is bad input (exit 2). Folder arguments may legitimately be empty or new.
FILE_ARG_COMMANDS = [
    ("manifest freeze {F} -o {O}", True),
    ("manifest verify {F}", True),
    ("manifest show {F}", True),
    ("manifest diff {F} {M}", True),
    ("manifest diff {M} {F}", True),
    ("plan {F} {R} --steps 0:1", True),
    ("plan {M} {F} --steps 0:1", True),
    ("plan {M} {R} --steps 0:2 --state {F}", True),
    ("whence {F} {R} " + SAMPLE, True),
    ("whence {M} {F} " + SAMPLE, True),
    ("ledger {F} {R} --until-step 1", True),
    ("ledger {M} {F} --until-step 1", True),
    ("loaderd {F} {R} --cache {D}/loaderd-cache", True),
    ("loaderd {M} {F} --cache {D}/loaderd-cache", True),
    ("cache warm {F} {D}/warm-cache --budget 1M", True),
    ("tokenize identity {F}", True),
    ("tokenize check {F}", True),
    ("loaderd {M} {R} --cache {D}/loaderd-cache --token-file {F}", True),
    ("tokenize pretokenize {F} -o {D}/pre", True),
    ("tokenize check {F}", True),
    ("cache warm {F} {D}/warm-tok --budget 1M --tokens --no-progress", True),
    ("tokenize train {F} -o {O} --vocab-size 300", False),
    ("cache stats {F}", False),
    ("cache verify {F}", False),
    ("cache gc {F}", False),
    ("cache warm {M} {F} --budget 1M", False),
    ("ckpt list {F}", False),
    ("ckpt verify {F}", False),
    ("ckpt gc {F} --dry-run", False),
    ("ckpt drill {F}", False),
    ("curve-keys {F} k", False),
    ("report {F} -o {O}", True),
    ("report {M} --metrics-log {F} -o {O}", False),
    ("top {F} --once --timeout 1", False),
    ("run {F} --tokenizer {M}/../tokenizer.json --seq-len 16 --micro-batch 1 --global-batch 2 --prepare-only", True),
    ("run {M}/../d.jsonl --tokenizer {F} --seq-len 16 --micro-batch 1 --global-batch 2 --prepare-only", True),
    ("preflight {F} {R} --tokens-per-step 8 --step-seconds 1", True),
    ("preflight {M} {F} --tokens-per-step 8 --step-seconds 1", True),
    # (not strict: a folder another row made a node cache of is a valid --cache)
    ("preflight {M} {R} --tokens-per-step 8 --step-seconds 1 --cache {F}", False),
]
# Reading these would never end (a FIFO without a writer, an endless device)
# for commands that do not check the file type first; they are fed to the
# commands that promise to refuse non-regular files.
ENDLESS = {"fifo", "dev-zero"}
REFUSES_ENDLESS = ("manifest", "plan", "whence", "ledger", "loaderd", "report", "preflight")


def _leaf_commands() -> list[str]:
    import argparse

    from sluice.cli import build_parser

    def leaves(parser, prefix):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [" ".join(prefix)]
        return [leaf for name, sub in subs[0].choices.items() for leaf in leaves(sub, (*prefix, name))]

    return leaves(build_parser(), ())


def test_the_fuzz_covers_every_command():
    """A command added to the CLI without a row here fails this test."""
    covered = {" ".join(w for w in t.split()[:2] if not w.startswith("{")) for t, _ in
               [(c.values[0], 0) if hasattr(c, "values") else c for c in FILE_ARG_COMMANDS]}
    covered |= {"cadence", "peek"}  # fed hostile option values in test_every_option_refuses_hostile_values
    missing = [c for c in _leaf_commands() if c not in covered and c.split()[0] not in covered]
    assert not missing, f"commands the fuzz does not drive: {missing}"


def check(r, strict: bool, what: str) -> None:
    assert "Traceback" not in r.stderr, f"{what}: {r.stderr[-2000:]}"
    assert r.returncode != 3, f"{what}: a bug: {r.stderr[-2000:]}"
    assert r.returncode in (0, 1, 2), f"{what}: exit {r.returncode}: {r.stderr[-2000:]}"
    if r.returncode == 2:
        assert re.search(r"(^|\n)[\w .:-]*error: \S", r.stderr), f"{what}: exit 2 without an error line: {r.stderr!r}"
    if strict:
        assert r.returncode == 2, f"{what}: exit {r.returncode}, expected 2: {r.stdout[-500:]} {r.stderr[-500:]}"


def _id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


# The fast tier feeds every command this part of the corpus; the slow tier all of it.
FAST_CORPUS = {"missing", "folder", "fifo", "dev-zero", "empty", "not-utf8", "deep-json", "huge-int-toml",
               "wrong-types-toml", "manifest-spaced-digest"}


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fast-corpus", "full-corpus"])
@pytest.mark.parametrize("template, strict", FILE_ARG_COMMANDS, ids=[_id(c) for c in FILE_ARG_COMMANDS])
def test_every_command_refuses_hostile_files(world, tmp_path, sluice_main, template, strict, full):
    for name, path in sorted(world["hostile"].items()):
        if not full and name not in FAST_CORPUS:
            continue
        if name in ENDLESS and not template.startswith(REFUSES_ENDLESS):
            continue
        if template.startswith("tokenize train") and name.startswith(("deep", "huge")):
            continue  # any text is a valid corpus; BPE on one 200 KB word just takes long
        argv = template.format(F=path, M=world["M"], R=world["R"], D=tmp_path, O=tmp_path / f"out-{name}").split()
        r = sluice_main(*argv, timeout=30)
        check(r, strict, f"sluice {' '.join(argv)} [{name}]")
        if r.returncode == 2 and strict:
            first = r.stderr.splitlines()[0] if r.stderr else ""
            assert first.startswith(("sluice: error: ", "usage: ")), f"[{name}] {first!r}"


def test_loaderd_entry_point_refuses_hostile_files(world, tmp_path, sluice_main):
    from sluice.loaderd.cli import main as loaderd_main

    for name, path in sorted(world["hostile"].items()):
        for argv in ([path, world["R"]], [world["M"], path]):
            r = sluice_main(*argv, "--cache", tmp_path / "c", timeout=30, entry=loaderd_main)
            check(r, True, f"loaderd {argv} [{name}]")
            assert r.stderr.startswith(("loaderd: error: ", "usage: ")), r.stderr


BAD_VALUES = ["", "-1", "0", "nan", "inf", "1e999", "9" * 5000, "x", "1:", ":", "5:2", "-3:-1", "0:" + "9" * 5000]


@pytest.mark.slow  # 18 options x 13 values: about 15 s
@pytest.mark.parametrize(
    "template",
    [
        "plan {M} {R} --steps {V}",
        "plan {M} {R} --steps 0:1 --replicas {V}",
        "plan {M} {R} --steps 0:1 --cache-budget {V}",
        "whence {M} {R} {V}",
        "whence {M} {R} " + SAMPLE + " --epochs {V}",
        "whence {M} {R} " + SAMPLE + " --replicas {V}",
        "ledger {M} {R} --until-step {V}",
        "ledger {M} {R} --until-step 1 --every {V}",
        "whence {M} {R} " + SAMPLE + " --max-steps {V}",
        "manifest verify {M} --sample {V}",
        "manifest verify {M} --threads {V}",
        "tokenize check {M} --sample {V}",
        "tokenize check {M} --sample 1 --cache-budget {V}",
        "cache warm {M} {D}/w --budget 1M --tokens --token-workers {V}",
        "manifest freeze {S} -o {D}/m.json --threads {V}",
        "cadence --cost {V} --mtbf 1h",
        "cadence --cost 1m --mtbf {V}",
        "peek {V} --steps 0:1 --timeout 0.2",
        "peek ipc://{D}/nobody.sock --steps 0:1 --timeout {V}",
        "peek ipc://{D}/nobody.sock --steps {V} --timeout 0.2",
        "preflight {M} {R} --tokens-per-step {V} --step-seconds 1",
        "preflight {M} {R} --tokens-per-step 8 --step-seconds {V}",
        "loaderd {M} {R} --cache {D}/c --replicas {V}",
        "loaderd {M} {R} --cache {D}/c --cache-budget {V}",
        "loaderd {M} {R} --cache {D}/c --serve {V} --replicas 2",
        "loaderd {M} {R} --cache {D}/c --metrics-port {V}",
        "loaderd {M} {R} --cache {D}/c --request-ttl {V}",
        "loaderd {M} {R} --cache {D}/c --workers {V}",
        "loaderd {M} {R} --cache {D}/c --state-dir {M}",
        "loaderd {M} {R} --cache {M}",
        "run {M}/../d.jsonl --tokenizer {M}/../tokenizer.json --seq-len {V} --micro-batch 1 --global-batch 2 "
        "--prepare-only",
        "run {M}/../d.jsonl --tokenizer {M}/../tokenizer.json --seq-len 16 --micro-batch {V} --global-batch 2 "
        "--prepare-only",
        "run {M}/../d.jsonl --tokenizer {M}/../tokenizer.json --seq-len 16 --micro-batch 1 --global-batch 2 "
        "--lanes {V} --prepare-only",
    ],
)
def test_every_option_refuses_hostile_values(world, tmp_path, sluice_main, template):
    for value in BAD_VALUES:
        if value == "0" and ("--serve" in template or "--metrics-port" in template):
            continue  # valid: the daemon would start serving
        argv = template.replace("{V}", "\x00V\x00").format(
            M=world["M"], R=world["R"], S=world["S"], D=tmp_path).split()
        argv = [a.replace("\x00V\x00", value) for a in argv]
        if template.startswith("loaderd") and value in ("",):
            continue  # an empty --replicas/--serve is an argparse error either way; covered by others
        r = sluice_main(*argv, timeout=30)
        # (every value here is out of range for these options but a step bound or period of 0: refused, exit 2;
        # loaderd's are held to no traceback and a known exit code only)
        strict = not template.startswith("loaderd") and not (value == "0" and ("--until-step" in template or
                                                                                 "--every" in template))
        check(r, strict, f"sluice {' '.join(a[:60] for a in argv)}")


# -- generated inputs ----------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**53 + 1]), st.text(max_size=12),
    st.sampled_from(["", "b3:" + "0" * 64, "concat", "eos", "jsonl", "repeat", "0.5", "-0.5", "1e3", "b3: 00 "]),
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                       max_leaves=8)


def _toml_value(v) -> str:
    """A TOML rendering of a JSON-like value (hypothesis data; null becomes a string)."""
    if v is None:
        return '"null"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


_RUN_KEYS = ["run_id", "seed", "lanes", "global_batch", "micro_batch", "resume", "order", "block_window", "max_steps"]
_FUZZ = settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@_FUZZ
@given(changes=st.dictionaries(st.sampled_from(_RUN_KEYS + ["colour"]), _values, min_size=1, max_size=3))
def test_generated_run_specs(world, tmp_path, sluice_main, changes):
    base = {"run_id": "f", "seed": 1, "lanes": 2, "global_batch": 2, "micro_batch": 1}
    spec = {**base, **changes}
    path = tmp_path / "run.toml"
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in spec.items()))
    r = sluice_main("ledger", world["M"], path, "--until-step", "0", "--cache", world["root"] / "cache", timeout=60)
    check(r, False, f"run spec {spec!r:.300}")


_PACKING_KEYS = ["seq_len", "algorithm", "eos", "eos_id", "bos_id", "pad_id", "separator", "window", "loss_mask"]
_SOURCE_KEYS = ["name", "paths", "format", "text_field", "weight", "exhaustion", "split", "filters", "dedup", "notes"]


@_FUZZ
@given(
    packing=st.dictionaries(st.sampled_from(_PACKING_KEYS), _values, max_size=3),
    source=st.dictionaries(st.sampled_from(_SOURCE_KEYS), _values, max_size=3),
    top=st.dictionaries(st.sampled_from(["name", "tokenizer", "access", "notes", "mixture"]), _values, max_size=2),
)
def test_generated_dataset_specs(world, tmp_path, sluice_main, packing, source, top):
    root = world["root"]
    pack = {"seq_len": 16, "eos": "<|endoftext|>", **packing}
    src = {"name": "a", "paths": [str(root / "d.jsonl")], "format": "jsonl", **source}
    head = {"name": "g", "tokenizer": str(world["T"]), **top}
    text = "".join(f"{k} = {_toml_value(v)}\n" for k, v in head.items() if not isinstance(v, dict))
    text += "".join(f"{k} = {_toml_value(v)}\n" for k, v in head.items() if isinstance(v, dict))
    text += "[packing]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in pack.items())
    text += "[[sources]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in src.items())
    (tmp_path / "spec.toml").write_text(text)
    r = sluice_main("manifest", "freeze", tmp_path / "spec.toml", "-o", tmp_path / "m.json", timeout=60)
    check(r, False, f"dataset spec {text!r:.600}")


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


_GOLDEN_PATHS = [p for p in _paths(json.loads(GOLDEN.read_bytes())) if p]


@_FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(_GOLDEN_PATHS), _values), min_size=1, max_size=3))
def test_generated_manifests(world, tmp_path, sluice_main, edits):
    m = json.loads(GOLDEN.read_bytes())
    for path, value in edits:
        node = m
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced the parent
    (tmp_path / "m.json").write_text(json.dumps(m))
    for cmd in (["manifest", "show"], ["manifest", "verify"], ["manifest", "diff", str(GOLDEN)]):
        r = sluice_main(*cmd, tmp_path / "m.json", timeout=60)
        check(r, False, f"{cmd} on {json.dumps(m)[:400]}")


# -- a few through a real process ------------------------------------------------------
@pytest.mark.parametrize("name", ["deep-json", pytest.param("not-utf8", marks=pytest.mark.slow),
                                  pytest.param("folder", marks=pytest.mark.slow)])
def test_real_process_exit_2_without_traceback(world, sluice_cli, name):
    r = sluice_cli("manifest", "show", world["hostile"][name])
    assert r.returncode == 2 and r.stderr.startswith("sluice: error: manifest ") and "Traceback" not in r.stderr, r.stderr
    r = sluice_cli("plan", world["M"], world["hostile"][name], "--steps", "0:1")
    assert r.returncode == 2 and r.stderr.startswith("sluice: error: run spec ") and "Traceback" not in r.stderr, r.stderr
