"""``polyrl render``: the manifests the operator creates for an RLJob, from the same plan it runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from polyrl_operator import naming
from polyrl_operator.kinds import child_kind
from polyrl_operator.observed import Child, Observed
from polyrl_operator.planning.conditions import get_condition
from polyrl_operator.planning.plan import plan
from polyrl_operator.settings import OperatorSettings

RENDER_UID = "00000000-0000-0000-0000-000000000000"
RENDER_TIME = datetime(2000, 1, 1, tzinfo=UTC)


def _admitted_workload(meta: dict[str, Any]) -> Child:
    return Child(
        kind="Workload",
        name=meta["name"],
        namespace=meta["namespace"],
        job=meta["name"],
        owner_uid=meta["uid"],
        workload_status={
            "admission": {"clusterQueue": "", "podSetAssignments": []},
            "conditions": [{"type": "Admitted", "status": "True"}],
        },
    )


def render(
    body: dict[str, Any], settings: OperatorSettings, *, namespace: str = "default"
) -> list[dict[str, Any]]:
    """The manifests the operator creates for ``body`` once it is admitted, in apply order.

    Deterministic (fixed uid, no token, fixed clock) so the output can be diffed in review or GitOps.
    Elastic roles are shown at their minimum replica count; a Kueue job is shown as admitted. No
    class is looked up: a Kueue job's Workload is shown without ``priorityClassRef``/``priority``
    and its pods without ``priorityClassName`` (what the operator sets once it knows the kind).
    ValueError: the operator would reject the job (the message names the field)."""
    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", namespace)
    meta.setdefault("uid", RENDER_UID)  # a live object's own uid keeps the ownerReferences exact
    meta.update(generation=1, finalizers=[naming.FINALIZER])
    body["metadata"] = meta
    body.pop("status", None)
    spec_queue = ((body.get("spec") or {}).get("scheduling") or {}).get("queueName")
    labels = meta.get("labels") or {}
    queued = bool(spec_queue or labels.get(naming.LABEL_KUEUE_QUEUE))
    children = [_admitted_workload(meta)] if queued else []
    result = plan(body, Observed(children=children), settings, RENDER_TIME)
    failed = get_condition(result.status, "Failed") if result.status is not None else None
    if failed is not None and failed.status == "True":
        raise ValueError(failed.message)
    manifests = list(result.desired.values())
    for manifest in manifests:
        if manifest["kind"] == "Secret":
            manifest["stringData"] = {naming.TOKEN_KEY: "<generated when the Secret is created>"}
    manifests.sort(key=lambda m: (child_kind(m["kind"]).apply_order, m["metadata"]["name"]))
    return manifests


__all__ = ["RENDER_UID", "render"]
