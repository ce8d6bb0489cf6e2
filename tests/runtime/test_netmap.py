"""The test kubelet's address map: honoured only when POLYRL_NETMAP names a file."""

from __future__ import annotations

import json
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


def test_free_ports_stay_out_of_the_ephemeral_range() -> None:
    low = netmap._ephemeral_low()
    ports = {netmap.free_port() for _ in range(50)}
    assert all(20000 <= p <= min(26999, low - 1) for p in ports) and len(ports) > 40
    assert all(27000 <= netmap.free_port(27000, 32767) < low for _ in range(10))
