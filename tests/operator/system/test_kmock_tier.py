"""The fast API tier: kopf's own Kubernetes emulator (kmock) serves RLJobs as the real server would.

Handler tests of the operator build on this fixture; here we check that the emulator knows the RLJob
resource from the generated CRD's names and round-trips an example through HTTP.
"""

from __future__ import annotations

from typing import Any

import kmock as kmock_lib
import yaml

from polyrl_operator import crdgen
from polyrl_operator.api import RLJob
from polyrl_testenv.bad_rljobs import CPU_EXAMPLE

NAMES = crdgen.build_crd()["spec"]["names"]
BASE = "/apis/polyrl.dev/v1alpha1"


async def test_kmock_serves_rljobs_from_crd_names(kmock: Any) -> None:
    kmock.resources["polyrl.dev/v1alpha1/rljobs"] = {
        "kind": NAMES["kind"],
        "singular": NAMES["singular"],
        "shortnames": set(NAMES["shortNames"]),
        "categories": set(NAMES["categories"]),
        "namespaced": True,
    }
    body = yaml.safe_load(CPU_EXAMPLE.read_text())
    body["metadata"]["namespace"] = "team-a"
    async with kmock.post(f"{BASE}/namespaces/team-a/rljobs", json=body) as resp:
        assert resp.status in {200, 201}

    async with kmock.get(f"{BASE}/namespaces/team-a/rljobs") as resp:
        listing = await resp.json()
    [item] = listing["items"]
    assert (
        RLJob.model_validate({k: v for k, v in item.items() if k != "status"}).metadata.name == "signal-game"
    )

    async with kmock.get(BASE) as resp:
        discovery = await resp.json()
    [resource] = [r for r in discovery["resources"] if r["name"] == "rljobs"]
    assert resource["kind"] == "RLJob"
    assert "rlj" in resource["shortNames"]
    assert isinstance(kmock, kmock_lib.KubernetesEmulator)
