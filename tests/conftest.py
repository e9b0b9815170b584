"""Shared fixtures: a real S3-protocol server on loopback, a real tokenizer.

Area-specific fixtures live in the test modules that use them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Test helper modules (support.py, logical_helpers.py) live beside this file;
# with --import-mode=importlib the folder is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import support  # noqa: E402
from support import stdlib_texts  # noqa: E402


def pytest_configure(config) -> None:
    """The fast tier (`-m 'not slow'`) runs the costly Hypothesis properties with fewer examples
    (`support.examples`); a full run keeps every count, and so does the fast tier's part of `make test-all`
    (SLUICE_TEST_EXAMPLES=full). Test modules are imported after this hook."""
    full = os.environ.get("SLUICE_TEST_EXAMPLES") == "full"
    support.FAST_TIER = not full and support.leaves_out_slow(config.getoption("markexpr", "") or "")


@pytest.fixture(scope="session", autouse=True)
def numba_cache(tmp_path_factory) -> None:
    """Daemons and kernels loaded by tests (in process or not, loaderd --jit auto) take numba's cache from one
    folder of this session's temp root, shared by the xdist workers: compiled once a session (`jit_kernel`
    lets one worker compile while the other waits), not once a daemon or a worker. Tests create what they need
    in temporary folders: nothing is kept in the user's cache between runs. Tests of cold, damaged or missing
    caches give their processes folders of their own. Numba reads NUMBA_CACHE_DIR at its import, in this
    process and in every child."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(_session_folder(tmp_path_factory) / "numba-cache"))


def _session_folder(tmp_path_factory) -> Path:
    """This session's temporary folder, shared by its xdist workers."""
    base = tmp_path_factory.getbasetemp()  # an xdist worker's is popen-gwN inside the session's folder
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _session_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold the lock file `path` (made if missing) against the session's other test processes; fail the test
    after `timeout_s` seconds of waiting."""
    import fcntl
    import time

    with open(path, "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{path}: another process held the lock over {timeout_s} s")
                time.sleep(0.05)  # a lock file has no event to wait on; bounded by the deadline above
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def jit_kernel(numba_cache) -> object:
    """The fused path's compiled kernel (`jitload.load`), loaded once per test process from NUMBA_CACHE_DIR.

    A cold cache is compiled by one process at a time (a lock file beside it): the other xdist worker waits
    and then loads what the first wrote, instead of compiling the same code again beside it."""
    pytest.importorskip("numba")
    from sluice.loaderd.physical import jitload

    folder = Path(os.environ["NUMBA_CACHE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    with _session_lock(folder / "test-compile.lock", jitload.WARM_TIMEOUT_S):
        return jitload.load(folder)  # numba may be imported already (by a test): give it the folder


@pytest.fixture(scope="session")
def aot_kernel(jit_kernel) -> object:
    """The same kernels compiled ahead of time (`jitaot`: numba's pycc, one extension module in NUMBA_CACHE_DIR),
    built once a session as `jit_kernel` is (one process at a time), loaded without numba's dispatchers."""
    from sluice.loaderd.physical import jitaot, jitload

    folder = Path(os.environ["NUMBA_CACHE_DIR"])
    with _session_lock(folder / "test-compile.lock", jitload.WARM_TIMEOUT_S):
        if jitaot.state(folder) == "absent":
            try:
                jitaot.build(folder)
            except Exception:  # noqa: BLE001 - said by the skip below, from the .failed file
                pass
        if jitaot.state(folder) != "built":
            cause = jitaot.paths(folder)[2].read_text().strip() if jitaot.state(folder) == "failed" else "?"
            pytest.skip(f"the kernels' module compiled ahead of time could not be built here ({cause}): numba.pycc "
                        "needs a C compiler and Python's headers")
        return jitload.load_ahead(folder)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 (real HTTP, real S3 protocol).

    Yields the environment a sluice process needs to reach it
    (SLUICE_S3_ENDPOINT plus dummy credentials); the fixture also sets these in
    os.environ for the session so in-process calls see them.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "SLUICE_S3_ENDPOINT": f"http://{host}:{port}",
        "SLUICE_S3_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def make_s3_bucket(env: dict[str, str], bucket: str, files: dict[str, bytes]) -> None:
    """Create `bucket` on the test server and upload `files` (key -> bytes)."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["SLUICE_S3_ENDPOINT"],
        region_name=env["SLUICE_S3_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


@pytest.fixture(scope="session")
def s3_bucket_factory(s3_server):
    """`factory(bucket, {key: bytes})` uploads objects to the loopback S3 server."""

    def factory(bucket: str, files: dict[str, bytes]) -> None:
        make_s3_bucket(s3_server, bucket, files)

    return factory


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json trained offline on stdlib sources (vocab 1024), once a session.

    Special tokens: <|endoftext|> = 0, <|pad|> = 1, <|bos|> = 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|pad|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    folder = _session_folder(tmp_path_factory) / "tok"
    folder.mkdir(exist_ok=True)
    path = folder / "tokenizer.json"
    with _session_lock(folder.parent / "tok.lock", 120):  # trained by one xdist worker, read by the other
        if not path.exists():
            tok.train_from_iterator(stdlib_texts(60), trainer=trainer)
            tok.save(str(folder / "tokenizer.json.tmp"))
            os.replace(folder / "tokenizer.json.tmp", path)
    return path


@pytest.fixture
def sluice_cli():
    """Run the `sluice` CLI in a real subprocess: `sluice_cli(*args, env=..., cwd=...)`."""
    import subprocess

    def run(*args: str, env: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 300):
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        return subprocess.run(
            [sys.executable, "-m", "sluice.cli", *map(str, args)],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=timeout,
        )

    return run


class _CliTimeout(BaseException):
    """Raised by the alarm of `sluice_main`: a BaseException, so no `except Exception` swallows it."""


@pytest.fixture
def sluice_main():
    """Run the `sluice` CLI in this process through `main(argv)`: `sluice_main(*args)`.

    Returns a `subprocess.CompletedProcess` (returncode, stdout, stderr) like
    `sluice_cli`, about 100x faster; use it for tests about error messages and
    exit codes, and `sluice_cli` where a real process matters (signals,
    interpreter exit). An exception escaping `main` fails the test as it
    would print a traceback; a call that runs past `timeout` seconds fails it
    with TimeoutError instead of hanging the suite.
    """
    import contextlib
    import io
    import signal
    import subprocess

    from sluice.cli import main

    def run(*args: str, timeout: int = 60, entry=main) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        argv = [str(a) for a in args]

        def expire(signum, frame):
            # Not an Exception (TimeoutError is an OSError that code under test may catch).
            raise _CliTimeout(f"sluice {' '.join(argv)[:300]} ran past {timeout} s (a silent, unbounded wait?)")

        old = signal.signal(signal.SIGALRM, expire)
        signal.alarm(timeout)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = entry(argv)
                except SystemExit as exc:  # argparse usage errors and --help
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except _CliTimeout as exc:
            pytest.fail(str(exc))
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())

    return run


# Fixtures whose tests need the compiled kernel (numba): compiling it costs ~11 s of CPU a session (22 s of wall
# time on a busy 2-core machine; ~9 s more for the module compiled ahead of time), so those tests run in the slow
# tier (`make test-all`, what CI runs), not in `make test`. The kernels' source they are compared with is tested,
# run uncompiled (`jitload.uncompiled`), in the fast tier.
_KERNEL_FIXTURES = frozenset({"kernel", "jit_kernel", "aot_kernel"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _KERNEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
