"""Leader election (polyrl_operator.leader): the pure decisions, table-driven, and two real operator
processes against the control plane: one leads and reconciles while the other waits and says so; the
leader is SIGKILLed and the standby takes the Lease and reconciles a change; a leader whose Lease is
taken stops with a non-zero exit; a leader stopped cleanly releases the Lease."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import pytest
import yaml

from polyrl_operator.leader import LeaseRecord, Observation, decide, lease_body, observe, standby_probe
from polyrl_operator.settings import LeaderElection
from polyrl_testenv import ControlPlane
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE, REPO
from polyrl_testenv.controlplane import free_port
from polyrl_testenv.operator_proc import SyncApi, kill, start_operator

T = TypeVar("T")
ME = "op-a_1234"


def record(holder: str = "op-b_9", renew: str | None = "t1", duration: float = 15) -> LeaseRecord:
    return LeaseRecord(
        holder=holder, lease_duration=duration, renew_time=renew, transitions=2, resource_version="7"
    )


# ---- pure decisions -------------------------------------------------------------------------------

DECIDE_CASES: list[tuple[str, Observation | None, float, str]] = [
    ("no lease: create it", None, 100.0, "create"),
    ("ours: renew", Observation(record(holder=ME), 0.0), 100.0, "renew"),
    ("released (no holder): take", Observation(record(holder=""), 99.0), 100.0, "take"),
    ("held, renewed recently: wait", Observation(record(), 90.0), 100.0, "wait"),
    ("held, unchanged for the lease duration: take", Observation(record(), 85.0), 100.0, "take"),
    ("the lease's own duration wins", Observation(record(duration=30), 85.0), 100.0, "wait"),
    ("no duration in the lease: the configured one", Observation(record(duration=0), 85.0), 100.0, "take"),
]


@pytest.mark.parametrize(
    ("case", "observation", "now", "expected"), DECIDE_CASES, ids=[c[0] for c in DECIDE_CASES]
)
def test_decide(case: str, observation: Observation | None, now: float, expected: str) -> None:
    assert decide(observation, ME, now, lease_duration=15) == expected


OBSERVE_CASES: list[tuple[str, Observation | None, LeaseRecord, float]] = [
    ("first sight starts the clock", None, record(), 50.0),
    ("unchanged record keeps the clock", Observation(record(), 10.0), record(), 10.0),
    ("a renewal restarts the clock", Observation(record(renew="t1"), 10.0), record(renew="t2"), 50.0),
    ("a new holder restarts the clock", Observation(record(holder="x"), 10.0), record(holder="y"), 50.0),
]


@pytest.mark.parametrize(
    ("case", "previous", "seen", "since"), OBSERVE_CASES, ids=[c[0] for c in OBSERVE_CASES]
)
def test_observe(case: str, previous: Observation | None, seen: LeaseRecord, since: float) -> None:
    assert observe(previous, seen, now=50.0) == Observation(seen, since)


NOW = dt.datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=dt.UTC)
BODY_CASES: list[tuple[str, LeaseRecord | None, dict[str, Any]]] = [
    ("create", None, {"acquireTime": "2026-01-02T03:04:05.600000Z", "leaseTransitions": 0}),
    ("take from another", record(), {"acquireTime": "2026-01-02T03:04:05.600000Z", "leaseTransitions": 3}),
    (
        "take a released lease",
        record(holder=""),
        {"acquireTime": "2026-01-02T03:04:05.600000Z", "leaseTransitions": 0},
    ),
    ("renew keeps acquireTime and transitions", record(holder=ME), {}),
]


@pytest.mark.parametrize(("case", "previous", "extra"), BODY_CASES, ids=[c[0] for c in BODY_CASES])
def test_lease_body(case: str, previous: LeaseRecord | None, extra: dict[str, Any]) -> None:
    body = lease_body(LeaderElection(enabled=True), ME, NOW, previous=previous)
    common = {"holderIdentity": ME, "leaseDurationSeconds": 15, "renewTime": "2026-01-02T03:04:05.600000Z"}
    assert body == {"spec": {**common, **extra}}


def test_timings_must_be_ordered() -> None:
    with pytest.raises(pydantic.ValidationError, match="retryPeriod < renewDeadline < leaseDuration"):
        LeaderElection.model_validate({"leaseDuration": 5, "renewDeadline": 5})


def test_a_standby_answers_the_liveness_probe_until_it_leads() -> None:
    url = f"http://127.0.0.1:{free_port()}/healthz"

    def get() -> int:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)

    async def probe() -> tuple[int, bool]:
        async with standby_probe(url):
            during = await asyncio.to_thread(get)
        try:
            await asyncio.to_thread(get)
        except OSError:
            return during, True  # closed: kopf's own endpoint takes the port
        return during, False

    assert asyncio.run(probe()) == (200, True)


# ---- two operators against the control plane --------------------------------------------------------

LEASE_DURATION = 4.0


def wait_for(
    check: Callable[[], T | None], what: str, timeout: float = 60.0, logs: tuple[Path, ...] = ()
) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    tails = "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-20:]) for p in logs if p.exists()
    )
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{tails}")


@pytest.fixture
def crd(controlplane: ControlPlane) -> ControlPlane:
    result = controlplane.kubectl(
        "apply", "--server-side", "-f", str(REPO / "crds" / "polyrl.dev_rljobs.yaml")
    )
    assert result.returncode == 0, result.stderr
    controlplane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rljobs.polyrl.dev")
    return controlplane


class Pair:
    """Operators started with leader election on one Lease in ``namespace``."""

    def __init__(self, cp: ControlPlane, namespace: str, workdir: Path) -> None:
        self.cp, self.ns, self.workdir = cp, namespace, workdir
        self.api = SyncApi(cp.server)
        self.lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/polyrl-operator"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.settings = {
            "resyncSeconds": 1,
            "errorBackoff": 0.2,
            "errorBackoffMax": 1,
            "progressTimeout": 0.5,
            "leaderElection": {
                "enabled": True,
                "leaseNamespace": namespace,
                "leaseDuration": LEASE_DURATION,
                "renewDeadline": 3,
                "retryPeriod": 0.5,
            },
        }

    def start(self, tag: str) -> subprocess.Popen[bytes]:
        workdir = self.workdir / tag
        workdir.mkdir()
        self.procs[tag] = start_operator(self.cp.kubeconfig, self.ns, self.settings, workdir, tag)
        return self.procs[tag]

    def log(self, tag: str) -> Path:
        return self.workdir / tag / f"operator-{tag}.log"

    def logs(self) -> tuple[Path, ...]:
        return tuple(self.log(tag) for tag in self.procs)

    def identity(self, tag: str) -> str | None:
        for line in self.log(tag).read_text().splitlines():
            if "leader election: starting" in line and '"identity"' in line:
                return str(yaml.safe_load(line)["identity"])
        return None

    def holder(self) -> str:
        code, lease = self.api.call("GET", self.lease_path)
        return str((lease.get("spec") or {}).get("holderIdentity") or "") if code == 200 else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill(proc)


@pytest.fixture
def pair(crd: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Pair]:
    operators = Pair(crd, namespace, tmp_path)
    try:
        yield operators
    finally:
        operators.stop()


def _job(namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"] = {"name": "elected", "namespace": namespace}
    return doc


def test_standby_takes_over_after_the_leader_is_killed(pair: Pair, namespace: str) -> None:
    rljob = f"/apis/polyrl.dev/v1alpha1/namespaces/{namespace}/rljobs/elected"
    first = pair.start("a")
    a = wait_for(lambda: pair.identity("a"), "operator a to start", logs=pair.logs())
    wait_for(lambda: pair.holder() == a, "operator a to take the Lease", logs=pair.logs())
    second = pair.start("b")
    b = wait_for(lambda: pair.identity("b"), "operator b to start", logs=pair.logs())
    wait_for(lambda: "standby, waiting for the Lease" in pair.log("b").read_text(), "b to say it waits")
    assert a in pair.log("b").read_text()  # the standby names the holder it waits for

    result = pair.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(_job(namespace)))
    assert result.returncode == 0, result.stderr

    def reconciled() -> dict[str, Any] | None:
        code, obj = pair.api.call("GET", rljob)
        done = (
            code == 200
            and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
        )
        return obj if done else None

    wait_for(reconciled, "the leader to reconcile the RLJob", logs=pair.logs())
    assert pair.holder() == a and second.poll() is None
    assert "elected" not in pair.log("b").read_text()  # the standby never handled the job

    kill(first)
    killed = time.monotonic()
    wait_for(lambda: pair.holder() == b, "operator b to take the Lease", timeout=60, logs=pair.logs())
    # The standby saw a's last renewal at most one retry period before the kill, and tries every
    # retry period: it takes over within the lease duration plus scheduling slack of this machine.
    assert time.monotonic() - killed < LEASE_DURATION + 5
    code, changed = pair.api.merge(rljob, {"spec": {"suspend": True}})
    assert code == 200, changed
    obj = wait_for(reconciled, "the new leader to reconcile the change", logs=pair.logs())
    assert obj["metadata"]["generation"] == changed["metadata"]["generation"]

    second.send_signal(signal.SIGTERM)  # a clean stop releases the Lease at once
    assert second.wait(timeout=60) == 0, pair.log("b").read_text()[-3000:]
    assert pair.holder() == ""


def test_a_leader_that_loses_its_lease_stops_with_an_error(pair: Pair) -> None:
    leader = pair.start("a")
    a = wait_for(lambda: pair.identity("a"), "operator a to start", logs=pair.logs())
    wait_for(lambda: pair.holder() == a, "operator a to take the Lease", logs=pair.logs())
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    code, body = pair.api.merge(pair.lease_path, {"spec": {"holderIdentity": "intruder", "renewTime": stamp}})
    assert code == 200, body
    assert leader.wait(timeout=60) == 1
    text = pair.log("a").read_text()
    assert "lost the Lease" in text and "intruder" in text
