"""Start and stop the control-plane test tier: etcd + apiextensions-apiserver + shim.

The binaries come from ``hack/controlplane/prepare.sh`` (cached under
``${POLYRL_CACHE:-~/.cache/polyrl}/controlplane/bin``). Every process gets free loopback ports and
a private temp folder, so several control planes (and other test sessions) never collide. The shim
runs in its own Python process: it must keep serving while a test blocks its own event loop.

Clients use ``ControlPlane.kubeconfig`` (plain http to the shim, no credentials) or ``.env`` for
subprocesses (KUBECONFIG, a private kubectl cache, and the cached kubectl first on PATH).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl_testenv.certs import make_tls

SUPPORT_DIR = Path(__file__).resolve().parent.parent  # tests/support, for the shim's PYTHONPATH


def cache_dir() -> Path:
    """``${POLYRL_CACHE:-~/.cache/polyrl}/controlplane`` (where prepare.sh puts everything)."""
    return Path(os.environ.get("POLYRL_CACHE") or Path.home() / ".cache" / "polyrl") / "controlplane"


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    apiserver: Path
    kubectl: Path

    @property
    def directory(self) -> Path:
        return self.kubectl.parent

    def versions(self) -> str:
        """What prepare.sh recorded: Debian package versions, Go version, build date."""
        path = self.directory / "versions.txt"
        return path.read_text() if path.exists() else "(no versions.txt)"


def find_binaries(directory: Path | None = None) -> tuple[Binaries | None, str]:
    """The prepared binaries, or ``(None, reason)`` when prepare.sh has not (successfully) run."""
    bin_dir = directory or cache_dir() / "bin"
    names = {"etcd": "etcd", "apiserver": "apiextensions-apiserver", "kubectl": "kubectl"}
    missing = [n for n in names.values() if not os.access(bin_dir / n, os.X_OK)]
    if missing:
        return None, f"{', '.join(missing)} not built in {bin_dir}"
    if not (bin_dir / ".recipe").is_file():  # written last by prepare.sh: a build that completed
        return None, f"incomplete build in {bin_dir} (no .recipe stamp)"
    return Binaries(**{field: bin_dir / n for field, n in names.items()}), ""


class ControlPlaneError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:  # refused while starting (URLError is an OSError)
        return False


def _die_with_parent() -> None:
    # Runs in the child before exec: if the test process dies (even by SIGKILL), the kernel sends
    # SIGTERM to the child, so no etcd/apiserver/shim outlives a crashed test session.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kubeconfig(
    server: str, ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> str:
    cluster: dict[str, Any] = {"server": server}
    if ca:
        cluster["certificate-authority"] = str(ca)
    user = {"client-certificate": str(cert), "client-key": str(key)} if cert and key else {}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "polyrl-test", "cluster": cluster}],
            "users": [{"name": "polyrl-test", "user": user}],
            "contexts": [
                {
                    "name": "polyrl-test",
                    "context": {"cluster": "polyrl-test", "user": "polyrl-test", "namespace": "default"},
                }
            ],
            "current-context": "polyrl-test",
        },
        indent=2,
    )


class _Process:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads involved yet)
            )  # fmt: skip

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise ControlPlaneError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(f"  {self.name}| {line}" for line in text)

    def stop(self, grace: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class ControlPlane:
    """A running control plane. Use ``ControlPlane.start()`` (or ``with ControlPlane.start() as cp``)."""

    def __init__(self, binaries: Binaries, workdir: Path) -> None:
        self.binaries = binaries
        self.workdir = workdir
        self.kubeconfig = workdir / "kubeconfig"  # http to the shim: what tests and kopf use
        self.admin_kubeconfig = workdir / "admin.kubeconfig"  # https to the CRD server itself
        self.server = ""  # the shim's URL, http://127.0.0.1:PORT
        self.upstream = ""  # the CRD server's URL, https://127.0.0.1:PORT
        self._processes: list[_Process] = []
        path = f"{binaries.directory}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env: dict[str, str] = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(workdir / "kubectl-cache"),  # no discovery cache shared across runs
            "PATH": path,
        }

    @classmethod
    def start(
        cls, binaries: Binaries | None = None, *, workdir: Path | None = None, timeout: float = 60.0
    ) -> ControlPlane:
        """Start etcd, the CRD server and the shim; return once core kinds are served."""
        if binaries is None:
            binaries, reason = find_binaries()
            if binaries is None:
                raise ControlPlaneError(f"control plane not available: {reason}")
        workdir = workdir or Path(tempfile.mkdtemp(prefix="polyrl-controlplane-"))
        plane = cls(binaries, workdir)
        try:
            plane._start(timeout)
        except BaseException:
            plane.stop()
            raise
        return plane

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        tls = make_tls(self.workdir / "tls")
        etcd_port, peer_port, api_port, shim_port = (free_port() for _ in range(4))
        self.upstream = f"https://127.0.0.1:{api_port}"
        self.server = f"http://127.0.0.1:{shim_port}"
        self.kubeconfig.write_text(_kubeconfig(self.server))
        self.admin_kubeconfig.write_text(
            _kubeconfig(self.upstream, tls.ca_cert, tls.client_cert, tls.client_key)
        )
        etcd_url, peer_url = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{peer_port}"
        etcd = self._spawn("etcd", [
            str(self.binaries.etcd), "--name", "default", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}", "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        self.wait(deadline, etcd, lambda: _http_ok(f"{etcd_url}/health"))
        self._spawn("apiextensions-apiserver", [
            str(self.binaries.apiserver), "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--secure-port", str(api_port),
            "--tls-cert-file", str(tls.server_cert), "--tls-private-key-file", str(tls.server_key),
            "--client-ca-file", str(tls.ca_cert),
            # Its informers (Services, for webhook conversion) read core kinds: point it at the shim.
            "--kubeconfig", str(self.kubeconfig),
            "--authentication-kubeconfig", str(self.admin_kubeconfig),
            "--authorization-kubeconfig", str(self.admin_kubeconfig),
            # No kube-system/extension-apiserver-authentication ConfigMap to read, no flow-control
            # API, and no core API for these admission plugins to consult.
            "--authentication-skip-lookup", "--enable-priority-and-fairness=false",
            "--disable-admission-plugins", ",".join(self._admission_plugins()),
        ])  # fmt: skip
        port_file = self.workdir / "shim.port"
        pythonpath = os.environ.get("PYTHONPATH", "")
        shim = self._spawn(
            "shim",
            [
                sys.executable,
                "-m",
                "polyrl_testenv.shim",
                "--upstream",
                self.upstream,
                "--ca",
                str(tls.ca_cert),
                "--cert",
                str(tls.client_cert),
                "--key",
                str(tls.client_key),
                "--port",
                str(shim_port),
                "--port-file",
                str(port_file),
                "--proto-dir",
                str(self.binaries.directory / "proto"),
            ],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT_DIR), pythonpath]))},
        )
        self.wait(deadline, shim, port_file.exists)

    def _admission_plugins(self) -> list[str]:
        """Every admission plugin the binary has (they all need core APIs), read from --help."""
        out = subprocess.run(
            [str(self.binaries.apiserver), "--help"], capture_output=True, text=True, check=False
        )
        match = re.search(r"Comma-delimited list of admission plugins: ([^.]*)\.", out.stdout + out.stderr)
        if not match:
            raise ControlPlaneError(
                "cannot read the admission plugin list from apiextensions-apiserver --help"
            )
        return [name.strip() for name in match[1].split(",") if name.strip()]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> _Process:
        process = _Process(name, argv, self.workdir / f"{name}.log", env)
        self._processes.append(process)
        return process

    def wait(self, deadline: float, process: _Process, ready: Any) -> None:
        while not ready():
            for p in self._processes:
                p.check_alive()
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out waiting for {process.name}:\n{self.logs()}")
            time.sleep(0.05)

    def logs(self, lines: int = 30) -> str:
        """The last lines of every process log (for failure messages)."""
        return "\n".join(p.tail(lines) for p in self._processes)

    def stop(self) -> None:
        """Stop all processes (shim first) and remove the temp folder unless POLYRL_KEEP_CONTROLPLANE=1."""
        for process in reversed(self._processes):
            process.stop()
        self._processes.clear()
        if os.environ.get("POLYRL_KEEP_CONTROLPLANE") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- clients -------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the cached kubectl (1.36) against this control plane; text in, text out."""
        proc = subprocess.run(
            [str(self.binaries.kubectl), *args], input=input, capture_output=True, text=True,
            env=self.env, timeout=timeout, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def kubectl_json(self, *args: str, timeout: float = 60.0) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", check=True, timeout=timeout).stdout)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this control plane (close it when done)."""
        from kubernetes import config  # imported here: the harness itself does not need it

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        """A raw JSON request to the shim, e.g. ``request("GET", "/api/v1/namespaces")``."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode(errors="replace")  # e.g. a plain-text 404 page

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        meta: dict[str, Any] = {"name": name, "labels": labels or {}}
        status, body = self.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}
        )
        if status != 201:
            raise ControlPlaneError(f"creating namespace {name}: {status} {body}")

    def delete_namespace(self, name: str) -> None:
        """Delete the namespace and, as the real namespace controller would, everything in it.

        There is no namespace controller here; objects with finalizers only get their
        deletionTimestamp (as in a real cluster) and go once their finalizers are removed."""
        for prefix, plural in self._namespaced_collections():
            self.request("DELETE", f"{prefix}/namespaces/{name}/{plural}")
        self.request("DELETE", f"/api/v1/namespaces/{name}")

    def _namespaced_collections(self) -> list[tuple[str, str]]:
        """(group-version path, plural) of every namespaced resource that has deletecollection."""
        prefixes = ["/api/v1"]
        status, groups = self.request("GET", "/apis")
        if status == 200:
            prefixes += [f"/apis/{v['groupVersion']}" for g in groups["groups"] for v in g["versions"]]
        found = []
        for prefix in prefixes:
            status, resources = self.request("GET", prefix)
            for res in resources.get("resources", []) if status == 200 else []:
                if (
                    res.get("namespaced")
                    and "/" not in res["name"]
                    and "deletecollection" in res.get("verbs", [])
                ):
                    found.append((prefix, res["name"]))
        return found
