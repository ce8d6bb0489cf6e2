"""Status conditions (``polyrl_operator.planning.conditions``)."""

from __future__ import annotations

from polyrl_operator.planning.conditions import set_conditions
from polyrl_testenv.operator_fixtures import T0, later


def test_conditions_keep_transition_time_until_status_flips() -> None:
    conds = set_conditions([], {"Ready": (False, "Creating", "")}, generation=1, now=T0)
    same = set_conditions(conds, {"Ready": (False, "PodsNotReady", "x")}, generation=2, now=later(10))
    assert same[0].last_transition_time == conds[0].last_transition_time and same[0].reason == "PodsNotReady"
    flipped = set_conditions(same, {"Ready": (True, "PodsReady", "")}, generation=2, now=later(20))
    assert flipped[0].last_transition_time == "2026-01-01T12:00:20Z"
    ordered = set_conditions(
        flipped, {"Failed": (False, "NotFailed", ""), "Admitted": (True, "NoQueue", "")}, generation=2, now=T0
    )
    assert [c.type for c in ordered] == ["Admitted", "Ready", "Failed"]
