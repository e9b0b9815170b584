"""The deployment files in deploy/ say what loaderd and sluice accept.

Each file is parsed as its consumer would (YAML for Kubernetes, the unit
syntax for systemd, shell words for the container's command); every command
line is parsed by the real argparse parser of `loaderd` / `sluice`, with the
environment files of deploy/ filled in, and the node's replicas are checked.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.errors import SpecError
from sluice.loaderd.cli import add_arguments, node_replicas

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blanks skipped), as systemd's EnvironmentFile and sh's `.` read them."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


EXAMPLE_ENV = {**env_file(DEPLOY / "run.env.example"), **env_file(DEPLOY / "node.env.example")}


def loaderd_args(argv: list[str]) -> argparse.Namespace:
    """Parse with loaderd's own parser; an unknown flag or bad value fails the test with argparse's message."""
    parser = argparse.ArgumentParser(prog="loaderd", exit_on_error=False)
    add_arguments(parser)
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"loaderd refuses {argv}: {exc}") from exc


def expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Substitute $VAR / ${VAR}; a variable no env file defines fails the test."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in env, f"{name} is used but no env file of deploy/ defines it"
        return env[name]

    return [re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, w) for w in words]


def expected_serve(env: dict[str, str]) -> tuple[int, ...]:
    n, k = int(env["SLUICE_NODE_RANK"]), int(env["SLUICE_RANKS_PER_NODE"])
    return tuple(range(n * k, n * k + k))


# ----------------------------------------------------------------------------- Kubernetes
def daemonset_command(doc: dict) -> tuple[list[str], list[str], dict[str, str]]:
    """(sourced env files, loaderd argv, mounts path -> volume kind) of the DaemonSet's container."""
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    steps = [s.strip() for s in container["args"][0].split("&&")]
    sourced = [s.split(None, 1)[1] for s in steps[:-1]]
    assert all(s.startswith(". ") for s in steps[:-1]) and steps[-1].startswith("exec loaderd ")
    volumes = {v["name"]: next(k for k in v if k != "name") for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    return sourced, shlex.split(steps[-1])[2:], mounts  # after "exec loaderd"


def mounted(path: str, mounts: dict[str, str]) -> str | None:
    best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len, default=None)
    return mounts[best] if best else None


def test_the_daemonset_runs_a_loaderd_command_line_with_the_nodes_replicas():
    import yaml

    (doc,) = list(yaml.safe_load_all((DEPLOY / "loaderd-daemonset.yaml").read_text()))
    assert doc["kind"] == "DaemonSet" and doc["apiVersion"] == "apps/v1"
    sourced, argv, mounts = daemonset_command(doc)
    # the run-wide file comes with the manifest (ConfigMap), the node's rank from the host
    assert [mounted(p, mounts) for p in sourced] == ["configMap", "hostPath"]
    assert sorted(Path(p).name for p in sourced) == ["node.env", "run.env"]
    args = loaderd_args(expand(argv, EXAMPLE_ENV))
    assert node_replicas(args) == expected_serve(EXAMPLE_ENV)
    assert mounted(args.manifest, mounts) == mounted(args.runspec, mounts) == "configMap"
    assert mounted(args.cache, mounts) == "hostPath"  # the node cache outlives the pod
    assert args.endpoint.startswith("ipc://") and mounted(args.endpoint[len("ipc://"):], mounts) == "hostPath"
    assert mounted(args.endpoint_file, mounts) == "hostPath"
    pod = doc["spec"]["template"]["spec"]
    sock = next(v for v in pod["volumes"] if v["name"] == "sock")["hostPath"]["path"]
    assert args.endpoint == f"ipc://{sock}/loaderd.sock"  # trainer pods mount the same host folder


def test_the_checks_catch_a_misspelled_flag():
    import yaml

    text = (DEPLOY / "loaderd-daemonset.yaml").read_text().replace("--ranks-per-node", "--ranks-per-host")
    _, argv, _ = daemonset_command(yaml.safe_load(text))
    with pytest.raises(AssertionError, match="ranks-per-host"):
        loaderd_args(expand(argv, EXAMPLE_ENV))


def test_the_kuberay_job_freezes_with_the_ray_engine():
    import yaml

    from sluice.cli import build_parser

    (doc,) = list(yaml.safe_load_all((DEPLOY / "ray-freeze-job.yaml").read_text()))
    assert doc["kind"] == "Job" and doc["apiVersion"] == "batch/v1"
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["sluice"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.manifest_command, args.engine) == ("manifest", "freeze", "ray")
    assert re.fullmatch(r"ray://[\w.-]+-head-svc:10001", args.address)
    data = {m["mountPath"] for m in container["volumeMounts"]}
    assert all(any(p.startswith(d + "/") for d in data) for p in (args.spec, args.output))
    assert pod["restartPolicy"] == "Never"


# ----------------------------------------------------------------------------- systemd
def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values (a key may repeat), continuation lines joined, as systemd reads a unit."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert section is not None, f"{path}: {line!r} outside a section"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_systemd_unit_runs_a_loaderd_command_line_with_the_nodes_replicas():
    svc = unit(DEPLOY / "loaderd.service")["Service"]
    assert svc["EnvironmentFile"] == ["/etc/sluice/run.env", "/etc/sluice/node.env"]  # required, both
    (exec_start,) = svc["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/loaderd")
    args = loaderd_args(expand(argv[1:], EXAMPLE_ENV))
    assert node_replicas(args) == expected_serve(EXAMPLE_ENV)
    assert args.cache in svc["ReadWritePaths"][0].split() and svc["RuntimeDirectoryMode"] == ["0700"]
    assert args.endpoint == "ipc:///run/sluice/loaderd.sock"  # /run/sluice is the RuntimeDirectory


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    loaderd = Path(sys.executable).parent / "loaderd"
    assert loaderd.exists(), "the venv's loaderd console script"
    text = (DEPLOY / "loaderd.service").read_text().replace("/opt/sluice/.venv/bin/loaderd", str(loaderd))
    (tmp_path / "loaderd.service").write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "loaderd.service")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- loaderd flags
@pytest.mark.parametrize("argv, message", [
    (["--node-rank", "1"], "go together"),
    (["--node-rank", "1", "--ranks-per-node", "2", "--serve", "0"], "not both"),
    (["--node-rank", "2", "--ranks-per-node", "2"], "replicas 4..5, outside the run's --replicas 4"),
    (["--node-rank", "-1", "--ranks-per-node", "2"], "outside"),
])
def test_node_rank_flags_are_checked(argv, message):
    args = loaderd_args(["m.json", "run.toml", "--cache", "c", "--replicas", "4", *argv])
    with pytest.raises(SpecError, match=re.escape(message)):
        node_replicas(args)


def test_node_rank_names_the_ranks_torchrun_puts_on_the_node():
    args = loaderd_args(["m.json", "run.toml", "--cache", "c", "--replicas", "8", "--node-rank", "3",
                         "--ranks-per-node", "2"])
    assert node_replicas(args) == (6, 7)
