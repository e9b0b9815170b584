"""Plain helpers shared by test modules (import as `from support import ...`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


# Set by conftest.py's pytest_configure, before any test module is imported: True when the run leaves
# the slow tier out (`-m 'not slow'`, what `make test` runs).
FAST_TIER = False


def examples(n: int) -> int:
    """The Hypothesis example count for a property written for `n` examples.

    The full run (`make test-all`, CI) tries all `n`; the fast tier a quarter of them, at least 10 (never
    more than `n`): it still runs every property on every commit, and CI runs the full count.
    """
    return min(n, max(10, n // 4)) if FAST_TIER else n


def leaves_out_slow(markexpr: str) -> bool:
    """Whether `pytest -m MARKEXPR` deselects a test marked `slow` (and nothing else): the fast tier's runs."""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression  # pytest's own evaluation of -m (no stable public API)

    return not Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == "slow")


def stdlib_texts(limit: int = 200) -> list[str]:
    """Real text that exists on every machine: the standard library's own sources."""
    import json as _json  # any stdlib module gives us the folder

    root = Path(_json.__file__).resolve().parent.parent
    out = []
    for path in sorted(root.glob("*.py")):
        try:
            out.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(out) >= limit:
            break
    return out


def skip_unless_installed(module: str, reason: str) -> None:
    """Skip the calling test module (at collection) when `module` is not installed.

    Unlike pytest.importorskip this does not import `module`: a whole-module slow
    test file is still collected by the fast tier (`-m 'not slow'` deselects it only
    afterwards), and importing lightning or transformers there costs seconds of CPU
    per collection, in every pytest-xdist worker.
    """
    if importlib.util.find_spec(module) is None:
        pytest.skip(reason, allow_module_level=True)


def freeze_here(spec: Path, out: Path, **options):
    """Freeze the dataset spec `spec` into the manifest `out` in this process; the Manifest.

    `sluice manifest freeze SPEC -o OUT --no-progress` writes the same bytes (the command only parses its
    arguments and calls `freeze`). Fixtures that need a frozen corpus use this: a CLI subprocess costs ~0.3 s
    of CPU for the interpreter and its imports, the freeze of a test corpus ~0.01 s. Tests of the command
    itself (its output, exit codes, a real process) still run it through `sluice_cli` or `sluice_main`.
    """
    from sluice.manifest.freeze import freeze

    return freeze(spec, out, progress=False, **options)


def text_manifest(folder: Path, tokenizer: Path, texts: list[str], *, backend: str = "hf",
                  exhaustion: str = "stop") -> Path:
    """A one-object jsonl manifest of `texts` under `tokenizer` (copied into `folder`), seq_len 32; its path."""
    import json

    import blake3

    from sluice.manifest.model import Manifest
    from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
    from sluice.manifest.sources import ObjectRecord, Source
    from sluice.tokenize import load_tokenizer

    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (folder / "docs.jsonl").write_bytes(data)
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    enc = load_tokenizer(tokenizer)
    obj = ObjectRecord(location="docs.jsonl", digest="b3:" + blake3.blake3(data).hexdigest(), size=len(data),
                       records=len(texts), start=0)
    src = Source(name="docs", format="jsonl", text_field="text", weight="1", exhaustion=exhaustion,
                 paths=("docs.jsonl",), objects=(obj,))
    ref = TokenizerRef(location="tokenizer.json", digest=enc.digest, version=enc.version, vocab_size=enc.vocab_size,
                       backend=backend)
    manifest = Manifest(name="fast", tokenizer=ref, packing=PackingPolicy(seq_len=32, eos_id=0),
                        mixture=MixturePolicy(), sources=(src,))
    (folder / "manifest.json").write_bytes(manifest.canonical_bytes())
    return folder / "manifest.json"


def text_objects_manifest(folder: Path, tokenizer: Path, objects: int, size: int) -> Path:
    """A manifest of `objects` jsonl objects of about `size` bytes of real text each (seconds of
    tokenizing at tens of MB), under `tokenizer` (copied into `folder`); its path."""
    import json

    import blake3

    from sluice.manifest.model import Manifest
    from sluice.manifest.policies import MixturePolicy, PackingPolicy, TokenizerRef
    from sluice.manifest.sources import ObjectRecord, Source
    from sluice.tokenize import load_tokenizer

    lines = [json.dumps({"text": t}) + "\n" for t in stdlib_texts(200)]
    records, start = [], 0
    for i in range(objects):
        chunk: list[str] = []
        while sum(map(len, chunk)) < size:
            chunk += lines[i % 7 :: 7]
        data = "".join(chunk).encode()
        (folder / f"part-{i}.jsonl").write_bytes(data)
        records.append(ObjectRecord(location=f"part-{i}.jsonl", digest="b3:" + blake3.blake3(data).hexdigest(),
                                    size=len(data), records=len(chunk), start=start))
        start += len(chunk)
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    enc = load_tokenizer(tokenizer)
    source = Source(name="code", format="jsonl", text_field="text", weight="1", exhaustion="stop",
                    paths=tuple(r.location for r in records), objects=tuple(records))
    manifest = Manifest(name="big-text", tokenizer=TokenizerRef(
        location="tokenizer.json", digest=enc.digest, version=enc.version, vocab_size=enc.vocab_size),
        packing=PackingPolicy(seq_len=32, eos_id=0), mixture=MixturePolicy(), sources=(source,))
    (folder / "manifest.json").write_bytes(manifest.canonical_bytes())
    return folder / "manifest.json"


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of `size` (e.g. "64m") at `path` (made here): a real small disk to fill, or to
    remount read-only. False unless root (the caller skips); unmount with ``umount -l``."""
    import os
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def foreground_sigint() -> None:
    """`preexec_fn` for a command a test will Ctrl-C: SIGINT at its default, as in a terminal's foreground.
    A shell's background job (`make test-all &`) starts with SIGINT ignored, which Python and every child
    inherit: without this, the command would never see the signal and the test would fail for the shell."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_once_working(args: list[str], marker: str, err_path: Path) -> tuple[int, float, str]:
    """Run `python -m sluice.cli *args` in its own process group, send the group SIGINT (a terminal's
    Ctrl-C) 1 s after `marker` shows on its stderr (its workers are busy by then), and return
    (exit code, seconds from the signal to the exit, stderr). Every wait is bounded (60 s)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", *args],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                preexec_fn=foreground_sigint)
    try:
        deadline = time.monotonic() + 60
        while marker not in err_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, err_path.read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # the workers are at work
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        rc = proc.wait(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, waited, err_path.read_text()


def copy_numba_cache(to: Path, marker: bool = True) -> Path:
    """Copy this session's warm numba cache (NUMBA_CACHE_DIR, compiled by the `jit_kernel` fixture: ask for it)
    into the new folder `to`: numba's cache folders, and the warm marker where `marker`; not the module compiled
    ahead of time, nor the session's lock files. A process that takes `to` as its numba cache loads the kernels
    from it in a second or two, where a cold folder costs a compile (~30 s on 2 busy cores): for the tests of what
    happens around a load (a damaged module, a missing compiler, damaged cache files), not of the compile."""
    import os
    import shutil

    from sluice.loaderd.physical import jitload

    session = Path(os.environ["NUMBA_CACHE_DIR"])
    to.mkdir(parents=True)
    for path in session.iterdir():
        if path.is_dir():
            shutil.copytree(path, to / path.name)
    if marker:  # (`jitload.load`, which warmed the session's folder, writes none: a loader's child does)
        (to / jitload._marker_name()).touch()
    return to
