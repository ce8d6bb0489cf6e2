"""The install manifests as tests use them: render the kustomize overlays (the real kustomize built
into kubectl 1.36) and the Helm chart (``helm``), read what they configure, and run the real
operator process exactly as the rendered Deployment would (its args, its settings ConfigMap, its
``POD_NAMESPACE``), against a test control plane instead of the in-cluster API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from polyrl_testenv.controlplane import find_binaries, free_port

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
CHART = REPO / "charts" / "polyrl"
OVERLAYS = ("namespaced", "with-kueue", "monitoring")
SETTINGS_MOUNT = "/etc/polyrl/settings.yaml"


class RenderError(RuntimeError):
    pass


def kubectl_binary() -> Path | None:
    binaries, _ = find_binaries()
    return binaries.kubectl if binaries else None


def kustomize_text(directory: Path) -> str:
    """``kubectl kustomize DIR`` (kustomize v5 inside kubectl 1.36)."""
    kubectl = kubectl_binary()
    if kubectl is None:
        raise RenderError("kubectl not built (run hack/controlplane/prepare.sh)")
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return proc.stdout


def kustomize(directory: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(kustomize_text(directory)) if d]


def find(manifests: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [m for m in manifests if m.get("kind") == kind and (name is None or m["metadata"]["name"] == name)]


def one(manifests: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(manifests, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def operator_deployment(manifests: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return one(manifests, "Deployment")


def operator_container(manifests: Iterable[dict[str, Any]]) -> dict[str, Any]:
    pod = operator_deployment(manifests)["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "operator"]
    assert isinstance(container, dict)
    return container


def operator_subject(manifests: Iterable[dict[str, Any]]) -> tuple[str, str]:
    """(namespace, name) of the ServiceAccount the operator runs as."""
    deployment = operator_deployment(manifests)
    return deployment["metadata"]["namespace"], deployment["spec"]["template"]["spec"]["serviceAccountName"]


def settings_text(manifests: Iterable[dict[str, Any]]) -> str:
    """The settings file the Deployment mounts at /etc/polyrl/settings.yaml (from its ConfigMap)."""
    manifests = list(manifests)
    pod = operator_deployment(manifests)["spec"]["template"]["spec"]
    mount = next(
        m for m in operator_container(manifests)["volumeMounts"] if SETTINGS_MOUNT.startswith(m["mountPath"])
    )
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = one(manifests, "ConfigMap", volume["configMap"]["name"])
    key = SETTINGS_MOUNT.removeprefix(mount["mountPath"]).lstrip("/")
    return str(config_map["data"][key])


def settings_of(manifests: Iterable[dict[str, Any]]) -> dict[str, Any]:
    data = yaml.safe_load(settings_text(manifests)) or {}
    assert isinstance(data, dict)
    return data


def without_crds(manifests: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in manifests if m.get("kind") != "CustomResourceDefinition"]


def operator_argv(
    manifests: Iterable[dict[str, Any]],
    *,
    kubeconfig: Path,
    settings_file: Path,
    liveness_port: int | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
) -> list[str]:
    """The Deployment's container command line, run here: ENTRYPOINT ``polyrl operator`` (the
    image's) + the Deployment's args, with the in-cluster specifics swapped for local ones (the
    settings file path, loopback ports, the control plane's kubeconfig)."""
    args: list[str] = []
    for arg in operator_container(manifests).get("args") or []:
        if arg.startswith("--settings="):
            args.append(f"--settings={settings_file}")
        elif arg.startswith("--liveness="):
            args.append(f"--liveness=http://127.0.0.1:{liveness_port or free_port()}/healthz")
        elif arg.startswith("--metrics-port=") and arg != "--metrics-port=0":
            args.append(f"--metrics-port={metrics_port or free_port()}")
        else:
            args.append(arg)
    argv = [sys.executable, "-m", "polyrl_operator.cli", "operator", *args, "--kubeconfig", str(kubeconfig)]
    if verbose:
        argv.append("--verbose")
    return argv


def start_operator(
    manifests: list[dict[str, Any]],
    *,
    kubeconfig: Path,
    workdir: Path,
    overrides: Mapping[str, Any] | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
    tag: str = "operator",
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``polyrl operator`` as the rendered Deployment runs it; returns (process, log file).

    ``overrides`` are merged over the rendered settings (tests shorten timings only)."""
    settings = settings_of(manifests)
    settings.update(overrides or {})
    settings_file = workdir / f"{tag}-settings.yaml"
    settings_file.write_text(yaml.safe_dump(settings))
    namespace, _ = operator_subject(manifests)
    log = workdir / f"{tag}.log"
    argv = operator_argv(
        manifests,
        kubeconfig=kubeconfig,
        settings_file=settings_file,
        metrics_port=metrics_port,
        verbose=verbose,
    )
    env = {**os.environ, "POD_NAMESPACE": namespace}  # the Deployment's downward-API env
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


def kubeconfig_for(server: str, path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return path


def assert_apply_is_idempotent(cp: Any, text: str) -> None:
    """Server-side apply of an install rendering succeeds, and a second look finds nothing to change
    (what a GitOps controller would see on its next sync)."""
    applied = cp.kubectl("apply", "--server-side", "-f", "-", input=text, timeout=120)
    assert applied.returncode == 0, applied.stderr
    diff = cp.kubectl("diff", "--server-side", "-f", "-", input=text, timeout=120)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def assert_examples_apply(cp: Any, examples: Path, prefix: str) -> None:
    """Every example RLJob under ``examples`` applies with kubectl into a fresh namespace."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cp.create_namespace(ns)
    try:
        for example in sorted(examples.glob("*.yaml")):
            body = yaml.safe_load(example.read_text())
            body["metadata"]["namespace"] = ns
            result = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
            assert result.returncode == 0, f"{example.name}: {result.stderr}"
    finally:
        cp.delete_namespace(ns)
