"""A job's priority as values (``polyrl_operator.builders.priority``), resolved as Kueue does: a
WorkloadPriorityClass of that name first, then a PriorityClass; what a Workload records answers for
its class."""

from __future__ import annotations

import pytest

from polyrl_operator.builders.priority import Priority, PriorityNotFound, recorded_priority, resolve_priority

WPC = {"rl-batch": 1000, "shared": 50}


PC = {"shared": 7, "system-cluster-critical": 2000000000}


RESOLVE_CASES: list[tuple[str, str | None, Priority | PriorityNotFound | None]] = [
    ("no class named", None, None),
    ("empty name", "", None),
    ("a WorkloadPriorityClass", "rl-batch", Priority("rl-batch", "WorkloadPriorityClass", 1000)),
    ("both exist: the WorkloadPriorityClass wins", "shared", Priority("shared", "WorkloadPriorityClass", 50)),
    ("only a PriorityClass", "system-cluster-critical", Priority("system-cluster-critical", "PriorityClass", 2000000000)),
    ("neither", "missing", PriorityNotFound("missing")),
]  # fmt: skip


@pytest.mark.parametrize(("case", "name", "expected"), RESOLVE_CASES, ids=[c[0] for c in RESOLVE_CASES])
def test_resolve_priority(case: str, name: str | None, expected: Priority | PriorityNotFound | None) -> None:
    assert resolve_priority(name, WPC, PC) == expected


RECORDED_CASES: list[tuple[str, tuple[str, str, int] | None, str, Priority | None]] = [
    ("no Workload record", None, "rl-batch", None),
    ("the class named", ("WorkloadPriorityClass", "rl-batch", 10), "rl-batch", Priority("rl-batch", "WorkloadPriorityClass", 10)),
    ("a PriorityClass", ("PriorityClass", "high", 7), "high", Priority("high", "PriorityClass", 7)),
    ("another class: the spec changed, look again", ("PriorityClass", "high", 7), "rl-batch", None),
    ("a kind Kueue does not know", ("Other", "rl-batch", 7), "rl-batch", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "recorded", "name", "expected"), RECORDED_CASES, ids=[c[0] for c in RECORDED_CASES]
)
def test_a_workloads_record_answers_for_its_class(
    case: str, recorded: tuple[str, str, int] | None, name: str, expected: Priority | None
) -> None:
    assert recorded_priority(recorded, name) == expected


def test_a_missing_class_names_the_field() -> None:
    message = PriorityNotFound("rl-batch").message
    assert message.startswith("spec.scheduling.priorityClassName:") and "'rl-batch'" in message
