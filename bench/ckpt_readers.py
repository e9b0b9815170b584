"""What reading checkpoints without pickle costs (issue 27 item 2).

Interleaved for --rounds rounds of 5 reads each, medians of the rounds:

* torch shards   a model of six 1024x1024 linear layers and its AdamW state
                 (75.6 MB in two torch.save files): sluice's reader without any
                 unpickler (torchzip.load_plain, what restore uses for an unsigned
                 checkpoint) against torch.load(weights_only=True) (signed);
* DCP metadata   a DCP checkpoint of 1,000 small linear layers (2,000 tensors):
                 dcpmeta.read_dcp_metadata (read without pickle and checked
                 against the manifest) against pickle.loads of the same bytes
                 (what dcp.load did before).

    .venv/bin/python bench/ckpt_readers.py     # about 30 s on a loaded 2-core machine
"""

from __future__ import annotations

import sys

# Running this file puts bench/ on sys.path, where bench/tokenize.py would shadow
# the standard library's tokenize: drop it before anything imports tokenize.
_HERE = __file__.rsplit("/", 1)[0] if "/" in __file__ else "."
sys.path[:] = [p for p in sys.path if p not in ("", _HERE) and not p.endswith("/bench")]

import argparse  # noqa: E402
import pickle  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402


def _median_of(fn: Callable[[], object], n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import torch

    from sluice.trainer_hooks.dcpmeta import METADATA_FILE, read_dcp_metadata
    from sluice.trainer_hooks.manager import CheckpointManager, ModelOptimState
    from sluice.trainer_hooks.torchzip import load_plain
    from sluice.trainer_hooks.verify import load_manifest

    warnings.filterwarnings("ignore")
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-readers-"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    files = [tmp / "model.pt", tmp / "optim.pt"]
    torch.save(model.state_dict(), files[0])
    torch.save(opt.state_dict(), files[1])
    size = sum(f.stat().st_size for f in files)

    small = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(1000)])
    name = CheckpointManager(tmp / "dcp", {"app": ModelOptimState(small)}, format="dcp").save(0).name
    folder = tmp / "dcp" / "ckpt" / name
    man = load_manifest(folder)
    raw = (folder / METADATA_FILE).read_bytes()
    tensors = len(read_dcp_metadata(folder, man).state_dict_metadata)

    plain, weights_only, safe_meta, pickled_meta = [], [], [], []
    for _ in range(args.rounds):  # interleaved: a shared machine's load changes from second to second
        plain.append(_median_of(lambda: [load_plain(f) for f in files]))
        weights_only.append(_median_of(lambda: [torch.load(f, weights_only=True) for f in files]))
        safe_meta.append(_median_of(lambda: read_dcp_metadata(folder, man)))
        pickled_meta.append(_median_of(lambda: pickle.loads(raw)))
    ms = {k: 1e3 * statistics.median(v) for k, v in (("plain", plain), ("weights_only", weights_only),
                                                      ("safe_meta", safe_meta), ("pickled_meta", pickled_meta))}
    print(f"torch shards, {size / 1e6:.1f} MB: reader without pickle {ms['plain']:.0f} ms, "
          f"torch.load(weights_only=True) {ms['weights_only']:.0f} ms")
    print(f"DCP .metadata, {tensors} tensors ({len(raw) / 1e3:.0f} kB): reader without pickle + checks "
          f"{ms['safe_meta']:.0f} ms, pickle.loads {ms['pickled_meta']:.0f} ms")


if __name__ == "__main__":
    main()
