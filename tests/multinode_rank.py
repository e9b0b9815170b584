"""One rank of examples/multinode_train.py, for tests/test_multinode_env.py.

With $TEST_PAUSE_AFTER=STEP:DIR the rank, once it logged STEP, writes
DIR/paused-r<RANK> and waits to be killed: the test then knows which steps
the run reached when it kills the rank (a kill at a known place, not a race).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import multinode_train  # noqa: E402


def pause(step: int) -> None:
    at, _, folder = os.environ.get("TEST_PAUSE_AFTER", "").partition(":")
    if at and step == int(at):
        Path(folder, f"paused-r{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(300)  # the test SIGKILLs this process; the bound ends a test that forgot to
        raise SystemExit("multinode_rank: paused for 300 s and nobody killed this rank")


if __name__ == "__main__":
    sys.exit(multinode_train.main(sys.argv[1:], pause))
