"""The dataset spec: the annotated example loads, keys validate with file and field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sluice.errors import SpecError
from sluice.manifest.freeze import freeze
from sluice.manifest.spec import load_dataset_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "dataset-spec.example.toml"


def test_annotated_example_loads():
    spec = load_dataset_spec(EXAMPLE)
    assert spec.name == "demo" and spec.access == "internal"
    assert spec.tokenizer == str(EXAMPLE.parent / "tokenizer.json")
    assert (spec.packing.eos, spec.packing.pad, spec.packing.seq_len) == ("<|endoftext|>", "<|pad|>", 512)
    assert [s.name for s in spec.sources] == ["code", "docs", "current"]
    code = spec.sources[0]
    assert code.paths == ("shards/code-*.jsonl.zst",)
    assert code.resolved == (str(EXAMPLE.parent / "shards" / "code-*.jsonl.zst"),)
    assert (code.weight, code.exhaustion, code.filters, code.dedup) == ("0.7", "repeat", ("lang=python",), "exact-sha1")
    assert spec.notes["license"] == "PSF"


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return p


SRC = '[[sources]]\nname = "a"\npaths = "d.jsonl"\nformat = "jsonl"\n'


@pytest.mark.parametrize(
    "packing, message",
    [
        ("seq_len = 1", r"packing\.seq_len: must be an integer in \[2, 1048576\], got 1"),
        ("seq_len = 1000000000", r"packing\.seq_len: must be an integer in \[2, 1048576\], got 1000000000"),
        ("seq_len = 8\neos_id = 1099511627776", r"packing\.eos_id: must be a token id in \[0, 2147483647\], got 1099511627776"),
        ("seq_len = 8\nwindow = 100000", r"packing\.window: must be an integer in \[1, 4096\], got 100000"),
        ('seq_len = "8"', r"packing\.seq_len: expected int"),
        ("seq_len = 8\neos = \"x\"\neos_id = 1", r"packing\.eos: give either eos .* or eos_id"),
        ("seq_len = 8\neos_id = -1", r"packing\.eos_id: must be >= 0"),
        ("seq_len = 8\nseparator = \"bos\"", r"packing\.bos_id: required"),
        ("seq_len = 8\nwindow = 0", r"packing\.window: must be an integer in \[1, 4096\], got 0"),
        ("seq_len = 8\nloss_mask = \"some\"", r"packing\.loss_mask: 'some' is not one of"),
        ("seq_len = 8\ncolour = 1", r"packing: unknown key\(s\) \['colour'\]"),
    ],
)
def test_packing_errors_name_file_and_field(tmp_path, packing, message):
    spec = write(tmp_path, f'name = "n"\n[packing]\n{packing}\n' + SRC)
    with pytest.raises(SpecError, match=message) as info:
        load_dataset_spec(spec)
    assert str(spec) in str(info.value)


def test_mixture_and_source_errors(tmp_path):
    spec = write(tmp_path, 'name = "n"\n[packing]\nseq_len = 8\n[mixture]\nunit = "bytes"\n' + SRC)
    with pytest.raises(SpecError, match=r"mixture\.unit: 'bytes' is not one of"):
        load_dataset_spec(spec)
    spec = write(tmp_path, 'name = "n"\n[packing]\nseq_len = 8\n' + SRC + 'exhaustion = "loop"\n')
    with pytest.raises(SpecError, match=r"sources\[0\]\(a\)\.exhaustion: 'loop' is not one of"):
        load_dataset_spec(spec)
    spec = write(tmp_path, 'name = "n"\n[packing]\nseq_len = 8\n' + SRC + SRC)
    with pytest.raises(SpecError, match=r"duplicate source name\(s\) \['a'\]"):
        load_dataset_spec(spec)
    spec = write(tmp_path, 'name = "n"\n[packing]\nseq_len = 8\n[notes]\nn = 1\n' + SRC)
    with pytest.raises(SpecError, match=r"notes\.n: expected a string"):
        load_dataset_spec(spec)
    spec = write(tmp_path, 'name = "n"\n[packing]\nseq_len = 8\n')
    with pytest.raises(SpecError, match=r"sources: at least one"):
        load_dataset_spec(spec)


def test_token_string_missing_from_vocabulary(tmp_path, tokenizer_file):
    shutil.copy(tokenizer_file, tmp_path / "tok.json")
    spec = write(tmp_path, 'name = "n"\ntokenizer = "tok.json"\n[packing]\nseq_len = 8\neos = "</s>"\n' + SRC)
    with pytest.raises(SpecError, match=r"packing\.eos: token '</s>' is not in the tokenizer's vocabulary"):
        freeze(spec, tmp_path / "m.json", progress=False)
    assert not (tmp_path / "m.json").exists()
