"""What the operator observes about a job's children, reduced to what planning needs.

The kopf indexes store these summaries (never whole objects, and never a Secret's data), so memory
stays small with thousands of children and a plan can be computed from a snapshot with no API call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from polyrl_operator import naming
from polyrl_operator.api.progress import Progress
from polyrl_operator.builders.priority import Priority, PriorityNotFound


@dataclass(frozen=True)
class Child:
    kind: str
    name: str
    namespace: str
    job: str
    uid: str = ""
    owner_uid: str | None = None
    spec_hash: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    """Only the polyrl.dev/* annotations the plan reads (drain, checkpoint request)."""
    deleting: bool = False
    # Pods
    phase: str = ""
    ready: bool = False
    unschedulable: str | None = None
    failure: str | None = None
    # Workloads
    active: bool | None = None
    workload_status: dict[str, Any] | None = None
    workload_priority: tuple[str, str, int] | None = None
    """(kind, name, value) of the class the Workload's priority came from."""

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    @property
    def role(self) -> str | None:
        return self.label(naming.LABEL_ROLE)

    @property
    def policy(self) -> str | None:
        return self.label(naming.LABEL_POLICY)

    @property
    def pool(self) -> str | None:
        return self.label(naming.LABEL_POOL)

    @property
    def owner(self) -> str:
        """Whose pod it is: its policy, or its pool for a pool pod; "" for the job's own roles."""
        return self.policy or self.pool or ""

    @property
    def index(self) -> int:
        try:
            return int(self.label(naming.LABEL_INDEX) or 0)
        except ValueError:
            return 0

    @property
    def attempt(self) -> int:
        try:
            return int(self.label(naming.LABEL_ATTEMPT) or 0)
        except ValueError:
            return 0

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def live(self) -> bool:
        return not self.deleting and not self.terminated


def _pod_failure(status: dict[str, Any]) -> str | None:
    if status.get("phase") != "Failed":
        return None
    parts = [p for p in (status.get("reason"), status.get("message")) if p]
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term:
            detail = f"container {cs.get('name')} exited {term.get('exitCode')}"
            if term.get("reason"):
                detail += f" ({term['reason']})"
            parts.append(detail)
    return "; ".join(str(p) for p in parts) or "pod failed"


def summarize(kind: str, body: dict[str, Any]) -> Child:
    """The summary of one child object (a pure function of its body)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    status = body.get("status") or {}
    child = Child(
        kind=kind,
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        job=labels.get(naming.LABEL_JOB, ""),
        uid=meta.get("uid", ""),
        owner_uid=owner.get("uid") if owner else None,
        spec_hash=annotations.get(naming.ANNOTATION_HASH),
        labels=tuple(sorted((k, v) for k, v in labels.items() if k.startswith(naming.DOMAIN))),
        annotations=tuple(
            sorted(
                (k, v)
                for k, v in annotations.items()
                if k.startswith(naming.DOMAIN) and k != naming.ANNOTATION_HASH
            )
        ),
        deleting=bool(meta.get("deletionTimestamp")),
    )
    if kind == "Pod":
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = (conditions.get("Ready") or {}).get("status") == "True"
        scheduled = conditions.get("PodScheduled") or {}
        unschedulable = (
            scheduled.get("message") or "unschedulable"
            if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
            else None
        )
        return _with(
            child,
            phase=status.get("phase") or "Pending",
            ready=ready and status.get("phase") == "Running",
            unschedulable=unschedulable,
            failure=_pod_failure(status),
        )
    if kind == "Workload":
        spec = body.get("spec") or {}
        ref = spec.get("priorityClassRef") or {}
        value = spec.get("priority")
        recorded = (
            (str(ref.get("kind")), str(ref.get("name")), value)
            if ref.get("name") and isinstance(value, int)
            else None
        )
        return _with(
            child,
            active=spec.get("active", True),
            workload_priority=recorded,
            workload_status={
                "admission": status.get("admission"),
                "conditions": status.get("conditions") or [],
            },
        )
    return child


def _with(child: Child, **changes: Any) -> Child:
    return replace(child, **changes)


@dataclass
class Observed:
    """Everything plan() looks at besides the RLJob itself."""

    children: list[Child] = field(default_factory=list)
    progress: Progress | None = None
    """The coordinator's latest /progress, when fresh; None when unknown."""
    progress_error: str | None = None
    flavors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Kueue ResourceFlavor specs by name (only those the admission names)."""
    priority: Priority | PriorityNotFound | None = None
    """``spec.scheduling.priorityClassName`` resolved as Kueue does, for a job with a queue (None:
    the job names no class, or has no queue and so needs no resolution)."""

    def of(self, kind: str) -> list[Child]:
        return [c for c in self.children if c.kind == kind]

    @property
    def resolved_priority(self) -> Priority | None:
        """The priority found (None: none named, none needed, or the class does not exist)."""
        return self.priority if isinstance(self.priority, Priority) else None
