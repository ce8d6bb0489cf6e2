"""Status helpers: metav1-style conditions whose lastTransitionTime moves only when status flips.

The operator is the only writer of ``status``; these helpers make writing it idempotent: the same
observation produces the same dict, so an unchanged job costs no write.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

CONDITION_TYPES = ("Admitted", "Ready", "Progressing", "Suspended", "Succeeded", "Failed", "QuotaExceeded")
MAX_MESSAGE = 32768
"""The CRD's maxLength (in characters) of status.message and of a condition's message."""


def clip(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message`` cut to ``limit`` characters, saying so: the API server refuses a whole status
    with a longer one, and messages quote user input (an InvalidSpec names the bad value)."""
    if len(message) <= limit:
        return message
    marker = f"... ({len(message)} characters, truncated)"
    return message[: limit - len(marker)] + marker


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def get_condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def is_true(status: dict[str, Any], ctype: str) -> bool:
    cond = get_condition(status, ctype)
    return cond is not None and cond.get("status") == "True"


def set_condition(
    conditions: list[dict[str, Any]],
    ctype: str,
    value: bool,
    *,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """A new list with ``ctype`` set; its lastTransitionTime is kept unless the status flips."""
    status = "True" if value else "False"
    out = [copy.deepcopy(c) for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else rfc3339(now)
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastTransitionTime": since,
        "reason": reason,
        "message": clip(message),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    out.sort(key=lambda c: order.get(c.get("type", ""), len(order)))
    return out


def transitioned(old: dict[str, Any], new: dict[str, Any], ctype: str) -> bool:
    """True when ``ctype`` became True in ``new`` (it was absent or not True in ``old``)."""
    return is_true(new, ctype) and not is_true(old, ctype)


def with_quota_exceeded(
    status: dict[str, Any], message: str, *, generation: int | None, now: datetime
) -> dict[str, Any]:
    """The status after a pod creation was refused for quota: nothing of the job runs, it waits."""
    out = copy.deepcopy(status)
    conds: list[dict[str, Any]] = out.get("conditions") or []
    for ctype, value, text in (
        ("QuotaExceeded", True, message),
        ("Admitted", False, message),
        ("Ready", False, "pods were removed until quota frees up"),
    ):
        conds = set_condition(
            conds, ctype, value, reason="QuotaExceeded", message=text, generation=generation, now=now
        )
    out["conditions"] = conds
    out["phase"] = "Pending"
    out["message"] = f"waiting for quota: {message}"
    return out
