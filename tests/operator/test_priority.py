"""Reading a job's priority class for Kueue (``polyrl_operator.priority``): which jobs need their
class resolved, and the lookup against the control plane's PriorityClasses. The rules themselves are
``builders/test_priority.py``; the reconciler waiting for a missing class is
``reconciling/test_reconciler.py``; ``system/test_operator_controlplane.py`` runs a
WorkloadPriorityClass through the real operator and Kueue's CRDs."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from polyrl_operator.builders.priority import Priority, PriorityNotFound
from polyrl_operator.kube import KubeClient, load_credentials
from polyrl_operator.priority import class_to_resolve, lookup_priority
from polyrl_testenv import ControlPlane

TO_RESOLVE_CASES: list[tuple[str, dict[str, Any], dict[str, str], bool, str | None]] = [
    ("queue in the spec", {"queueName": "team-a", "priorityClassName": "high"}, {}, True, "high"),
    ("queue from the label", {"priorityClassName": "high"}, {"kueue.x-k8s.io/queue-name": "q"}, True, "high"),
    ("no queue: the pods' own class, nothing to resolve", {"priorityClassName": "high"}, {}, True, None),
    ("Kueue off", {"queueName": "team-a", "priorityClassName": "high"}, {}, False, None),
    ("no class named", {"queueName": "team-a"}, {}, True, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "scheduling", "labels", "kueue", "expected"),
    TO_RESOLVE_CASES,
    ids=[c[0] for c in TO_RESOLVE_CASES],
)
def test_which_jobs_need_their_class_resolved(
    case: str, scheduling: dict[str, Any], labels: dict[str, str], kueue: bool, expected: str | None
) -> None:
    body = {"metadata": {"name": "j", "labels": labels}, "spec": {"scheduling": scheduling}}
    assert class_to_resolve(body, kueue) == expected


@pytest.mark.controlplane
def test_lookup_against_the_api_server(controlplane: ControlPlane) -> None:
    name = f"t-prio-{uuid.uuid4().hex[:6]}"
    body = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 4242,
    }
    code, created = controlplane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body)
    assert code == 201, created

    async def lookups() -> list[Priority | PriorityNotFound | None]:
        client = KubeClient(load_credentials(str(controlplane.kubeconfig)))
        try:
            return [await lookup_priority(client, n) for n in (name, "no-such-class", None)]
        finally:
            await client.close()

    try:
        found, missing, unset = asyncio.run(lookups())
    finally:
        controlplane.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
    assert found == Priority(name, "PriorityClass", 4242)
    assert missing == PriorityNotFound("no-such-class")
    assert unset is None
