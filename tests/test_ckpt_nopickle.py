"""A checkpoint never runs planted code (issue 27 item 2).

DCP keeps its `.metadata` as a pickle, and DCP's default planner reads its
non-tensor values with `torch.load(weights_only=False)`. Whoever can write a
checkpoint folder replaces one of them with a pickle that writes a marker file
and fixes its digest in the (unsigned) manifest. Every test asserts the marker
was never written: `sluice ckpt verify`, `restore()` and the drill refuse the
checkpoint, and restore falls back to the previous good one. A real tiny model
and a real `dcp.save` throughout.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import blake3
import pytest
import torch

from sluice.errors import CheckpointError
from sluice.trainer_hooks.dcpmeta import METADATA_FILE, read_dcp_metadata
from sluice.trainer_hooks.drill import child_main, run_drill
from sluice.trainer_hooks.safepickle import Global, PickleReader, UnsafePickle
from sluice.trainer_hooks.signing import MAC_NAME
from sluice.trainer_hooks.verify import load_checkpoint_manifest

from test_ckpt import LaneData, make_model, manager, train_step
from test_ckpt_cli import cli
from test_ckpt_hardening import edit_manifest, key_file, verify_cli  # noqa: F401 - key_file is a fixture


class Planted:
    """Pickles to code that writes `marker` when unpickled; with `then`, it returns pickle.loads(then)
    afterwards, so a loader that ran it would carry on as if nothing happened."""

    def __init__(self, marker: Path, then: bytes | None = None) -> None:
        self.marker, self.then = marker, then

    def __reduce__(self):
        code = f"__import__('pathlib').Path({str(self.marker)!r}).write_text('planted code ran')"
        if self.then is None:
            return (exec, (code,))
        return (eval, (f"({code}, __import__('pickle').loads({self.then!r}))[1]",))


def save_dcp(root: Path, steps=(0, 1), **cfg) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """Train a tiny model and DCP-save it at each step: the checkpoint names and the saved weights."""
    model, opt = make_model(0)
    data = LaneData()
    mgr = manager(root, model, opt, data, "dcp", keep_last=10, **cfg)
    names, weights = [], []
    for step in steps:
        train_step(model, opt)
        data.advance(step)
        names.append(mgr.save(step).name)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return names, weights


def restore_dcp(root: Path, **cfg):
    model, opt = make_model(5)
    data = LaneData()
    mgr = manager(root, model, opt, data, "dcp", **cfg)
    mgr.restore()
    return mgr.last_restore, model, data


def fix_digest(folder: Path, file: str) -> None:
    """Record file's true size and BLAKE3 in the manifest, as an attacker who can write the folder would."""
    blob = (folder / file).read_bytes()
    edit_manifest(folder, lambda man: [s.update(bytes=len(blob), blake3=blake3.blake3(blob).hexdigest())
                                       for s in man["shards"] if s["file"] == file])


def plant_metadata(folder: Path, marker: Path, stealthy: bool) -> None:
    original = (folder / METADATA_FILE).read_bytes()
    (folder / METADATA_FILE).write_bytes(pickle.dumps(Planted(marker, original if stealthy else None), protocol=4))
    fix_digest(folder, METADATA_FILE)


def plant_value(folder: Path, marker: Path) -> None:
    """Append a torch.save'd planted object to the DCP data file and point the optimizer's `lr` at it."""
    data_file = next(p for p in (folder / "dcp").iterdir() if p.suffix == ".distcp")
    offset = data_file.stat().st_size
    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    with open(data_file, "ab") as fh:
        fh.write(buf.getvalue())
    md = pickle.loads((folder / METADATA_FILE).read_bytes())  # written by this test's own save: trusted
    for index, info in md.storage_data.items():
        if index.fqn.endswith("param_groups.0.lr"):
            info.offset, info.length = offset, len(buf.getvalue())
    (folder / METADATA_FILE).write_bytes(pickle.dumps(md))
    fix_digest(folder, METADATA_FILE)
    fix_digest(folder, f"dcp/{data_file.name}")


def corrupt_tensor_bytes(folder: Path, marker: Path) -> None:
    """Damage the bytes of every tensor in the DCP data file (digest fixed): torch's reader then raises
    inside dcp.load, which torch reports as CheckpointException, a BaseException."""
    data_file = next(p for p in (folder / "dcp").iterdir() if p.suffix == ".distcp")
    blob = bytearray(data_file.read_bytes())
    for i in range(0, len(blob), 97):
        blob[i] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    fix_digest(folder, f"dcp/{data_file.name}")


PLANTS = {
    "metadata runs code": (lambda f, m: plant_metadata(f, m, stealthy=False), "global builtins.exec is not allowed"),
    "metadata runs code and carries on": (lambda f, m: plant_metadata(f, m, stealthy=True),
                                          "global builtins.eval is not allowed"),
    "a DCP value runs code": (plant_value,
                              "DCP value app.optim.param_groups.0.lr: global __builtin__.exec is not allowed"),
    "tensor bytes damaged": (corrupt_tensor_bytes, "dcp.load failed"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_checkpoint_is_refused_by_verify_and_restore_falls_back(tmp_path, plant):
    damage, reason = PLANTS[plant]
    root, marker = tmp_path / "run", tmp_path / "marker"
    names, weights = save_dcp(root)
    damage(root / "ckpt" / names[1], marker)

    code, doc = verify_cli(root)
    assert code == 1 and [c["name"] for c in doc["checkpoints"] if not c["verified"]] == [names[1]]
    assert reason in " ".join(doc["checkpoints"][0]["problems"])
    assert not marker.exists()

    report, model, data = restore_dcp(root)  # on main: the code ran, or CheckpointException escaped
    assert not marker.exists()
    assert report.restored == names[0] and data.step == 0
    assert report.skipped[0][0] == names[1] and reason in " ".join(report.skipped[0][1])
    assert all(torch.equal(v, weights[0][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("plant", list(PLANTS))
def test_the_drills_scratch_process_refuses_it(tmp_path, plant, capsys):
    damage, reason = PLANTS[plant]
    root, marker = tmp_path / "run", tmp_path / "marker"
    names, _ = save_dcp(root)
    damage(root / "ckpt" / names[1], marker)
    for name, ok in ((names[1], False), (names[0], True)):
        assert child_main([str(root / "ckpt" / name)]) == 0  # what the scratch process runs, in this process
        out = json.loads(capsys.readouterr().out)
        assert out["ok"] is ok and (ok or reason in " ".join(out["problems"]))
    assert not marker.exists()


@pytest.mark.slow
def test_drill_with_the_runs_key_refuses_an_unsigned_or_tampered_manifest(tmp_path, key_file):  # noqa: F811
    root, marker = tmp_path / "run", tmp_path / "marker"
    names, _ = save_dcp(root, hmac_key_file=key_file)
    assert (root / "ckpt" / names[1] / MAC_NAME).exists()
    code, out, _ = cli("ckpt", "drill", root, "--key-file", key_file, "--json")
    assert code == 0 and [r["ok"] for r in json.loads(out)["results"]] == [True, True]

    plant_metadata(root / "ckpt" / names[1], marker, stealthy=True)  # the attacker cannot re-sign
    code, out, _ = cli("ckpt", "drill", root, "--key-file", key_file, "--json")
    latest, older = json.loads(out)["results"]
    assert code == 1 and (latest["ok"], older["ok"]) == (False, True)
    assert "does not match the manifest under this key" in latest["problems"][0]
    assert not marker.exists()

    (root / "ckpt" / names[0] / MAC_NAME).unlink()
    results = run_drill(root, key_file=key_file)
    assert [r.ok for r in results] == [False, False] and "no manifest.mac" in results[1].problems[0]


def sign(folder: Path, key_file: Path) -> None:
    """Re-sign the manifest with the run's key: what only the key's holder can do."""
    from sluice.trainer_hooks.signing import Signer

    Signer(key_file.read_bytes()).sign_into(folder, (folder / "manifest.json").read_bytes())


def test_a_signed_checkpoint_still_never_reads_a_dcp_value_with_full_pickle(tmp_path, key_file):  # noqa: F811
    # Even bytes the key vouches for go only through torch.load(weights_only=True).
    root, marker = tmp_path / "run", tmp_path / "marker"
    names, weights = save_dcp(root, hmac_key_file=key_file)
    plant_value(root / "ckpt" / names[1], marker)
    sign(root / "ckpt" / names[1], key_file)
    code, doc = verify_cli(root, "--key-file", str(key_file))
    assert code == 1 and "Unsupported global: GLOBAL exec" in " ".join(doc["checkpoints"][0]["problems"])
    report, model, _ = restore_dcp(root, hmac_key_file=key_file)
    assert report.restored == names[0] and "Unsupported global: GLOBAL exec" in report.skipped[0][1][0]
    assert all(torch.equal(v, weights[0][k]) for k, v in model.state_dict().items())
    assert not marker.exists()


class SparseState:
    """A torch stateful whose state holds a sparse tensor: weights_only reads it, the plain reader does not."""

    def __init__(self) -> None:
        self.value = torch.eye(3).to_sparse()

    def state_dict(self):
        return {"sparse": self.value}

    def load_state_dict(self, state):
        self.value = state["sparse"]


def test_unsigned_holds_only_plain_tensors_signed_what_weights_only_reads(tmp_path, key_file):  # noqa: F811
    from sluice.trainer_hooks.manager import CheckpointManager

    unsigned, signed = tmp_path / "unsigned", tmp_path / "signed"
    CheckpointManager(unsigned, {"s": SparseState()}).save(0)
    CheckpointManager(signed, {"s": SparseState()}, hmac_key_file=key_file).save(0)
    code, doc = verify_cli(unsigned)
    problems = " ".join(doc["checkpoints"][0]["problems"])
    assert code == 1 and "torch._utils._rebuild_sparse_tensor is not allowed" in problems
    assert "sign the run (hmac_key_file)" in problems
    with pytest.raises(CheckpointError, match="_rebuild_sparse_tensor is not allowed"):
        CheckpointManager(unsigned, {"s": SparseState()}).restore()
    assert verify_cli(signed, "--key-file", str(key_file))[0] == 0
    state = SparseState()
    state.value = None
    CheckpointManager(signed, {"s": state}, hmac_key_file=key_file).restore()
    assert torch.equal(state.value.to_dense(), torch.eye(3))


def test_drill_refuses_a_key_file_inside_the_folder_or_readable_by_others(tmp_path, sluice_cli):
    root = tmp_path / "run"
    save_dcp(root, steps=(0,))
    inside = root / "ckpt.key"
    inside.write_bytes(b"k" * 32)
    inside.chmod(0o600)
    out = sluice_cli("ckpt", "drill", root, "--key-file", inside)
    assert out.returncode == 2 and "lies inside the checkpoint folder" in out.stderr
    with pytest.raises(CheckpointError, match="chmod 600"):
        outside = tmp_path / "k"
        outside.write_bytes(b"k" * 32)
        outside.chmod(0o644)
        run_drill(root, key_file=outside)


def test_dcp_round_trips_through_the_reader_without_pickle(tmp_path):
    root = tmp_path / "run"
    names, weights = save_dcp(root, steps=(3,))
    folder = root / "ckpt" / names[0]
    md = read_dcp_metadata(folder, load_checkpoint_manifest(folder))
    trusted = pickle.loads((folder / METADATA_FILE).read_bytes())  # this test wrote it
    assert (md.state_dict_metadata, md.storage_data, md.planner_data) == (
        trusted.state_dict_metadata, trusted.storage_data, trusted.planner_data)
    report, model, _ = restore_dcp(root)
    assert report.restored == names[0]
    assert all(torch.equal(v, weights[0][k]) for k, v in model.state_dict().items())


def rewrite_metadata(change):
    def damage(folder: Path, marker: Path) -> None:
        md = pickle.loads((folder / METADATA_FILE).read_bytes())  # written by this test's own save
        change(md)
        (folder / METADATA_FILE).write_bytes(pickle.dumps(md))
        fix_digest(folder, METADATA_FILE)
    return damage


def _outside_path(md):
    next(iter(md.storage_data.values())).relative_path = "../../data.json"


def _huge_tensor(md):
    item = md.state_dict_metadata["app.model.0.weight"]
    item.size = torch.Size([1 << 40, 16])
    item.chunks[0].sizes = item.size


def _past_the_end(md):
    next(iter(md.storage_data.values())).length = 1 << 30


def _chunk_outside(md):
    md.state_dict_metadata["app.model.0.weight"].chunks[0].offsets = torch.Size([1, 0])


@pytest.mark.parametrize("change, reason", [
    (_outside_path, "file '../../data.json' is not a DCP file of the manifest"),
    (_huge_tensor, "its tensors would hold 703687441"),
    (_past_the_end, "lie outside __0_0.distcp"),
    (_chunk_outside, "a chunk outside the tensor's size [32, 16]"),
])
def test_metadata_made_only_of_allowed_classes_is_still_checked_against_the_manifest(tmp_path, change, reason):
    root = tmp_path / "run"
    names, _ = save_dcp(root)
    rewrite_metadata(change)(root / "ckpt" / names[1], tmp_path / "marker")
    folder = root / "ckpt" / names[1]
    with pytest.raises(CheckpointError, match="refused, not plain DCP metadata") as err:
        read_dcp_metadata(folder, load_checkpoint_manifest(folder))
    assert reason in str(err.value)
    report, _, _ = restore_dcp(root)
    assert report.restored == names[0] and reason in report.skipped[0][1][0]


def test_a_legacy_data_state_size_claim_is_bounded_by_the_dcp_files(tmp_path):
    # An older sluice kept the data state inside the DCP folder, its size in the manifest;
    # restore allocates that size before dcp.load: 2^50 bytes must be refused, not attempted.
    root = tmp_path / "run"
    names, _ = save_dcp(root)

    def legacy(man):
        man["keys"].remove("data")
        man["shards"] = [s for s in man["shards"] if s["key"] != "data"]
        man["extra"].update(dcp_keys=[*man["extra"].get("dcp_keys", []), "data"], dcp_data_bytes=1 << 50)

    edit_manifest(root / "ckpt" / names[1], legacy)
    report, _, data = restore_dcp(root)
    assert report.restored == names[0] and data.step == 0
    reason = report.skipped[0][1][0]
    assert "the manifest says the DCP files hold 1125899906842624 bytes of 'data' state, they hold" in reason


class Blank:
    """A class the reader's table below may create."""


def _hostile(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


BLANK = _str("test") + _str("Blank") + b"\x93"  # STACK_GLOBAL test.Blank
_TABLE = {"test Blank": Global(new=lambda: object.__new__(Blank), build=lambda obj, state: None)}


@pytest.mark.parametrize("data, reason", [
    (pickle.dumps(Planted(Path("/nonexistent/marker"))), "global builtins.exec is not allowed"),
    # BUILD of the class object itself would set attributes on the class for the whole process
    (_hostile(BLANK, b"N}", _str("__eq__"), b"Ns\x86b"), "did not create blank"),
    (_hostile(BLANK, b")R"), "REDUCE of test.Blank"),
    (_hostile(BLANK, b"K\x01\x85\x81"), "NEWOBJ of test.Blank"),
    (_hostile(BLANK, b")\x81\x94}b\x94h\x00}b"), "built twice"),
    (_hostile(b"K\x01Q"), "persistent ID"),
    (_hostile(b"cos\nsystem\n"), "global os.system is not allowed"),
    (_hostile(b"]", BLANK, b"a"), "used as a value"),
    (_hostile(b"}K\x01a"), "APPEND to a dict"),
    (b"\x80\x04]", "malformed pickle"),
    # hashing a million-deep tuple (as a dict key) recurses in C and kills the process
    (_hostile(b"}", b")" + b"\x85" * 1_000_000, b"Ns"), "tuples nested deeper than 64"),
    (_hostile(b"N") + b"junk", "bytes after STOP"),
])
def test_the_reader_refuses_every_hostile_pickle(data, reason):
    with pytest.raises(UnsafePickle, match=reason.replace("(", r"\(").replace(")", r"\)")):
        PickleReader(_TABLE).load(data)


def _resave(blob: bytes, change) -> bytes:
    """A copy of a torch.save zip with change(name, data, info) -> (data, compression) applied per entry."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data, compression = change(info.filename, src.read(info))
            dst.writestr(info.filename, data, compress_type=compression)
    return out.getvalue()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _flip_storage_byte(blob: bytes) -> bytes:
    i = blob.index(b"\x00\x00\x80\x3f")  # the first 1.0f of torch.ones
    return blob[:i] + b"\x01" + blob[i + 1:]


@pytest.mark.parametrize("blob, reason", [
    (_resave(_saved(torch.arange(4)), lambda n, d: (d.replace(b"K\x04\x85", b"K\x05\x85", 1), 0)
             if n.endswith("data.pkl") else (d, 0)), "outside its storage of 4 elements"),
    (_resave(_saved(torch.ones(64)), lambda n, d: (d, 8 if "/data/" in n else 0)), "compression 8"),
    (_resave(_saved(torch.ones(64)), lambda n, d: (d[:-4] if "/data/" in n else d, 0)), "expected exactly 256"),
    (_flip_storage_byte(_saved(torch.ones(64))), "CRC differs"),
    (_saved({"x": Planted(Path("/nonexistent/marker"))}), "global __builtin__.exec is not allowed"),
    (b"PK\x03\x04 not a zip", "not a torch.save zip file"),
])
def test_the_plain_torch_reader_refuses_what_it_cannot_prove_safe(blob, reason):
    from sluice.trainer_hooks.torchzip import load_plain

    with pytest.raises(UnsafePickle, match=reason):
        load_plain(blob)


def test_the_plain_torch_reader_reads_what_weights_only_reads_for_plain_states():
    from sluice.trainer_hooks.torchzip import load_plain

    model, opt = make_model(0)
    train_step(model, opt)
    states = [model.state_dict(), opt.state_dict(), torch.arange(6).view(2, 3)[:, 1],
              {"p": torch.nn.Parameter(torch.ones(2)), "u16": torch.arange(3).to(torch.uint16),
               "bf16": torch.ones(2, dtype=torch.bfloat16), "b": torch.tensor([True, False]),
               "empty": torch.zeros(0, 3),
               "set": {1, 2}, "bytes": b"\x00\xff", "size": torch.Size([2, 3]), "dtype": torch.float16,
               "device": torch.device("cpu"), "complex": 1 + 2j, "none": None, "tuple": (0.9, 0.999)}]
    for state in states:
        blob = _saved(state)
        got, want = load_plain(blob), torch.load(io.BytesIO(blob), weights_only=True)
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            got, want = {"t": got}, {"t": want}
        assert got.keys() == want.keys() and getattr(got, "_metadata", None) == getattr(want, "_metadata", None)
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert type(got[k]) is type(v) and got[k].dtype == v.dtype and got[k].stride() == v.stride()
                assert torch.equal(got[k], v)
            elif k != "state":
                assert got[k] == v and type(got[k]) is type(v)
        if "state" in want:  # the optimizer's per-parameter tensors
            assert all(torch.equal(got["state"][p][n], t) for p, s in want["state"].items() for n, t in s.items())
