"""Helpers for the operator's unit tests: jobs as the API server stores them, and observations built
from a plan's own manifests (the test plays the API server and the kubelet)."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from polyrl_operator.api.progress import Progress
from polyrl_operator.observed import Child, Observed, summarize
from polyrl_operator.planning import Plan
from polyrl_operator.settings import Autoscale, OperatorSettings
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, EXAMPLES

PROGRESS_SAMPLES = Path(__file__).resolve().parents[2] / "operator" / "data" / "progress"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
# The autoscaler acts on its first reading and the metrics server is off: plans follow inputs at once.
SETTINGS = OperatorSettings(autoscale=Autoscale(out_window=0, in_window=0, cooldown=0), metrics_port=None)
UID = "3f1c2a9e-0000-4000-8000-000000000001"
# The pods of the CPU example job (`CPU_EXAMPLE`): the coordinator, the workflow worker, and a rollout
# and a trainer per policy.
SIGNAL_GAME_PODS = frozenset(
    {
        "signal-game-coordinator",
        "signal-game-workflow-0",
        "signal-game-speaker-rollout-0",
        "signal-game-speaker-trainer-0",
        "signal-game-listener-rollout-0",
        "signal-game-listener-trainer-0",
    }
)


def stored_job(
    path: Path = CPU_EXAMPLE, *, name: str | None = None, namespace: str = "team-a", uid: str = UID
) -> dict[str, Any]:
    """An example RLJob as the API server returns it (uid, generation, our finalizer)."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    meta = doc.setdefault("metadata", {})
    meta.update(
        name=name or meta["name"],
        namespace=namespace,
        uid=uid,
        generation=1,
        resourceVersion="1",
        finalizers=["polyrl.dev/cleanup"],
    )
    return doc


def gpu_job(**kwargs: Any) -> dict[str, Any]:
    return stored_job(EXAMPLES / "debate-gpu.yaml", **kwargs)


def _place(doc: dict[str, Any], pool: dict[str, Any], roles: list[tuple[int, str]]) -> dict[str, Any]:
    """``doc`` with ``pool`` added to spec.pools and each (policy index, role) placed on it (its
    replicas, gpus, gpuType and pod settings removed: the pool sets them)."""
    spec = doc["spec"]
    spec.setdefault("pools", []).append(pool)
    for i, role in roles:
        settings = spec["policies"][i].setdefault(role, {})
        for key in ("replicas", "gpus", "gpuType", "image", "resources", "env", "podTemplate"):
            settings.pop(key, None)
        settings["pool"] = pool["name"]
    return doc


def pooled_gpu_job(**kwargs: Any) -> dict[str, Any]:
    """debate-gpu.yaml with a device pool ``h100`` of 2 to 4 pods of 8 H100s: the proposer's rollout
    and trainer and the critic's rollout run on it; the critic's trainer and the judge keep pods of
    their own. Weights through `auto` (the proposer's: objectstore; collective would put its trainer
    rank 0 and pod 0's engine on one GPU as two NCCL ranks)."""
    pool = {"name": "h100", "replicas": {"min": 2, "max": 4}, "gpus": 8, "gpuType": "h100"}
    doc = _place(gpu_job(**kwargs), pool, [(0, "rollout"), (0, "trainer"), (1, "rollout")])
    doc["spec"]["weightSync"]["transport"] = "auto"
    return doc


def pooled_cpu_job(**kwargs: Any) -> dict[str, Any]:
    """signal-game-cpu.yaml with a CPU pool ``shared`` of 1 to 3 pods: the speaker's rollout and
    trainer and the listener's rollout run on it; the listener's trainer keeps a pod of its own."""
    pool = {
        "name": "shared",
        "replicas": {"min": 1, "max": 3},
        "gpus": 0,
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
    }
    return _place(stored_job(**kwargs), pool, [(0, "rollout"), (0, "trainer"), (1, "rollout")])


def progress(sample: str, **replace: str) -> Progress:
    text = (PROGRESS_SAMPLES / f"{sample}.json").read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    return Progress.model_validate_json(text)


def pod_status(phase: str = "Running", ready: bool = True, **extra: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready and phase == "Running" else "False"},
        ],
    }
    status.update(extra)
    return status


def children_of(
    plan: Plan,
    *,
    pod_status_for: dict[str, dict[str, Any]] | None = None,
    default_status: dict[str, Any] | None = None,
    annotations: dict[str, dict[str, str]] | None = None,
) -> list[Child]:
    """What the API server would hold after applying ``plan`` (each pod with the given status)."""
    out = []
    for (kind, name), manifest in plan.desired.items():
        body = copy.deepcopy(manifest)
        if kind == "Pod":
            body["status"] = (pod_status_for or {}).get(name, default_status or {"phase": "Pending"})
            for key, value in (annotations or {}).get(name, {}).items():
                body["metadata"]["annotations"][key] = value
        out.append(summarize(kind, body))
    return out


def with_status(job: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The job after the operator wrote ``plan.status``."""
    out = copy.deepcopy(job)
    out["status"] = json.loads(json.dumps(plan.status.to_k8s() if plan.status else {}))
    return out


def later(seconds: float, start: datetime = T0) -> datetime:
    return start + timedelta(seconds=seconds)


def observed(children: list[Child], prog: Progress | None = None, **kwargs: Any) -> Observed:
    return Observed(children=children, progress=prog, **kwargs)


class Sim:
    """The reconciler against the in-memory API, driven step by step by a test.

    The test plays the kubelet (pod status), the runtime (``progress``), Kueue (Workload status)
    and the clock; each ``step()`` is exactly one reconcile, with the kicks it asked for recorded
    instead of scheduled, so nothing happens behind the test's back."""

    def __init__(self, job: dict[str, Any], settings: Any = None) -> None:
        from polyrl_operator.kinds import KIND_NAMES
        from polyrl_operator.reconciling import Reconciler
        from polyrl_operator.reconciling.observe import Observer, ProgressReading
        from polyrl_operator.settings import Autoscale, OperatorSettings
        from polyrl_testenv.fake_api import FakeApi

        self.api = FakeApi()
        self.now = T0
        self.progress: Progress | None = None
        self.kicks: list[float] = []
        sim = self
        self.settings = settings or OperatorSettings(
            autoscale=Autoscale(out_window=0, in_window=0, cooldown=0), metrics_port=None
        )

        class _Reconciler(Reconciler):
            def kick(self, key: tuple[str, str], delay: float = 0.0) -> None:
                sim.kicks.append(delay)

        class _Observer(Observer):
            async def progress_of(self, key: tuple[str, str]) -> ProgressReading:
                return ProgressReading(sim.progress, None if sim.progress else "no progress", fresh=False)

        self.reconciler = _Reconciler(
            self.api, self.settings, clock=lambda: self.now, observer=_Observer(self.api, self.settings)
        )
        for kind in KIND_NAMES:
            self.reconciler.indexes[kind] = self.api.index(kind)
        meta = job["metadata"]
        self.key = (meta["namespace"], meta["name"])
        job = copy.deepcopy(job)
        for field in ("uid", "resourceVersion", "finalizers", "generation"):
            meta = job["metadata"]
            meta.pop(field, None)
        self.api._create("rljobs", self.key[0], job)

    @property
    def job(self) -> dict[str, Any]:
        return self.api.obj("rljobs", self.key[1], self.key[0])

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.job.get("status") or {})

    def condition(self, ctype: str) -> dict[str, Any]:
        return next(c for c in self.status.get("conditions") or [] if c["type"] == ctype)

    async def step(self, seconds: float = 1.0) -> Plan | None:
        from datetime import timedelta

        self.now += timedelta(seconds=seconds)
        self.kicks.clear()
        self.reconciler.update_job(copy.deepcopy(self.job))
        return await self.reconciler.reconcile(self.key)

    async def converge(self, steps: int = 6) -> None:
        for _ in range(steps):
            await self.step()

    def pods(self) -> set[str]:
        return self.api.names("pods", self.key[0])

    def kubelet(self, phase: str = "Running", ready: bool = True, only: set[str] | None = None) -> None:
        for name in self.pods():
            if only is None or name in only:
                self.api.set_pod_status(name, pod_status(phase, ready), self.key[0])

    def replace_spec(self, spec: dict[str, Any]) -> None:
        job = self.api.objects[("rljobs", self.key[0], self.key[1])]
        job["spec"] = copy.deepcopy(spec)
        job["metadata"]["generation"] += 1

    def patch_spec(self, spec: dict[str, Any]) -> None:

        key = ("rljobs", self.key[0], self.key[1])
        self.api._patch(key, self.api.objects[key], {"spec": spec}, None)
