"""The operator as a real process (``python -m polyrl_operator.cli operator``), to be killed with
SIGKILL at arbitrary points, plus small synchronous API helpers for tests that drive it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def start_operator(
    kubeconfig: Path, namespace: str | list[str], settings: dict[str, Any], workdir: Path, tag: str
) -> subprocess.Popen[bytes]:
    settings_file = workdir / "operator-settings.yaml"
    settings_file.write_text(yaml.safe_dump(settings))
    log = (workdir / f"operator-{tag}.log").open("wb")
    watched = [namespace] if isinstance(namespace, str) else namespace
    argv = [
        sys.executable, "-m", "polyrl_operator.cli", "operator",
        *(a for ns in watched for a in ("--namespace", ns)),
        "--kubeconfig", str(kubeconfig), "--settings", str(settings_file),
        "--metrics-port", "0", "--liveness", "",
    ]  # fmt: skip
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL: no cleanup handlers, no graceful shutdown, exactly like a node failure."""
    proc.kill()
    proc.wait(timeout=30)


class SyncApi:
    """Blocking JSON requests to the control plane's shim (plain HTTP on loopback)."""

    def __init__(self, server: str) -> None:
        self.server = server.rstrip("/")

    def call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def list(self, path: str, selector: str | None = None) -> list[dict[str, Any]]:
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        code, body = self.call("GET", path + query)
        assert code == 200, body
        return list(body.get("items") or [])

    def merge(self, path: str, body: Any) -> tuple[int, Any]:
        return self.call("PATCH", path, body, "application/merge-patch+json")
