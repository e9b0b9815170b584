"""The docs a newcomer follows are executed: every fenced block marked
``runnable`` (```` ```sh runnable ```` or ```` ```python runnable ````) in the
guides below runs, in order, in one fresh folder per guide, as a reader would
paste it. A failing block names the guide, the block's line and its output.

The run spec reference must also name every field `RunSpec` has, so a field
added later cannot go undocumented.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
GUIDES = ("quickstart.md", "runspec.md", "choosing.md", "observe.md")
# A guide that continues another ("in the quick start's folder") runs after that
# guide's blocks [first, stop) (here: data, tokenizer, manifest, run spec, after the
# "One call" section's three blocks), in the same folder.
AFTER = {"observe.md": ("quickstart.md", 3, 7)}
_FENCE = re.compile(r"^```(\w+)[ \t]+runnable[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line, language, code) of every fenced block marked runnable, in order."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def test_runnable_blocks_are_found_with_language_and_line():
    text = "intro\n```sh runnable\necho hi\n```\n\n```python\nnot run\n```\n```python runnable\nprint(1)\n```\n"
    assert runnable_blocks(text) == [(2, "sh", "echo hi\n"), (9, "python", "print(1)\n")]


def _run_block(guide: str, line: int, lang: str, code: str, cwd: Path) -> str:
    """Run one block in `cwd` with this environment's `python` and `sluice` first on PATH; its stdout."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)  # `sluice` and `python` of this environment come first
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if lang in ("sh", "bash", "console"):
        argv = ["bash", "-euo", "pipefail", "-c", code]
    elif lang == "python":
        argv = [sys.executable, "-c", code]
    else:
        raise AssertionError(f"docs/{guide}, line {line}: runnable block in unknown language {lang!r}")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"docs/{guide}, block at line {line} ({lang}) exited {proc.returncode}:\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("guide", GUIDES)
def test_every_runnable_block_of_the_guide_runs_in_order(guide, tmp_path):
    blocks = runnable_blocks((DOCS / guide).read_text(encoding="utf-8"))
    assert blocks, f"docs/{guide} has no runnable block"
    if guide in AFTER:
        first, start, stop = AFTER[guide]
        for line, lang, code in runnable_blocks((DOCS / first).read_text(encoding="utf-8"))[start:stop]:
            _run_block(first, line, lang, code, tmp_path)
    for line, lang, code in blocks:
        _run_block(guide, line, lang, code, tmp_path)


# The quick start on files as users have them: gzip-compressed jsonl whose text field is `body`, not `text`.
# Each (old, new) must occur in the guide's runnable blocks exactly as often as said, so the variant follows the
# guide as it changes instead of silently running the original.
GZ_BODY = (
    ("import json\n", "import gzip\nimport json\n", 1),
    ('open(f"data/jsonl/part-{i}.jsonl", "w", encoding="utf-8")', 'gzip.open(f"data/jsonl/part-{i}.jsonl.gz", "wt", encoding="utf-8")', 1),
    ('json.dumps({"text": t})', 'json.dumps({"body": t})', 1),
    ("--text-field text", "--text-field body", 1),
    ('paths = ["data/jsonl/*.jsonl"]', 'paths = ["data/jsonl/*.jsonl.gz"]', 1),
    ('format = "jsonl"\ntext_field = "text"', 'format = "jsonl"\ntext_field = "body"', 1),
)


def variant(blocks: list[tuple[int, str, str]], edits: tuple[tuple[str, str, int], ...]) -> list[tuple[int, str, str]]:
    """`blocks` with every edit applied; AssertionError naming an edit that does not occur as often as said."""
    for old, _, times in edits:
        found = sum(code.count(old) for _, _, code in blocks)
        assert found == times, f"docs/quickstart.md: {old!r} occurs {found} times in the runnable blocks, not {times}"
    out = []
    for line, lang, code in blocks:
        for old, new, _ in edits:
            code = code.replace(old, new)
        out.append((line, lang, code))
    return out


@pytest.mark.slow
def test_the_quickstart_runs_on_gzip_jsonl_with_another_field_name(tmp_path):
    blocks = variant(runnable_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8")), GZ_BODY)
    out = [_run_block("quickstart.md (gzip jsonl, field body)", line, lang, code, tmp_path)
           for line, lang, code in blocks]
    # the step-by-step loop is the one-call loop (CheckpointManager, client.steps): it ends at end_step,
    # and the second run resumes after the first run's last checkpoint
    train = next(o for o, (_, _, code) in zip(out, blocks) if "python train.py 8" in code)
    assert "start at step 0" in train and "step 4 loss" in train and "start at step 5" in train
    assert train.index("start at step 5") > train.index("step 4 loss") and "step 7 loss" in train
    assert "step 8 loss" not in train and "step 5 loss" in train.split("start at step 5")[1]
    assert sorted(p.name for p in (tmp_path / "data" / "jsonl").iterdir()) == [f"part-{i}.jsonl.gz" for i in range(3)]
    assert "part-0.jsonl.gz" in (tmp_path / "manifest.json").read_text()  # frozen, hashed and served


def test_the_run_spec_reference_names_every_field():
    from sluice.runspec import RunSpec

    text = (DOCS / "runspec.md").read_text(encoding="utf-8")
    table = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", text, re.MULTILINE)}
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    assert fields <= table, f"docs/runspec.md does not document {sorted(fields - table)}"
