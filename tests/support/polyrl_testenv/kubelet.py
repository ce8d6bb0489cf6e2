"""A test kubelet: runs the control plane's pods as local processes (the e2e tier only).

It polls the pods of the namespaces it serves and, for each new pod, materialises its volumes
(ConfigMap and Secret keys as files, the downward API's `labels` and `annotations`, emptyDirs, a
shared directory per PersistentVolumeClaim) under a per-pod directory, rewrites every env value and
argument that holds a mount path (also inside JSON) to that directory, resolves `valueFrom` (secretKeyRef,
configMapKeyRef, fieldRef), and starts each container's command and args as a process group with
the pod's env, `HOSTNAME` and a working dir. Image names are ignored: the local venv stands in.

Networking: all pods share 127.0.0.1, so each pod gets its own free host port for every
containerPort, kept for the pod name's life (a recreated pod keeps its address, as a Service's
ClusterIP would). The map of those ports and of the Service DNS names they stand for is the JSON file
`POLYRL_NETMAP` that the runtime honours (polyrl_runtime.netmap). The operator, which is not a pod,
reaches Services through this kubelet's proxy (kubeproxy.py):
`http://127.0.0.1:<proxy_port>/<ns>/<svc>/<port>/...`.

Status, as the real kubelet reports it for `restartPolicy: Never`: Running with `podIP 127.0.0.1`
once started; the Ready condition from the readiness probe (httpGet, probed every `probe_period`
seconds instead of the pod's own period, to keep tests short); Succeeded when every container exits
0, Failed otherwise, with each container's exit code. A deleted pod's processes get SIGTERM, then
SIGKILL after its grace period. `kill()` crashes a pod's processes, as a node failure would.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from polyrl_operator.pod_contract import ENV_NETMAP
from polyrl_runtime.netmap import free_port
from polyrl_testenv.kubeproxy import ServiceProxy
from polyrl_testenv.operator_proc import SyncApi

Obj = dict[str, Any]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (read from /proc before anything is killed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_tree(pid: int, sig: int) -> None:
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def _downward(values: dict[str, str]) -> str:
    return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(values.items()))


@dataclass
class PodRun:
    """One pod instance (one uid) this kubelet started."""

    namespace: str
    name: str
    uid: str
    directory: Path
    started_at: float
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ready: bool = False
    phase: str = "Running"
    annotations: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, Path] = field(default_factory=dict)  # volume name -> host directory
    last_probe: float = 0.0


class TestKubelet:
    __test__ = False  # not a pytest test class

    def __init__(
        self,
        server: str,
        namespaces: list[str],
        *,
        probe_period: float = 1.0,
    ) -> None:
        self.api = SyncApi(server)
        self.namespaces = list(namespaces)
        self.probe_period = probe_period
        # short: Ray's unix sockets live under the pods' TMPDIR and paths are limited to 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="pk", dir="/tmp"))
        self.netmap_path = self.root / "netmap.json"
        self.netmap_path.write_text("{}")
        self.runs: dict[str, PodRun] = {}  # by uid, every pod instance ever started
        self.ports: dict[str, dict[int, int]] = {}  # "<ns>/<pod>" -> containerPort -> host port
        self.endpoints: dict[str, str] = {}
        self.errors: list[str] = []
        self._dying: dict[tuple[str, str], list[subprocess.Popen[bytes]]] = {}  # deleted, still exiting
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="test-kubelet", daemon=True)
        self.proxy = ServiceProxy(self._resolve)
        self.proxy_port = self.proxy.port

    # -- public -----------------------------------------------------------------------------------

    def start(self) -> TestKubelet:
        self.proxy.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.proxy.stop()
        # Every pod at once, under one grace period: the pods of a job shut down side by side.
        self._terminate([proc for run in self.runs.values() for proc in run.procs.values()], grace=5.0)

    def serve(self, namespace: str) -> None:
        with self._lock:
            self.namespaces.append(namespace)

    def progress_url(self) -> str:
        """The operator's `progressUrl` setting that reaches coordinators through the proxy."""
        return f"http://127.0.0.1:{self.proxy_port}/{{namespace}}/{{service}}/{{port}}"

    def current(self, namespace: str, name: str) -> PodRun | None:
        alive = [r for r in self.runs.values() if (r.namespace, r.name) == (namespace, name)]
        return max(alive, key=lambda r: r.started_at) if alive else None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Crash the pod's processes (all of them, Ray's included), as a node failure would."""
        run = self.current(namespace, name)
        assert run is not None, f"no pod {namespace}/{name} was started"
        deadline = time.monotonic() + 30  # the run is listed just before its processes start
        while not run.procs and run.phase == "Running" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.procs, f"pod {namespace}/{name} has no running processes"
        for proc in run.procs.values():
            _signal_tree(proc.pid, sig)

    def started(self, namespace: str) -> list[PodRun]:
        return sorted((r for r in self.runs.values() if r.namespace == namespace), key=lambda r: r.started_at)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.root.glob("*/*.log")))

    # -- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                namespaces = list(self.namespaces)
            for ns in namespaces:
                try:
                    self._sync(ns)
                except Exception as e:  # a fixture must not die silently: tests assert on errors
                    self.errors.append(f"{ns}: {type(e).__name__}: {e}")
            self._stop.wait(0.5)

    def _sync(self, ns: str) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.api.list(f"/api/v1/namespaces/{ns}/pods")}
        for run in [r for r in self.runs.values() if r.namespace == ns and r.procs]:
            if run.uid not in pods or pods[run.uid]["metadata"].get("deletionTimestamp"):
                grace = float(pods.get(run.uid, {}).get("spec", {}).get("terminationGracePeriodSeconds", 30))
                procs, run.procs, run.phase = list(run.procs.values()), {}, "Deleted"
                self._dying[(ns, run.name)] = procs
                threading.Thread(target=self._terminate, args=(procs, grace), daemon=True).start()
        for uid, pod in pods.items():
            phase = (pod.get("status") or {}).get("phase")
            fresh = uid not in self.runs and not pod["metadata"].get("deletionTimestamp")
            # A name is reused only once the old pod's processes are gone, as on a node, where the
            # old pod object stays Terminating until then (this API server deletes at once).
            dying = self._dying.get((ns, pod["metadata"]["name"]), [])
            if fresh and phase not in ("Succeeded", "Failed") and all(p.poll() is not None for p in dying):
                self._start(pod)
        self._write_netmap(ns, list(pods.values()))
        for uid, pod in pods.items():
            current = self.runs.get(uid)
            if current is not None and current.procs:
                self._refresh(current, pod)

    # -- pods -------------------------------------------------------------------------------------

    def _start(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        directory = self.root / str(len(self.runs))
        run = PodRun(ns, name, meta["uid"], directory, time.monotonic())
        self.runs[run.uid] = run
        ports = self.ports.setdefault(f"{ns}/{name}", {})
        for c in spec["containers"]:
            for p in c.get("ports") or []:
                if int(p["containerPort"]) not in ports:  # our own range: see polyrl_runtime.netmap
                    taken = {h for pod_ports in self.ports.values() for h in pod_ports.values()}
                    port = free_port(27000, 32767)
                    while port in taken:
                        port = free_port(27000, 32767)
                    ports[int(p["containerPort"])] = port
        mounts = run.mounts = self._volumes(pod, directory)
        run.annotations = dict(meta.get("annotations") or {})
        hostname = spec.get("hostname") or name
        for c in spec["containers"]:
            paths = {m["mountPath"].rstrip("/"): str(mounts[m["name"]]) for m in c.get("volumeMounts") or []}
            # every mount path in a value (also inside JSON), longest first, in one pass
            pattern = re.compile(
                r"(?<![\w./-])("
                + "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
                + r")(?=[/\"]|$)"
            )

            def rewrite(value: str, paths: dict[str, str] = paths, pattern: re.Pattern[str] = pattern) -> str:
                return pattern.sub(lambda found: paths[found.group(1)], value) if paths else value

            env = {
                "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                "HOME": str(directory / "home"),
                "HOSTNAME": hostname,
                ENV_NETMAP: str(self.netmap_path),
            }
            for var in c.get("env") or []:
                env[var["name"]] = (
                    rewrite(var["value"])
                    if "valueFrom" not in var
                    else self._value_from(pod, var["valueFrom"])
                )
            argv = [rewrite(a) for a in [*(c.get("command") or []), *(c.get("args") or [])]]
            (directory / "home").mkdir(parents=True, exist_ok=True)
            with (directory / f"{c['name']}.log").open("ab") as out:
                run.procs[c["name"]] = subprocess.Popen(
                    argv, env=env, cwd=directory, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        self._status(run, pod)

    def _volumes(self, pod: Obj, directory: Path) -> dict[str, Path]:
        ns, out = pod["metadata"]["namespace"], {}
        for i, vol in enumerate(pod["spec"].get("volumes") or []):
            path = directory / f"v{i}"  # short: see root
            path.mkdir(parents=True, exist_ok=True)
            out[vol["name"]] = path
            if "configMap" in vol or "secret" in vol:
                src = vol.get("configMap") or vol["secret"]
                kind, ref = (
                    ("configmaps", src["name"]) if "configMap" in vol else ("secrets", src["secretName"])
                )
                code, obj = self.api.call("GET", f"/api/v1/namespaces/{ns}/{kind}/{ref}")
                assert code == 200, f"pod {pod['metadata']['name']}: volume {vol['name']}: {obj}"
                for key, value in (obj.get("data") or {}).items():
                    data = base64.b64decode(value) if kind == "secrets" else value.encode()
                    (path / key).write_bytes(data)
            elif "persistentVolumeClaim" in vol:
                claim = self.root / "pvc" / ns / vol["persistentVolumeClaim"]["claimName"]
                claim.mkdir(parents=True, exist_ok=True)
                path.rmdir()
                out[vol["name"]] = claim
        self._write_downward(pod, out)
        return out

    def _write_downward(self, pod: Obj, mounts: dict[str, Path]) -> None:
        meta = pod["metadata"]
        for vol in pod["spec"].get("volumes") or []:
            for item in (vol.get("downwardAPI") or {}).get("items") or []:
                field_path = item["fieldRef"]["fieldPath"]
                values = meta.get("labels" if field_path == "metadata.labels" else "annotations") or {}
                target = mounts[vol["name"]] / item["path"]
                tmp = target.with_suffix(".tmp")  # atomic, as the kubelet's symlink swap is
                tmp.write_text(_downward(values))
                tmp.replace(target)

    def _value_from(self, pod: Obj, source: Obj) -> str:
        ns, meta = pod["metadata"]["namespace"], pod["metadata"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            simple = {
                "metadata.name": meta["name"],
                "metadata.namespace": ns,
                "metadata.uid": meta["uid"],
                "status.podIP": "127.0.0.1",
                "status.hostIP": "127.0.0.1",
                "spec.nodeName": "test-kubelet",
                "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            }
            if path in simple:
                return str(simple[path])
            for prefix in ("labels", "annotations"):
                if path.startswith(f"metadata.{prefix}['"):
                    return str((meta.get(prefix) or {}).get(path.split("'")[1], ""))
            raise ValueError(f"fieldRef {path} is not supported by the test kubelet")
        kind, ref = (
            ("secrets", source["secretKeyRef"])
            if "secretKeyRef" in source
            else ("configmaps", source["configMapKeyRef"])
        )
        code, obj = self.api.call("GET", f"/api/v1/namespaces/{ns}/{kind}/{ref['name']}")
        assert code == 200, f"pod {meta['name']}: {kind}/{ref['name']}: {obj}"
        value = (obj.get("data") or {})[ref["key"]]
        return base64.b64decode(value).decode() if kind == "secrets" else str(value)

    def _refresh(self, run: PodRun, pod: Obj) -> None:
        annotations = dict(pod["metadata"].get("annotations") or {})
        if annotations != run.annotations:
            run.annotations = annotations
            self._write_downward(pod, run.mounts)
        codes = {n: p.poll() for n, p in run.procs.items()}
        if all(c is not None for c in codes.values()):
            run.phase = "Succeeded" if all(c == 0 for c in codes.values()) else "Failed"
            run.ready = False
            self._status(run, pod, codes)
            run.procs = {}
            return
        now = time.monotonic()
        if now - run.last_probe >= self.probe_period:
            run.last_probe = now
            ready = all(self._probe(run, c) for c in pod["spec"]["containers"])
            if ready != run.ready:
                run.ready = ready
                self._status(run, pod)

    def _probe(self, run: PodRun, container: Obj) -> bool:
        get = (container.get("readinessProbe") or {}).get("httpGet")
        if get is None:
            return True
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
        host_port = self.ports[f"{run.namespace}/{run.name}"][int(port)]
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{host_port}{get.get('path', '/')}", timeout=1
            ) as r:
                return bool(200 <= r.status < 400)
        except (OSError, urllib.error.HTTPError):
            return False

    def _status(self, run: PodRun, pod: Obj, codes: dict[str, int | None] | None = None) -> None:
        def state(name: str) -> Obj:
            code = (codes or {}).get(name)
            if code is None:
                return {"running": {"startedAt": _now()}}
            exit_code = code if code >= 0 else 128 - code  # killed by a signal: 128 + signal
            return {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "finishedAt": _now(),
                }
            }

        ready = "True" if run.ready else "False"
        status = {
            "phase": run.phase,
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "ready": run.ready,
                    "restartCount": 0,
                    "state": state(c["name"]),
                }
                for c in pod["spec"]["containers"]
            ],
        }
        path = f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status"
        code, body = self.api.merge(path, {"metadata": {"uid": run.uid}, "status": status})
        if code not in (200, 404, 409):  # gone or replaced meanwhile: nothing to report
            self.errors.append(f"{run.namespace}/{run.name}: status update: HTTP {code}: {body}")

    @staticmethod
    def _terminate(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
        for proc in procs:
            _signal_tree(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()

    # -- networking -------------------------------------------------------------------------------

    def _write_netmap(self, ns: str, pods: list[Obj]) -> None:
        live = [p for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        endpoints = {k: v for k, v in self.endpoints.items() if f".{ns}.svc:" not in k}
        for svc in self.api.list(f"/api/v1/namespaces/{ns}/services"):
            name, spec = svc["metadata"]["name"], svc["spec"]
            selector = spec.get("selector") or {}
            chosen = [
                p for p in live
                if selector and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]  # fmt: skip
            for port in spec.get("ports") or []:
                target = int(port.get("targetPort", port["port"]))
                for p in chosen:
                    host_port = self.ports.get(f"{ns}/{p['metadata']['name']}", {}).get(target)
                    if host_port is None:
                        continue
                    if spec.get("clusterIP") == "None" and p["spec"].get("subdomain") == name:
                        hostname = p["spec"].get("hostname") or p["metadata"]["name"]
                        endpoints[f"{hostname}.{name}.{ns}.svc:{port['port']}"] = f"127.0.0.1:{host_port}"
                    elif spec.get("clusterIP") != "None":
                        endpoints.setdefault(f"{name}.{ns}.svc:{port['port']}", f"127.0.0.1:{host_port}")
        doc = {
            "pods": {k: {str(c): h for c, h in v.items()} for k, v in self.ports.items()},
            "endpoints": endpoints,
        }
        if endpoints != self.endpoints or not self.netmap_path.read_text().startswith('{"pods"'):
            self.endpoints = endpoints
            tmp = self.netmap_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(self.netmap_path)

    def _resolve(self, ns: str, svc: str, port: str) -> tuple[str, str] | None:
        """Where the proxy sends a request for `svc`'s `port` in `ns`, and which pod listens there."""
        target = self.endpoints.get(f"{svc}.{ns}.svc:{port}")
        if target is None:
            return None
        host_port = int(target.rsplit(":", 1)[1])
        pods = list(self.ports.items())  # a copy: the kubelet's loop adds pods meanwhile
        return target, next((pod for pod, ports in pods if host_port in ports.values()), "?")
