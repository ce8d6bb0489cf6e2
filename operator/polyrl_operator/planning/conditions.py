"""metav1-style conditions whose lastTransitionTime moves only when their status flips, and the
time and message helpers every status field uses.

The same observation gives the same conditions, so an unchanged job costs no status write.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final, Literal, get_args

from polyrl_operator.api import Condition, RLJobStatus
from polyrl_operator.api.status import ConditionType

ORDER: Final[dict[str, int]] = {t: i for i, t in enumerate(get_args(ConditionType))}
MAX_MESSAGE: Final = 32768
"""The CRD's maxLength (in characters) of status.message and of a condition's message."""

Setting = tuple[bool, str, str]
"""(status, reason, message) of one condition."""


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


def get_condition(status: RLJobStatus, ctype: ConditionType) -> Condition | None:
    return next((c for c in status.conditions or [] if c.type == ctype), None)


def set_conditions(
    conditions: list[Condition] | None,
    values: dict[ConditionType, Setting],
    *,
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """A new list with every type in ``values`` set, in ``ConditionType`` order; each one's
    lastTransitionTime is kept unless its status flips."""
    old = {c.type: c for c in conditions or []}
    out = dict(old)
    for ctype, (value, reason, message) in values.items():
        status: Literal["True", "False"] = "True" if value else "False"
        prior = old.get(ctype)
        since = prior.last_transition_time if prior is not None and prior.status == status else rfc3339(now)
        out[ctype] = Condition(
            type=ctype,
            status=status,
            observed_generation=generation,
            last_transition_time=since,
            reason=reason,
            message=clip(message),
        )
    return sorted(out.values(), key=lambda c: ORDER.get(c.type, len(ORDER)))
