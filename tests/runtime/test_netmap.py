"""The test kubelet's address map: honoured only when POLYRL_NETMAP names a file."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl_runtime import netmap
from polyrl_runtime.config import PodEnv


def test_without_a_map_addresses_and_ports_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLYRL_NETMAP", raising=False)
    assert netmap.resolve("job-coordinator.ns.svc:6379") == "job-coordinator.ns.svc:6379"
    assert netmap.listen_port(8000) == 8000


def test_a_map_gives_each_pod_its_ports_and_resolves_service_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "netmap.json"
    path.write_text(
        json.dumps(
            {
                "pods": {"ns/job-coordinator": {"8000": 41000, "6379": 41001}},
                "endpoints": {"job-coordinator.ns.svc:6379": "127.0.0.1:41001"},
            }
        )
    )
    monkeypatch.setenv("POLYRL_NETMAP", str(path))
    monkeypatch.setenv("POLYRL_NAMESPACE", "ns")
    monkeypatch.setenv("POLYRL_POD_NAME", "job-coordinator")
    assert netmap.resolve("job-coordinator.ns.svc:6379") == "127.0.0.1:41001"
    assert netmap.resolve("elsewhere:1") == "elsewhere:1"
    assert netmap.listen_port(6379) == 41001 and netmap.listen_port(29500) == 29500
    assert PodEnv.from_env().http_port == 41000
    monkeypatch.setenv("POLYRL_POD_NAME", "job-workflow-0")  # a pod the map does not know
    assert netmap.listen_port(8000) == 8000


def test_free_ports_stay_out_of_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYRL_PORT_REGISTRY", str(tmp_path / "ports.json"))  # not the host's
    low = netmap._ephemeral_low()
    ports = {netmap.free_port() for _ in range(50)}
    assert all(20000 <= p <= min(26999, low - 1) for p in ports) and len(ports) > 40
    assert all(27000 <= netmap.free_port(27000, 32767) < low for _ in range(10))


def _free_range(size: int) -> int:
    """The start of `size` consecutive ports in our range that are all free now."""
    for _ in range(100):
        low = random.randint(20000, 26999 - size)
        if all(netmap._bindable(p) is not None for p in range(low, low + size)):
            return low
    raise AssertionError("no free range")


PICK = "import json, sys; from polyrl_runtime import netmap; lo = int(sys.argv[1]); " + (
    "print(json.dumps([netmap.free_port(lo, lo + 239) for _ in range(40)]))"
)


def test_processes_picking_at_once_never_get_the_same_port(tmp_path: Path) -> None:
    """Six pods starting together each pick ports before any binds: "free now" alone gave two Ray nodes
    the same port (CI). Four processes take 40 ports each from 240 without binding them: no two alike
    (without the registry, 160 picks from 240 collide all but surely). Each has its own TMPDIR, as each
    pod of the test kubelet does: the registry is host-wide all the same."""
    low = _free_range(240)
    procs = []
    for i in range(4):
        env = {**os.environ, "POLYRL_PORT_REGISTRY": str(tmp_path / "ports.json")}
        env["TMPDIR"] = str(tmp_path / f"pod-{i}")
        (tmp_path / f"pod-{i}").mkdir()
        procs.append(
            subprocess.Popen([sys.executable, "-c", PICK, str(low)], env=env, stdout=subprocess.PIPE)
        )
    picks = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        picks += json.loads(out.splitlines()[-1])  # above it: a process's log of its lock waits
    assert len(picks) == 160 and len(set(picks)) == 160
    assert all(low <= p < low + 240 for p in picks)


def test_a_reservation_expires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYRL_PORT_REGISTRY", str(tmp_path / "ports.json"))
    low = _free_range(2)
    held = {netmap.free_port(low, low + 1), netmap.free_port(low, low + 1)}
    assert held == {low, low + 1}
    assert netmap.free_port(low, low + 1) not in held  # both reserved: another free port instead
    (tmp_path / "ports.json").write_text(json.dumps({low: 0.0, low + 1: 0.0}))
    assert netmap.free_port(low, low + 1) in held  # expired: handed out again


def test_a_torn_registry_is_started_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYRL_PORT_REGISTRY", str(tmp_path / "ports.json"))
    (tmp_path / "ports.json").write_text('{"2')
    port = netmap.free_port()
    assert json.loads((tmp_path / "ports.json").read_text()).keys() == {str(port)}
