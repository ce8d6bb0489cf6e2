"""Look up the class a job's ``spec.scheduling.priorityClassName`` names, for the Kueue Workload.

Kueue resolves a Workload's priority from a ``WorkloadPriorityClass`` of that name first, then from a
``scheduling.k8s.io`` ``PriorityClass``; ``builders.priority.resolve_priority`` is that rule as a pure
function over what this module reads. The lookup is two GETs at most (cluster-scoped objects; RBAC:
get on workloadpriorityclasses and priorityclasses), made only for a job with a queue while Kueue is
on, and only while its Workload does not already carry that class (then the Workload's record is the
answer: no GET per reconcile). A missing class is a result (``PriorityNotFound``, whose message names
the field), never an exception: the plan reports it in the job's conditions and events and creates
no Workload; the periodic resync looks again.
"""

from __future__ import annotations

from typing import Any

from polyrl_operator import naming
from polyrl_operator.builders.priority import Priority, PriorityNotFound, recorded_priority, resolve_priority
from polyrl_operator.kinds import KUEUE_API_VERSION
from polyrl_operator.kube import ApiError, KubeClient
from polyrl_operator.observed import Child

WORKLOAD_PRIORITY_CLASSES = f"/apis/{KUEUE_API_VERSION}/workloadpriorityclasses"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


def class_to_resolve(body: dict[str, Any], kueue_enabled: bool) -> str | None:
    """The class name a job's Workload needs resolved: set only for a job with a queue (the spec
    field or the ``kueue.x-k8s.io/queue-name`` label) while Kueue is on. Reads the stored body, so
    it also answers for a job that does not parse (whose plan reports that instead)."""
    scheduling = (body.get("spec") or {}).get("scheduling") or {}
    labels = (body.get("metadata") or {}).get("labels") or {}
    name = scheduling.get("priorityClassName")
    queued = scheduling.get("queueName") or labels.get(naming.LABEL_KUEUE_QUEUE)
    if not kueue_enabled or not queued or not isinstance(name, str) or not name:
        return None
    return name


async def _value(client: KubeClient, collection: str, name: str) -> int | None:
    """The class's ``value``; None when it does not exist (or its kind is not served at all)."""
    try:
        obj = await client.get(f"{collection}/{name}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    value = obj.get("value")
    return int(value) if isinstance(value, int) else 0


async def lookup_priority(client: KubeClient, name: str | None) -> Priority | PriorityNotFound | None:
    """Resolve ``name`` as Kueue does; None when the job names no priority class."""
    if not name:
        return None
    workload_value = await _value(client, WORKLOAD_PRIORITY_CLASSES, name)
    if workload_value is not None:
        return resolve_priority(name, {name: workload_value}, {})
    pod_value = await _value(client, PRIORITY_CLASSES, name)
    return resolve_priority(name, {}, {} if pod_value is None else {name: pod_value})


async def observe_priority(
    client: KubeClient, body: dict[str, Any], workload: Child | None, kueue_enabled: bool
) -> Priority | PriorityNotFound | None:
    """The job's priority for ``Observed.priority``: the job's Workload's own record of the class
    when it has one for this name, else a lookup; None when no resolution is needed."""
    name = class_to_resolve(body, kueue_enabled)
    if name is None:
        return None
    recorded = recorded_priority(workload.workload_priority if workload is not None else None, name)
    return recorded if recorded is not None else await lookup_priority(client, name)
