"""The plan's value types: what ``plan()`` returns and what the reconciler keeps between plans.

Every type here is frozen: each planning step returns a new value and ``plan()`` composes them, so
no step can change what another decided behind its back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from polyrl_operator.api import RLJob, RLJobStatus
from polyrl_operator.api.progress import Progress
from polyrl_operator.autoscale import ScaleState
from polyrl_operator.builders import JobRef
from polyrl_operator.builders.common import Manifest
from polyrl_operator.roles import Role

Key = tuple[str, str]
"""(kind, name) of a child."""
RoleKey = tuple[str, Role]
"""(owner, role): the owner is the policy of a policy's role, the pool of a pool, "" for the job's
own roles. A role placed on a pool has a key too, counting the pool pods it runs on."""


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class QuotaRefusal:
    """What apply reports when the API server refused a pod for quota: an input of the next plan,
    whose status says so (status is written in one place, from the plan)."""

    message: str
    required: bool
    """A pod the job cannot run without: the job was rolled back (all or nothing)."""


@dataclass(frozen=True)
class JobMemory:
    """What the reconciler remembers between plans of one job (lost on restart, harmlessly)."""

    scale: dict[str, ScaleState] = field(default_factory=dict)
    quota_failures: int = 0
    quota_retry_at: float | None = None
    quota_message: str | None = None
    quota_refusal: QuotaRefusal | None = None
    """The refusal the last apply reported, not yet in a status: the next plan reports it and
    forgets it (each refusal feeds exactly one plan)."""
    checkpoint: tuple[str, str] | None = None
    """(request id, since) of the checkpoint asked for, until the coordinator pod shows it."""
    rejected: tuple[int | None, str] | None = None
    """(generation, why) when the API server refused a child rendered from that generation's spec
    (422: e.g. a podTemplate field of the wrong type): InvalidSpec until the spec changes. Lost on
    restart, which costs one more refused attempt."""


@dataclass(frozen=True)
class Actions:
    """Side decisions of a planning step: events to record, children to leave alone, pod annotations
    to patch and when to look again. Steps return these; ``combine`` merges them."""

    events: tuple[Event, ...] = ()
    keep: frozenset[Key] = frozenset()
    """Children left as they are (e.g. finished pods kept for their logs)."""
    annotate: tuple[tuple[str, tuple[tuple[str, str | None], ...]], ...] = ()
    """(pod, ((annotation, value or None to remove), ...)) to set in place."""
    requeue_after: float | None = None


def combine(*parts: Actions) -> Actions:
    """All the parts' actions; the soonest requeue wins; later annotations of a pod win."""
    delays = [p.requeue_after for p in parts if p.requeue_after is not None]
    return Actions(
        events=tuple(e for p in parts for e in p.events),
        keep=frozenset().union(*(p.keep for p in parts)),
        annotate=tuple(a for p in parts for a in p.annotate),
        requeue_after=max(min(delays), 0.5) if delays else None,
    )


@dataclass(frozen=True)
class PodPlan:
    """The pod part of a plan: the pods that must exist, and the counts the status reports."""

    desired: dict[RoleKey, int]
    ready: dict[RoleKey, int]
    pods: dict[Key, Manifest] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    """Pods without which the job cannot run: a quota refusal of one of them rolls the job back."""
    actions: Actions = field(default_factory=Actions)
    scale: dict[str, ScaleState] = field(default_factory=dict)
    scaled: tuple[tuple[str, str, int, int], ...] = ()
    """(owner, role, from, to) for every scale decision (owner as in ``RoleKey``)."""
    checkpoint: tuple[str, str] | None = None
    """The checkpoint request (id, since) made while stopping, to remember."""
    checkpointing: bool = False
    """Stopping waits for a checkpoint the coordinator has not finished yet."""
    all_required_exist: bool = False
    ready_enough: bool = False
    any_live: bool = False
    """Some pod of the job still exists (a suspension is complete when none does)."""
    stop_message: str = ""
    wait_message: str = ""
    not_ready_reason: str = "Creating"


@dataclass(frozen=True)
class AdmissionState:
    """Whether the job may run its pods: no queue, or Kueue's verdict on its Workload."""

    admitted: bool
    reason: str
    message: str


@dataclass(frozen=True)
class StatusInputs:
    """Everything the status of a live (neither finished nor invalid) job is computed from."""

    job: RLJob
    old: RLJobStatus
    generation: int | None
    now: datetime
    progress: Progress | None
    restarts: int
    pods: PodPlan
    stop_reason: str | None
    """Why no pod should run (Suspended, Evicted, NotAdmitted, QuotaExceeded, DeadlineExceeded)."""
    admission: AdmissionState
    quota_message: str | None
    """The last quota refusal, until a pod is created again."""
    refusal: QuotaRefusal | None = None
    """The refusal apply reported since the last plan (when the required pods were refused, the
    job's pods were removed and it waits: phase Pending)."""


@dataclass(frozen=True)
class Plan:
    """Everything one reconcile should do for one job."""

    ref: JobRef
    status: RLJobStatus | None
    """The status to write (None: leave it, e.g. while the job is being deleted)."""
    desired: dict[Key, Manifest] = field(default_factory=dict)
    """Children that must exist with exactly this content (pods: recreated when the hash differs)."""
    actions: Actions = field(default_factory=Actions)
    required_pods: frozenset[str] = frozenset()
    finalizer: Literal["add", "remove"] | None = None
    delete_job: bool = False
    memory: JobMemory = field(default_factory=JobMemory)
    scaled: tuple[tuple[str, str, int, int], ...] = ()
    running: bool = False
    """Pods are wanted (admitted, not suspended, not finished)."""

    @property
    def events(self) -> tuple[Event, ...]:
        return self.actions.events

    @property
    def keep(self) -> frozenset[Key]:
        return self.actions.keep

    @property
    def annotate(self) -> dict[str, dict[str, str | None]]:
        out: dict[str, dict[str, str | None]] = {}
        for pod, values in self.actions.annotate:
            out.setdefault(pod, {}).update(values)
        return out

    @property
    def requeue_after(self) -> float | None:
        return self.actions.requeue_after
