"""Render Helm charts in tests, without helm: ``helmrender`` (``hack/helmrender``).

No helm binary can be had on the test machines, so ``hack/helmrender/prepare.sh`` builds a
renderer from Go's text/template + sprig v3 + sigs.k8s.io/yaml (Debian sid source packages) that
follows ``helm template`` (Helm v3.21) for charts without dependencies: same functions (sprig,
include, tpl, required, fail, toYaml, lookup -> empty map, ...), same values coalescing and
``--set`` syntax, same output (``---\\n# Source: <chart>/templates/<file>``, NOTES.txt left out,
empty documents dropped, manifests ordered by kind then file, hooks last). It is cached as
``${POLYRL_CACHE:-~/.cache/polyrl}/helmrender/bin/helmrender``; ``POLYRL_HELMRENDER`` may point at
another binary.

API: ``find_helmrender()`` -> ``(path, "")`` or ``(None, reason)``; ``render_chart_text(...)`` ->
the rendered YAML stream; ``render_chart(...)`` -> the parsed documents (comment-only documents,
which helm also prints, are left out). Failures raise ``HelmRenderError`` with helm's message,
e.g. ``execution error at (polyrl/templates/x.yaml:3:8): image.repo is required``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
MAIN_GO = REPO_ROOT / "hack" / "helmrender" / "main.go"
PREPARE = "hack/helmrender/prepare.sh"


class HelmRenderError(RuntimeError):
    """helmrender exited non-zero (a template error, bad values, a missing binary...)."""

    def __init__(self, message: str, *, stderr: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.returncode = returncode


def cache_dir() -> Path:
    """``${POLYRL_CACHE:-~/.cache/polyrl}/helmrender`` (where prepare.sh builds)."""
    return Path(os.environ.get("POLYRL_CACHE") or Path.home() / ".cache" / "polyrl") / "helmrender"


def find_helmrender() -> tuple[Path | None, str]:
    """The renderer binary, or ``(None, reason)`` when it is missing or older than main.go."""
    override = os.environ.get("POLYRL_HELMRENDER")
    if override:
        path = Path(override)
        if not os.access(path, os.X_OK):
            return None, f"POLYRL_HELMRENDER={override} is not an executable file"
        return path, ""
    binary = cache_dir() / "bin" / "helmrender"
    stamp = binary.parent / ".recipe"
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is not built (run {PREPARE})"
    if not stamp.is_file():
        return None, f"incomplete build in {binary.parent} (no .recipe stamp; run {PREPARE})"
    if MAIN_GO.is_file():
        digest = hashlib.sha256(MAIN_GO.read_bytes()).hexdigest()
        if f"main.go={digest}" not in stamp.read_text().split():
            return None, f"{binary} was built from an older {MAIN_GO.name} (run {PREPARE})"
    return binary, ""


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
    """``helm template RELEASE CHART -n NAMESPACE -f F... -f VALUES --set K=V... -a API...``.

    Precedence as in helm, lowest first: the chart's values.yaml, ``values_files`` in order,
    ``values`` (passed as one more values file), ``sets`` then ``set_strings``. Each ``sets`` entry
    becomes ``--set KEY=VALUE`` in helm's syntax (``a.b``, ``a[0]``, ``{x,y}`` lists, ``\\,`` escapes;
    true/false/null/integers are typed, ``null`` removes a default). ``notes`` appends the
    rendered NOTES.txt after a ``NOTES:`` line. ``extra_args`` go to the binary as they are
    (``--kube-version``, ``--include-crds``, ``--show-only``, ``--is-upgrade``, ``--no-hooks``...).
    """
    binary, reason = find_helmrender()
    if binary is None:
        raise HelmRenderError(f"HELM RENDERER NOT AVAILABLE: {reason}")
    with tempfile.TemporaryDirectory(prefix="helmrender-") as tmp:
        args = [str(binary), "--chart", str(chart), "--release-name", release, "--namespace", namespace]
        for file in values_files:
            args += ["--values", str(file)]
        if values is not None:
            values_file = Path(tmp) / "values.json"  # JSON is YAML
            values_file.write_text(json.dumps(values))
            args += ["--values", str(values_file)]
        for key, value in (sets or {}).items():
            args += ["--set", f"{key}={value}"]
        for key, value in (set_strings or {}).items():
            args += ["--set-string", f"{key}={value}"]
        for api in api_versions:
            args += ["--api-versions", api]
        if notes:
            args.append("--notes")
        args += list(extra_args)
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        message = proc.stderr.strip().removeprefix("Error: ")
        raise HelmRenderError(message, stderr=proc.stderr, returncode=proc.returncode)
    return proc.stdout


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
            raise HelmRenderError(f"rendered document is not a mapping: {doc!r}")
        docs.append(doc)
    return docs
