"""Quota without Kueue: what a refusal by the API server (ResourceQuota) leaves for the next plan.

All or nothing: when a pod the job cannot run without is refused, the reconciler removes the job's
pods and no pod is tried again until a backoff ends (``JobMemory.quota_retry_at`` blocks the plan).
An optional pod refused (a rollout replica above the minimum) only counts toward the backoff. Either
way the refusal is remembered for the next plan, whose status reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from polyrl_operator.api import RLJobStatus
from polyrl_operator.planning.conditions import clip, get_condition
from polyrl_operator.planning.types import Event, JobMemory, QuotaRefusal
from polyrl_operator.settings import OperatorSettings


@dataclass(frozen=True)
class Refused:
    """The reconciler's part after a refusal: what to remember, what to say, when to plan again."""

    memory: JobMemory
    event: Event
    look_again: float
    """Seconds until the next plan: at once when its status has news (the refusal), else the backoff."""


def refused(
    memory: JobMemory,
    refusal: QuotaRefusal,
    *,
    status: RLJobStatus | None,
    settings: OperatorSettings,
    now: datetime,
) -> Refused:
    """``memory`` after apply reported ``refusal``; ``status``: the one this reconcile wrote."""
    failures = memory.quota_failures + 1
    delay = min(settings.quota_backoff * 2 ** (failures - 1), settings.quota_backoff_max)
    retry_at = now.timestamp() + delay if refusal.required else memory.quota_retry_at
    remembered = replace(
        memory,
        quota_failures=failures,
        quota_message=refusal.message,
        quota_retry_at=retry_at,
        quota_refusal=refusal,
    )
    removed = "removed the job's pods, " if refusal.required else ""
    event = Event("Warning", "QuotaExceeded", f"{refusal.message}; {removed}retrying in {delay:g}s")
    # A required refusal: the next plan is blocked until retry_at and asks to look again then, so
    # planning at once cannot loop. An optional one: planning at once would try the pod again, so
    # that happens only while the status does not say so yet.
    news = refusal.required or not _reports(status, refusal)
    return Refused(remembered, event, 0.0 if news else delay)


def quota_back(memory: JobMemory) -> JobMemory:
    """A pod was created with no refusal while one was remembered: quota is back."""
    return replace(memory, quota_message=None, quota_failures=0)


def _reports(status: RLJobStatus | None, refusal: QuotaRefusal) -> bool:
    condition = get_condition(status, "QuotaExceeded") if status is not None else None
    return condition is not None and condition.status == "True" and condition.message == clip(refusal.message)
