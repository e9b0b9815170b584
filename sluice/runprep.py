"""One call from files to a resumable stream: `sluice.stream(...)` and `sluice run DIR`.

`prepare(...)` does what docs/quickstart.md's steps do by hand (a dataset
spec, a frozen manifest, a run spec) and leaves every file on disk in a work
folder (default: `.sluice/` in the data's folder), so the run is as exact and
auditable as one set up by hand::

    WORKDIR/dataset.toml    the dataset spec it wrote (freezing it again gives the same dataset ID)
    WORKDIR/manifest.json   the frozen manifest (its digest is the dataset ID)
    WORKDIR/run.toml        the run spec
    WORKDIR/tokenizer.json  only with tokenizer="train" (trained offline, deterministic)
    WORKDIR/stream.json     what the last freeze saw (file stats), to skip re-hashing
    WORKDIR/cache/          the node cache the embedded daemon fills (default cache_dir)

`stream(...)` = `prepare(...)` + `embedded_client(manifest, run spec)`: it
returns the `EmbeddedClient`, an iterator of micro-batches (torch IterableDataset
style) and a Stateful for `CheckpointManager`, as `embedded_client` does.

Files are grouped into manifest sources by format (runinputs.py); a path of
several formats becomes one source per format (`NAME.jsonl`, `NAME.parquet`)
whose weights split the source's weight by record counts (9 decimal places),
so a folder is read as one corpus, every document drawn about once per epoch.

Reuse: the manifest is reused without reading a byte of data when the dataset
spec it would write is the same and every file (and the tokenizer) has the same
path, size, mtime, ctime and inode as when it was frozen (what git's index
trusts); otherwise the files are hashed again, and when the content is the same
the manifest is the same bytes, so the dataset ID is the same. A file changed
behind a stale stamp (same stats, other bytes) still cannot be served: the
daemon checks every object against its digest on its way into the node cache.

Concurrent callers on one node (ranks of a torchrun job) serialize on an
exclusive lock of `WORKDIR/.lock`: one freezes, the others then reuse.

Nothing heavy is imported here at module level: `import sluice` stays light
and tokenizers/pyarrow are imported by the freeze when it runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import SpecError
from sluice.runinputs import Part, bad_argument, default_workdir, file_stat, parts_of, positive_int, roots_of

if TYPE_CHECKING:
    from sluice.client.iterator import Client

STATE_SCHEMA = "sluice.stream/1"
DEFAULT_LANES = 64  # lanes = gcd(global_batch, 64) unless given: room for data-parallel sizes up to 64
# Tried in order when `eos` is "auto": the end-of-text tokens of common tokenizer families.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]")
WEIGHT_PLACES = Decimal("0.000000001")  # split weights of a multi-format source: 9 decimal places
TRAIN = "train"


@dataclass(frozen=True)
class Prepared:
    """The files of a prepared run (inside `workdir`, but for a tokenizer given by path) and what preparing did."""

    workdir: Path
    dataset_spec: Path
    manifest: Path
    runspec: Path
    tokenizer: Path
    cache_dir: Path
    dataset_id: str
    reused: bool  # True: the manifest was reused without hashing the data again
    sources: tuple[str, ...]  # manifest source names, in order
    roots: tuple[str, ...]  # folders the data lies in: the daemon's --allow-root list

    @property
    def daemon_args(self) -> tuple[str, ...]:
        """loaderd arguments this run needs: the data folders as allowed roots (outside the work folder)."""
        return tuple(arg for root in self.roots for arg in ("--allow-root", root))

    def to_obj(self) -> dict[str, Any]:
        """The JSON form `sluice run --json` prints."""
        return {
            "workdir": str(self.workdir), "dataset_spec": str(self.dataset_spec), "manifest": str(self.manifest),
            "runspec": str(self.runspec), "tokenizer": str(self.tokenizer), "cache_dir": str(self.cache_dir),
            "dataset_id": self.dataset_id, "reused": self.reused, "sources": list(self.sources),
            "roots": list(self.roots),
        }


def _digest(obj: Any) -> str:
    """A stamp's digest: plain sorted JSON (stat times in ns exceed the canonical encoding's integers)."""
    from sluice.manifest.canonical import digest_id

    return digest_id(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _dataset_toml(parts: list[Part], weights: list[str], tokenizer: Path, workdir: Path, *, seq_len: int,
                  text_field: str, unit: str, eos: str | int | None, pad: str | int | None) -> str:
    def rel(p: str) -> str:
        return os.path.relpath(p, workdir)

    lines = [
        "# Written by sluice.stream / `sluice run`: `sluice manifest freeze dataset.toml -o manifest.json`",
        "# in this folder gives the same manifest (the same dataset ID).",
        'name = "stream"',
        f"tokenizer = {_toml_str(rel(str(tokenizer)))}",
        "",
        "[packing]",
        f"seq_len = {seq_len}",
        'algorithm = "concat"',
    ]
    for key, value in (("eos", eos), ("pad", pad)):
        if isinstance(value, str):
            lines.append(f"{key} = {_toml_str(value)}")
        elif isinstance(value, int):
            lines.append(f"{key}_id = {value}")
    lines += ["", "[mixture]", 'policy = "quota"', f"unit = {_toml_str(unit)}"]
    for part, weight in zip(parts, weights):
        lines += [
            "", "[[sources]]",
            f"name = {_toml_str(part.name)}",
            "paths = [" + ", ".join(_toml_str(rel(a)) for a in part.aliases) + "]",
            f"format = {_toml_str(part.fmt)}",
            f"text_field = {_toml_str(text_field)}",
            f"weight = {_toml_str(weight)}",
            'exhaustion = "repeat"',
        ]
    return "\n".join(lines) + "\n"


def _split_weights(parts: list[Part], records: list[int]) -> list[str]:
    """Each part's weight: its source's weight, split by record counts among the source's formats."""
    from sluice.manifest.fields import normalize_weight

    totals: dict[str, int] = {}
    for part, n in zip(parts, records):
        totals[part.source] = totals.get(part.source, 0) + n
    out = []
    for part, n in zip(parts, records):
        if not part.split:
            out.append(part.weight)
            continue
        total = totals[part.source]
        share = (Decimal(part.weight) * n / total) if total else Decimal(0)
        out.append(normalize_weight(format(share.quantize(WEIGHT_PLACES, ROUND_HALF_EVEN), "f"), part.name))
    return out


def _special_tokens(tokenizer: Path, eos: Any) -> tuple[str | int | None, str | None]:
    """(eos, pad) for the packing table: `eos` as given, or the first known end token the vocabulary has."""
    from sluice.tokenize import load_tokenizer

    enc = load_tokenizer(tokenizer)
    vocab = {s.content for s in enc.special_tokens}
    pad = next((t for t in PAD_CANDIDATES if t in vocab), None)
    if eos is None:
        return None, pad
    if isinstance(eos, bool) or not isinstance(eos, (str, int)):
        raise bad_argument("eos", eos, 'expected "auto", a token string, an integer id or None (no separator)')
    if eos != "auto":
        return eos, pad  # freeze checks it against the vocabulary and names it
    found = next((t for t in EOS_CANDIDATES if t in vocab), None)
    if found is None:
        raise bad_argument("eos", eos, f"tokenizer {tokenizer} has none of the special tokens {list(EOS_CANDIDATES)}; "
                               "pass eos= (a token string or id) or eos=None (documents without a separator)")
    return found, pad


@contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    import fcntl

    fd = os.open(workdir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, also if this process dies
        yield
    finally:
        os.close(fd)


def _read_state(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no stamp, or a damaged one: freeze again (the stamp only ever saves work)
    return obj if isinstance(obj, dict) and obj.get("schema") == STATE_SCHEMA else {}


def _file_digest(path: Path) -> str | None:
    from sluice.manifest.canonical import digest_id

    try:
        return digest_id(path.read_bytes())
    except OSError:
        return None


def _train_tokenizer(parts: list[Part], workdir: Path, state: dict[str, Any], *, vocab_size: int,
                     text_field: str) -> tuple[Path, dict[str, Any]]:
    """tokenizer="train": `sluice tokenize train`'s BPE over the sources' files it reads, into WORKDIR."""
    from sluice.tokenize.train import CORPUS_SUFFIXES, train_bpe

    files = sorted({f for p in parts for f in p.files if f.endswith(tuple(CORPUS_SUFFIXES))})
    if not files:
        raise bad_argument("tokenizer", TRAIN, f"training reads {', '.join(CORPUS_SUFFIXES)} files and the sources have "
                                       "none; train one with `sluice tokenize train` and pass its path")
    out = workdir / "tokenizer.json"
    key = _digest({"files": [file_stat(f) for f in files], "vocab_size": vocab_size, "text_field": text_field})
    if state.get("tokenizer_key") == key and state.get("tokenizer_digest") == _file_digest(out):
        return out, {"tokenizer_key": key, "tokenizer_digest": state["tokenizer_digest"]}
    result = train_bpe(files, out, vocab_size=vocab_size, text_field=text_field)
    return out, {"tokenizer_key": key, "tokenizer_digest": result.digest}


def _tokenizer_path(tokenizer: Any) -> Path:
    if isinstance(tokenizer, (str, os.PathLike)) and os.fspath(tokenizer) and os.fspath(tokenizer) != TRAIN:
        path = Path(os.path.abspath(os.path.expanduser(os.fspath(tokenizer))))
        if not path.is_file():
            raise bad_argument("tokenizer", os.fspath(tokenizer), "no such file (expected a tokenizer.json path, or "
                                                          f"{TRAIN!r} to train one offline from the files)")
        return path
    raise bad_argument("tokenizer", tokenizer, f"expected a tokenizer.json path, or {TRAIN!r} to train one from the files")


def _freeze(spec: Path, manifest: Path, parts: list[Part], phase1: list[str], toml_args: dict[str, Any],
            workdir: Path) -> str:
    """Hash and count the files (freeze), then fix split weights by record counts; the dataset ID."""
    import dataclasses

    from sluice.fsutil import write_atomic
    from sluice.manifest.freeze import freeze

    tmp = workdir / ".manifest.freezing.json"
    try:
        frozen = freeze(spec, tmp, progress=False)
    finally:
        tmp.unlink(missing_ok=True)
    final = _split_weights(parts, [s.records for s in frozen.sources])
    if final != phase1:
        # The spec on disk must freeze to this manifest: rewrite it with the weights the records gave.
        write_atomic(spec, _dataset_toml(parts, final, **toml_args).encode("utf-8"))
        frozen = dataclasses.replace(frozen, sources=tuple(
            dataclasses.replace(s, weight=w) for s, w in zip(frozen.sources, final)))
    data = frozen.canonical_bytes()
    if not manifest.is_file() or manifest.read_bytes() != data:
        write_atomic(manifest, data)
    return frozen.dataset_id


def _runspec_toml(spec: Any) -> str:
    lines = ["# Written by sluice.stream / `sluice run` (docs/runspec.md)"]
    for key, value in spec.to_obj().items():
        lines.append(f"{key} = {_toml_str(value) if isinstance(value, str) else value}")
    return "\n".join(lines) + "\n"


def prepare(
    paths: Any = None,
    *,
    tokenizer: str | os.PathLike[str],
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    mixture: Mapping[str, tuple[Any, Any]] | None = None,
    text_field: str = "text",
    workdir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    lanes: int | None = None,
    replicas: int = 1,
    order: str = "global",
    resume: str = "exact",
    run_id: str = "stream",
    max_steps: int = 0,
    unit: str = "documents",
    eos: str | int | None = "auto",
    vocab_size: int = 8192,
) -> Prepared:
    """Freeze the files into WORKDIR/manifest.json (or reuse it) and write WORKDIR/run.toml; no daemon.

    Arguments are `stream`'s (see there). Raises SpecError naming the argument
    and its value for bad input, and freeze's own errors (ManifestError,
    SourceReadError, TokenizerError) naming the file and line for bad data.
    """
    from sluice.fsutil import write_atomic
    from sluice.manifest.policies import MIXTURE_UNITS
    from sluice.runspec import MAX_GLOBAL_BATCH, RunSpec

    seq_len = positive_int("seq_len", seq_len, 1 << 20)
    micro_batch = positive_int("micro_batch", micro_batch, MAX_GLOBAL_BATCH)
    global_batch = positive_int("global_batch", global_batch, MAX_GLOBAL_BATCH)
    replicas = positive_int("replicas", replicas)
    if not isinstance(text_field, str) or not text_field:
        raise bad_argument("text_field", text_field, "expected the non-empty name of the JSON field / parquet column")
    if unit not in MIXTURE_UNITS:
        raise bad_argument("unit", unit, f"expected one of {', '.join(MIXTURE_UNITS)}")
    if lanes is None:
        lanes = math.gcd(global_batch, DEFAULT_LANES)
        if lanes % replicas:
            lanes = global_batch  # the lanes must split among the replicas
    lanes = positive_int("lanes", lanes)
    if global_batch % (micro_batch * replicas):
        raise bad_argument("global_batch", global_batch, f"must be a multiple of micro_batch x replicas = "
                                                 f"{micro_batch} x {replicas}: each replica takes whole micro-batches")
    try:
        run = RunSpec(run_id=run_id, seed=seed, lanes=lanes, global_batch=global_batch, micro_batch=micro_batch,
                      resume=resume, order=order, max_steps=max_steps)
        run.check_replicas(replicas)
        run.check_seq_len(seq_len)
    except SpecError as exc:
        raise SpecError(f"sluice.stream: {exc}") from exc
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise bad_argument("vocab_size", vocab_size, "expected an integer")

    parts = parts_of(paths, mixture)
    work = Path(os.path.abspath(os.path.expanduser(os.fspath(workdir)))) if workdir is not None else (
        default_workdir(parts))
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise bad_argument("workdir", str(work), f"cannot create it ({exc.strerror or exc})") from exc
    if not os.access(work, os.W_OK):
        raise bad_argument("workdir", str(work), "not writable")
    cache = Path(os.path.abspath(os.fspath(cache_dir))) if cache_dir is not None else work / "cache"
    spec_path, manifest_path, run_path, state_path = (work / "dataset.toml", work / "manifest.json",
                                                      work / "run.toml", work / "stream.json")
    with _locked(work):
        state = _read_state(state_path)
        new_state: dict[str, Any] = {"schema": STATE_SCHEMA}
        if tokenizer == TRAIN:
            tok_path, tok_state = _train_tokenizer(parts, work, state, vocab_size=vocab_size, text_field=text_field)
            new_state.update(tok_state)
        else:
            tok_path = _tokenizer_path(tokenizer)
        eos_value, pad_value = _special_tokens(tok_path, eos)
        toml_args = {"tokenizer": tok_path, "workdir": work, "seq_len": seq_len, "text_field": text_field,
                     "unit": unit, "eos": eos_value, "pad": pad_value}
        phase1 = [p.weight for p in parts]
        text = _dataset_toml(parts, phase1, **toml_args)
        key = _digest({"spec": text, "files": [file_stat(f) for p in parts for f in p.files], "tokenizer": file_stat(str(tok_path))})
        reused = (state.get("key") == key and isinstance(state.get("dataset_id"), str)
                  and _file_digest(manifest_path) == state["dataset_id"] and spec_path.is_file())
        if reused:
            dataset_id = state["dataset_id"]
        else:
            write_atomic(spec_path, text.encode("utf-8"))
            dataset_id = _freeze(spec_path, manifest_path, parts, phase1, toml_args, work)
        new_state.update({"key": key, "dataset_id": dataset_id})
        run_text = _runspec_toml(run).encode("utf-8")
        if not run_path.is_file() or run_path.read_bytes() != run_text:
            write_atomic(run_path, run_text)
        write_atomic(state_path, (json.dumps(new_state, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    return Prepared(workdir=work, dataset_spec=spec_path, manifest=manifest_path, runspec=run_path, tokenizer=tok_path,
                    cache_dir=cache, dataset_id=dataset_id, reused=reused, sources=tuple(p.name for p in parts),
                    roots=roots_of(parts))


def stream(
    paths: Any = None,
    *,
    tokenizer: str | os.PathLike[str],
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    mixture: Mapping[str, tuple[Any, Any]] | None = None,
    text_field: str = "text",
    workdir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    lanes: int | None = None,
    replica: int = 0,
    replicas: int = 1,
    order: str = "global",
    resume: str = "exact",
    run_id: str = "stream",
    max_steps: int = 0,
    unit: str = "documents",
    eos: str | int | None = "auto",
    vocab_size: int = 8192,
    daemon_args: tuple[str, ...] = (),
    endpoint: str | None = None,
    **client_kwargs: Any,
) -> Client:
    """From files to a resumable stream in one call: freeze, write the run spec, start the daemon, return the client.

    Data: `paths` (a folder, a glob, a file, or a list of them: jsonl,
    jsonl.gz/.zst and parquet files; a folder is walked recursively) or
    `mixture` = {name: (paths_or_glob, weight)} for several sources (weights
    relative, as numbers or decimal strings; drawn by `quota` over `unit`:
    documents, tokens, loss_tokens or sequences). `text_field`: the JSON field
    or parquet column holding the text. `tokenizer`: a tokenizer.json path, or
    "train" to train a byte-level BPE of `vocab_size` offline from the data
    files `sluice tokenize train` reads (`train_bpe`). `eos`: "auto" (the tokenizer's
    `<|endoftext|>`, `</s>`, ...), a token string or id, or None.

    Run: `seq_len` tokens per sequence, `global_batch` sequences per optimizer
    step, `micro_batch` sequences per micro-batch of one replica, `seed`,
    `order` (global | block | none), `lanes` (default gcd(global_batch, 64)),
    `max_steps` (0 = unbounded), `resume`, `run_id`; this process is replica
    `replica` of `replicas` (each replica's private daemon serves its lanes).

    Files: all in `workdir` (default: `.sluice/` in the data's folder):
    dataset.toml, manifest.json, run.toml, stream.json, and the node cache
    (`cache_dir`, default WORKDIR/cache). The manifest is reused, without
    re-hashing, while the files are unchanged (module docstring).

    Returns an `EmbeddedClient` (iterate it for micro-batches; give it to
    `CheckpointManager` as "data"; close it, or use it in `with`, to stop the
    daemon); `client.prepared` is the `Prepared` record of the files.
    `daemon_args` go to loaderd, `client_kwargs` to `Client`. With `endpoint`
    (a daemon already serving these files, e.g. started by `sluice run` on
    this node) no daemon is started: a plain `Client` of it is returned, with
    this call's run ID and dataset ID, which that daemon refuses unless they
    are its own. Bad input raises SpecError naming the argument and its value.
    """
    from sluice.client.embedded import embedded_client

    if endpoint is not None and daemon_args:
        raise bad_argument("daemon_args", daemon_args, "no daemon is started when endpoint= names a running one")
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < (
            replicas if isinstance(replicas, int) else 1):
        raise bad_argument("replica", replica, f"expected an integer in [0, replicas={replicas!r})")
    prepared = prepare(paths, tokenizer=tokenizer, seq_len=seq_len, micro_batch=micro_batch,
                       global_batch=global_batch, mixture=mixture, text_field=text_field, workdir=workdir,
                       cache_dir=cache_dir, seed=seed, lanes=lanes, replicas=replicas, order=order, resume=resume,
                       run_id=run_id, max_steps=max_steps, unit=unit, eos=eos, vocab_size=vocab_size)
    if endpoint is not None:
        from sluice.client.iterator import Client

        if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")):
            raise bad_argument("endpoint", endpoint, "expected the ipc:// or tcp:// endpoint a daemon printed on start")
        attached = Client(endpoint, replica, replicas, run_id=run_id, dataset_id=prepared.dataset_id, **client_kwargs)
        attached.prepared = prepared  # type: ignore[attr-defined]
        return attached
    client = embedded_client(prepared.manifest, prepared.runspec, cache_dir=prepared.cache_dir, replica=replica,
                             replicas=replicas, daemon_args=prepared.daemon_args + tuple(daemon_args),
                             **client_kwargs)
    client.prepared = prepared
    return client
