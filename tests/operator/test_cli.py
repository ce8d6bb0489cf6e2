"""The ``polyrl`` command's own decisions (``polyrl_operator.cli``)."""

from __future__ import annotations

from polyrl_operator.cli import with_own_namespace
from polyrl_operator.settings import OperatorSettings


def test_operator_namespace_comes_from_the_pod_unless_set() -> None:
    assert OperatorSettings().network_policy.namespace() == "polyrl-system"
    mine = with_own_namespace(OperatorSettings(), "ops")
    assert mine.network_policy.namespace() == "ops"
    pinned = OperatorSettings.model_validate({"networkPolicy": {"operatorNamespace": "admin"}})
    assert with_own_namespace(pinned, "ops").network_policy.namespace() == "admin"
