"""Tampered and malformed checkpoints (issue 10 items 11-13): restore loads exactly what the
verified manifest lists, skips every malformed checkpoint with its reason for the previous
good one, and `sluice ckpt verify` reports the same; an HMAC key refuses a re-signed shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import blake3
import pytest
import torch

from sluice.errors import CheckpointError
from sluice.trainer_hooks.layout import MANIFEST_NAME
from sluice.trainer_hooks.manager import CheckpointManager
from sluice.trainer_hooks.signing import MAC_NAME

from test_ckpt import LaneData, make_model, train_step
from test_ckpt_cli import cli


def save_steps(root: Path, steps=(0, 1), **cfg) -> list[str]:
    model, opt = make_model(0)
    data = LaneData()
    mgr = CheckpointManager(root, {"model": model, "optim": opt, "data": data}, keep_last=10, **cfg)
    names = []
    for step in steps:
        train_step(model, opt)
        data.step = step
        names.append(mgr.save(step).name)
    return names


def restore(root: Path, **cfg):
    model, opt = make_model(5)
    data = LaneData()
    mgr = CheckpointManager(root, {"model": model, "optim": opt, "data": data}, **cfg)
    mgr.restore()
    return mgr.last_restore, model, data


def edit_manifest(folder: Path, change) -> None:
    man = json.loads((folder / MANIFEST_NAME).read_bytes())
    change(man)
    (folder / MANIFEST_NAME).write_text(json.dumps(man))


def relist(man: dict, key: str, folder: Path, file: str) -> None:
    """Point the manifest entry of `key` at `file`, with its true size and digest (as an attacker would)."""
    blob = (folder / file).read_bytes()
    for shard in man["shards"]:
        if shard["key"] == key:
            shard.update(file=file, bytes=len(blob), blake3=blake3.blake3(blob).hexdigest())


def verify_cli(root: Path, *extra: str) -> tuple[int, dict]:
    code, out, _ = cli("ckpt", "verify", root, "--all", "--json", *extra)
    return code, json.loads(out)


def test_restore_loads_the_file_the_manifest_lists_never_a_fixed_name(tmp_path):
    names = save_steps(tmp_path)
    old, new = (tmp_path / "ckpt" / n for n in names)
    # The newest manifest now lists step 0's weights under another file name; model.pt
    # (step 1's weights) is still there, but no verified entry vouches for it.
    shutil.copy(old / "model.pt", new / "model-listed.pt")
    edit_manifest(new, lambda man: relist(man, "model", new, "model-listed.pt"))
    code, doc = verify_cli(tmp_path)
    assert code == 0 and doc["ok"]  # the manifest is consistent: verify passes
    report, model, _ = restore(tmp_path)
    assert report.restored == names[1]
    listed = torch.load(new / "model-listed.pt", weights_only=True)
    assert all(torch.equal(p, listed[k]) for k, p in model.state_dict().items())
    unlisted = torch.load(new / "model.pt", weights_only=True)
    assert not all(torch.equal(p, unlisted[k]) for k, p in model.state_dict().items())


def nest_deep(folder: Path) -> None:
    (folder / MANIFEST_NAME).write_text('{"schema": "sluice.ckpt/1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")


def world_size_zero(folder: Path) -> None:
    edit_manifest(folder, lambda man: man["extra"].update(world_size=0))


def digest_not_hex(folder: Path) -> None:
    edit_manifest(folder, lambda man: man["shards"][0].update(blake3="z" * 64))


def same_file_twice(folder: Path) -> None:
    def change(man):
        model = next(s for s in man["shards"] if s["key"] == "model")
        man["shards"].append({**model, "key": "optim"})
        man["shards"] = [s for s in man["shards"] if not (s["key"] == "optim" and s["file"] == "optim.pt")]

    edit_manifest(folder, change)


def rng_wrong_length(folder: Path) -> None:
    rng = json.loads((folder / "rng.json").read_bytes())
    rng["torch"] = rng["torch"][:100]
    (folder / "rng.json").write_text(json.dumps(rng))
    edit_manifest(folder, lambda man: relist(man, "rng", folder, "rng.json"))


def pickled_object(folder: Path) -> None:
    torch.save({"evil": Path("/")}, folder / "model.pt")  # torch.load(weights_only=True) refuses it
    edit_manifest(folder, lambda man: relist(man, "model", folder, "model.pt"))


def data_not_json(folder: Path) -> None:
    (folder / "data.json").write_bytes(b"\xff\xfe not json")
    edit_manifest(folder, lambda man: relist(man, "data", folder, "data.json"))


def fifo_shard(folder: Path) -> None:
    (folder / "optim.pt").unlink()
    os.mkfifo(folder / "optim.pt")  # opening it to hash would block forever
    edit_manifest(folder, lambda man: [s.update(bytes=0, blake3=blake3.blake3(b"").hexdigest())
                                       for s in man["shards"] if s["file"] == "optim.pt"])


def fifo_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).unlink()
    os.mkfifo(folder / MANIFEST_NAME)  # reading it would block forever


def symlink_out(folder: Path) -> None:
    outside = folder.parent.parent / "elsewhere.pt"
    shutil.copy(folder / "model.pt", outside)
    (folder / "model.pt").unlink()
    (folder / "model.pt").symlink_to(outside)  # same bytes, but not a file of this checkpoint


def missing_rank_shard(folder: Path) -> None:
    edit_manifest(folder, lambda man: man["extra"].update(world_size=2))  # one rank's shards are not listed


@pytest.mark.parametrize("damage, reason", [
    (nest_deep, "nested too deeply"),
    (world_size_zero, "'world_size' must be in [1,"),
    (digest_not_hex, "is not 64 lowercase hex digits"),
    (same_file_twice, "listed more than once"),
    (rng_wrong_length, "RNG state is malformed"),
    (pickled_object, "model.pt cannot be loaded safely"),
    (data_not_json, "not valid JSON"),
    (missing_rank_shard, "a restore needs ranks [0, 1]"),
    (fifo_shard, "optim.pt (key optim): not a regular file inside the checkpoint folder"),
    (fifo_manifest, "manifest.json is not a regular file"),
    (symlink_out, "model.pt (key model): not a regular file inside the checkpoint folder"),
])
def test_every_malformed_checkpoint_is_skipped_with_its_reason_and_verify_reports_it(tmp_path, damage, reason):
    names = save_steps(tmp_path)
    damage(tmp_path / "ckpt" / names[1])
    code, doc = verify_cli(tmp_path)
    assert code == 1 and not doc["ok"]
    bad = [c for c in doc["checkpoints"] if not c["verified"]]
    assert [c["name"] for c in bad] == [names[1]] and reason in " ".join(bad[0]["problems"])
    report, _, data = restore(tmp_path)
    assert report.restored == names[0] and data.step == 0
    assert report.skipped[0][0] == names[1] and reason in " ".join(report.skipped[0][1])


def test_a_skipped_checkpoint_leaves_no_trace_in_the_restored_model(tmp_path):
    # A skipped checkpoint is read whole before anything is applied: the RNG state of
    # the bad one must not leak into the restored run.
    names = save_steps(tmp_path)
    rng_wrong_length(tmp_path / "ckpt" / names[1])
    _, model, _ = restore(tmp_path)
    want = torch.load(tmp_path / "ckpt" / names[0] / "model.pt", weights_only=True)
    assert all(torch.equal(p, want[k]) for k, p in model.state_dict().items())


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "keys" / "ckpt.key"
    path.parent.mkdir()
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def test_hmac_refuses_a_swapped_shard_with_a_fixed_up_digest(tmp_path, key_file):
    root = tmp_path / "ckpt-root"
    names = save_steps(root, hmac_key_file=key_file)
    old, new = (root / "ckpt" / n for n in names)
    assert (new / MAC_NAME).read_text().startswith("hmac-sha256:")
    shutil.copy(old / "model.pt", new / "model.pt")  # yesterday's weights, digest fixed up
    edit_manifest(new, lambda man: relist(man, "model", new, "model.pt"))
    code, doc = verify_cli(root, "--key-file", str(key_file))
    assert code == 1 and "does not match the manifest" in " ".join(doc["checkpoints"][0]["problems"])
    report, _, _ = restore(root, hmac_key_file=key_file)
    assert report.restored == names[0] and "does not match the manifest" in report.skipped[0][1][0]
    # without the key the same folder verifies: the digests alone cannot tell
    assert verify_cli(root)[0] == 0


def test_hmac_refuses_an_unsigned_manifest_and_a_key_inside_the_folder(tmp_path, key_file):
    root = tmp_path / "ckpt-root"
    save_steps(root, steps=(0,))  # written without a key
    with pytest.raises(CheckpointError, match="verifies within the rollback window"):
        restore(root, hmac_key_file=key_file)
    inside = root / "ckpt.key"
    inside.write_bytes(os.urandom(32))
    inside.chmod(0o600)
    with pytest.raises(CheckpointError, match="inside the checkpoint folder"):
        CheckpointManager(root, {"model": torch.nn.Linear(2, 2)}, hmac_key_file=inside)
    key_file.chmod(0o644)
    with pytest.raises(CheckpointError, match="chmod 600"):
        CheckpointManager(root, {"model": torch.nn.Linear(2, 2)}, hmac_key_file=key_file)


def test_manifests_written_before_the_rank_field_still_restore(tmp_path):
    # Older manifests name per-rank shards <key>-r<rank>.<ext> without a rank field.
    from sluice.trainer_hooks.layout import CheckpointManifest

    man = CheckpointManifest.from_bytes(json.dumps({
        "schema": "sluice.ckpt/1", "step": 1, "generation": 1, "format": "torch", "keys": ["data", "model"],
        "created_unix_ns": 1, "extra": {"world_size": 2, "replicated": ["model"]},
        "shards": [{"key": "model", "file": "model.pt", "kind": "torch", "bytes": 1, "blake3": "0" * 64},
                   {"key": "data", "file": "data-r0.json", "kind": "json", "bytes": 1, "blake3": "1" * 64},
                   {"key": "data", "file": "data-r1.json", "kind": "json", "bytes": 1, "blake3": "2" * 64}],
    }).encode(), "test")
    assert [(s.file, s.rank) for s in man.shards] == [("model.pt", None), ("data-r0.json", 0), ("data-r1.json", 1)]
    assert man.coverage_problems() == []


def finishes(fn, timeout_s: float = 60.0):
    """fn() in a thread: its result or error, or a failure (not a hung test) if it blocks."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} blocked for {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_or_garbage_in_place_of_latest_is_ignored_without_blocking(tmp_path):
    names = save_steps(tmp_path)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")  # opening it to read would block forever
    report, _, data = finishes(lambda: restore(tmp_path))
    assert report.restored == names[1] and data.step == 1
    code, out, _ = finishes(lambda: cli("ckpt", "list", tmp_path, "--json"))
    assert code == 0 and json.loads(out)["latest"] == names[1]  # restore pointed it at its checkpoint again


@pytest.mark.parametrize("record, reason", [
    (lambda p: os.mkfifo(p), "is not a regular file"),
    (lambda p: p.write_text('{"schema": "sluice.ckpt.run/1", "g": ' + "[" * 30_000 + "]" * 30_000 + "}"),
     "nested too deeply"),
    (lambda p: p.write_text('{"schema": "sluice.ckpt.run/1", "generation": 1152921504606846976}'),
     "is not an integer in [0, 9007199254740991)"),
])
def test_a_malformed_run_record_is_a_clear_error_not_a_hang_or_a_traceback(tmp_path, record, reason):
    save_steps(tmp_path, steps=(0,))
    (tmp_path / "run.json").unlink()
    record(tmp_path / "run.json")
    with pytest.raises(CheckpointError, match="run record") as err:
        finishes(lambda: restore(tmp_path))
    assert reason in str(err.value)
