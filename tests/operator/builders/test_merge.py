"""Strategic merge of ``podTemplate`` overrides (``polyrl_operator.builders.merge``), one row per
rule: maps merge key by key (None deletes), named lists merge by name, tolerations append, other
lists are replaced; the base is never changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from polyrl_operator.builders import strategic_merge

MERGE_CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("maps merge; None deletes a key", {"a": {"b": 1, "c": 2}}, {"a": {"c": None, "d": 3}}, {"a": {"b": 1, "d": 3}}),
    (
        "env merges by name",
        {"env": [{"name": "X", "value": "1"}]},
        {"env": [{"name": "X", "value": "2"}, {"name": "Y"}]},
        {"env": [{"name": "X", "value": "2"}, {"name": "Y"}]},
    ),
    ("tolerations append", {"tolerations": [{"k": 1}]}, {"tolerations": [{"k": 2}]}, {"tolerations": [{"k": 1}, {"k": 2}]}),
    ("other lists are replaced", {"args": [1]}, {"args": [2]}, {"args": [2]}),
    (
        "all at once",
        {"a": {"b": 1, "c": 2}, "env": [{"name": "X", "value": "1"}], "tolerations": [{"k": 1}], "args": [1]},
        {"a": {"c": None, "d": 3}, "env": [{"name": "X", "value": "2"}, {"name": "Y"}], "tolerations": [{"k": 2}], "args": [2]},
        {"a": {"b": 1, "d": 3}, "env": [{"name": "X", "value": "2"}, {"name": "Y"}], "tolerations": [{"k": 1}, {"k": 2}], "args": [2]},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "base", "patch", "expected"), MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_strategic_merge(
    case: str, base: dict[str, Any], patch: dict[str, Any], expected: dict[str, Any]
) -> None:
    before = copy.deepcopy(base)
    assert strategic_merge(base, patch) == expected
    assert base == before
